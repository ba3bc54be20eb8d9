"""Sorting and selection with PyTorch's names and semantics: sort, argsort, topk, masked_select, nonzero.

sort and topk return ``(values, indices)`` named tuples. The indices come from an op without a gradient;
the values are a second op gathering the input at those indices, whose rule scatters the gradient back
(so the gradient goes to the picked elements, and second derivatives work). Sorting is always stable:
equal elements keep their order (PyTorch's ``stable=True``; a valid result for ``stable=False`` too), and
NaN sorts as the largest value, as PyTorch.

masked_select and nonzero have data-dependent result shapes, so they wait for the values they need.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..runtime._dispatch import apply
from ..runtime._meta import norm_dim
from ..runtime._op import OpError, defop
from ..runtime._tensor import Tensor
from ._index import _gather_index, getitem
from ._shape import broadcast_to, reshape


class SortResult(NamedTuple):
    """``(values, indices)`` from `sort`, like ``torch.return_types.sort``."""

    values: Tensor
    indices: Tensor


class TopkResult(NamedTuple):
    """``(values, indices)`` from `topk`, like ``torch.return_types.topk``."""

    values: Tensor
    indices: Tensor


def _np_argsort(a: np.ndarray, axis: int, descending: bool) -> np.ndarray:
    if not descending:
        return np.argsort(a, axis=axis, kind="stable").astype(np.int64, copy=False)
    # stable descending: sort the reversed array ascending, reverse the result, map back the positions
    # (equal elements keep their order; NaN, last ascending, comes first)
    n = a.shape[axis]
    rev = np.flip(np.argsort(np.flip(a, axis), axis=axis, kind="stable"), axis)
    return (n - 1 - rev).astype(np.int64, copy=False)


# ---- index ops (no gradient) --------------------------------------------------------------------------------


def _argsort_meta(a: Tensor, axis: int, descending: bool, k: Any = None) -> tuple[tuple[int, ...], np.dtype[Any]]:
    shape = tuple(a.shape)
    if k is not None:
        shape = (*shape[:axis], k, *shape[axis + 1 :])
    return shape, np.dtype(np.int64)


def _argsort_kernel(a: np.ndarray, axis: int, descending: bool, k: Any = None) -> np.ndarray:
    idx = _np_argsort(a, axis, descending)
    if k is not None:
        idx = np.ascontiguousarray(idx[(slice(None),) * axis + (slice(0, k),)])
    return idx


OP_ARGSORT = defop("argsort", _argsort_kernel, _argsort_meta)


# ---- value ops: gather the input at the indices ------------------------------------------------------------


def _take_meta(a: Tensor, idx: Any, axis: int) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return tuple(idx.shape), a.dtype


def _take_kernel(a: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    return np.take_along_axis(a, idx, axis=axis)


def _take_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, idx = args
    return (xp.index_add(tuple(x.shape), _gather_index(xp.value(idx), kw["axis"]), g), None)


OP_SORT = defop("sort", _take_kernel, _take_meta, _take_rule)
OP_TOPK = defop("topk", _take_kernel, _take_meta, _take_rule)


def _check_sortable(op: str, x: Any) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: expected a Tensor, got {type(x).__name__}")
    if x.dtype.kind == "c":
        raise OpError(f"{op}: complex tensors (dtype {x.dtype}) have no order; sort their real or abs parts")


def sort(input: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> SortResult:
    """``(values, indices)`` of ``input`` sorted along ``dim`` (stable; NaN largest), like ``torch.sort``."""
    _check_sortable("sort", input)
    if input.ndim == 0:
        norm_dim("sort", input, dim)
        v, i = sort(input.reshape(1), 0, descending)
        return SortResult(v.reshape(()), i.reshape(()))
    d = norm_dim("sort", input, dim)
    idx = apply(OP_ARGSORT, (input,), {"axis": d, "descending": bool(descending)})
    return SortResult(apply(OP_SORT, (input, idx), {"axis": d}), idx)


def argsort(input: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Tensor:
    """The indices that sort ``input`` along ``dim`` (stable), like ``torch.argsort``."""
    _check_sortable("argsort", input)
    if input.ndim == 0:
        norm_dim("argsort", input, dim)
        return argsort(input.reshape(1), 0, descending).reshape(())
    d = norm_dim("argsort", input, dim)
    return apply(OP_ARGSORT, (input,), {"axis": d, "descending": bool(descending)})


def topk(input: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> TopkResult:
    """``(values, indices)`` of the ``k`` largest (or smallest) entries along ``dim``, like ``torch.topk``.

    The result is always sorted (largest first, or smallest first with ``largest=False``); among equal
    values the earlier index comes first.
    """
    _check_sortable("topk", input)
    if input.ndim == 0:
        norm_dim("topk", input, dim)
        v, i = topk(input.reshape(1), k, 0, largest, sorted)
        return TopkResult(v.reshape(()), i.reshape(()))
    d = norm_dim("topk", input, dim)
    n = input.shape[d]
    if not isinstance(k, (int, np.integer)) or not 0 <= k <= n:
        raise OpError(f"topk: k ({k!r}) must be an int in [0, {n}], the size of dim {d} of shape {tuple(input.shape)}")
    idx = apply(OP_ARGSORT, (input,), {"axis": d, "descending": bool(largest), "k": int(k)})
    return TopkResult(apply(OP_TOPK, (input, idx), {"axis": d}), idx)


# ---- masked_select, nonzero ---------------------------------------------------------------------------------


def masked_select(input: Tensor, mask: Any) -> Tensor:
    """The entries of ``input`` where the bool ``mask`` is True (both broadcast), as a 1-D tensor.

    Differentiable w.r.t. ``input``; waits for ``mask``'s value (the result's size depends on it).
    """

    m = mask._value() if isinstance(mask, Tensor) else np.asarray(mask)
    if m.dtype != np.bool_:
        raise OpError(f"masked_select: mask must have dtype bool, got {m.dtype}; compare first, e.g. x > 0")
    try:
        shape = tuple(np.broadcast_shapes(tuple(input.shape), m.shape))
    except ValueError:
        raise OpError(
            f"masked_select: input of shape {tuple(input.shape)} and mask of shape {m.shape} "
            "cannot be broadcast together"
        ) from None
    x = input if tuple(input.shape) == shape else broadcast_to(input, shape)
    if x.ndim == 0:

        x, m = reshape(x, (1,)), m.reshape(1)
    return getitem(x, np.broadcast_to(m, x.shape))


def nonzero(input: Tensor, *, as_tuple: bool = False) -> Any:
    """Indices of the nonzero entries: an int64 (count, ndim) tensor, or with ``as_tuple=True`` one 1-D
    tensor per dim; like ``torch.nonzero``. Waits for ``input``'s value; not differentiable."""
    if not isinstance(input, Tensor):
        raise TypeError(f"nonzero: expected a Tensor, got {type(input).__name__}")
    a = input._value()
    dev = input._dev
    if as_tuple:
        return tuple(Tensor._wrap(np.ascontiguousarray(i, dtype=np.int64), dev) for i in np.nonzero(np.atleast_1d(a)))
    return Tensor._wrap(np.argwhere(a).astype(np.int64, copy=False), dev)


def argwhere(input: Tensor) -> Tensor:
    """``nonzero(input)``: the (count, ndim) int64 indices of the nonzero entries."""
    return nonzero(input)  # type: ignore[no-any-return]
