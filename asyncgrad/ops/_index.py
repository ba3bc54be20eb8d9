"""scatter and scatter_add (out-of-place), with PyTorch's names, arguments and gradients.

``x.scatter(dim, index, src)`` is a copy of ``x`` with ``out[index[i][j]][j] = src[i][j]`` (dim 0);
``scatter_add`` adds instead. Only the leading ``index.shape`` block of ``src`` is used. Gradients: to
``x``, the incoming gradient with the overwritten positions zeroed (scatter) or unchanged (scatter_add);
to ``src``, the incoming gradient gathered at ``index`` (0 outside the used block: PyTorch refuses a
``src`` larger than ``index`` in backward, this gives the gradient instead).
"""

from __future__ import annotations

import builtins
import math
from typing import Any

import numpy as np

from ..runtime._dispatch import apply
from ..runtime._meta import _dim, _index_arg
from ..runtime._op import OpError, defop
from ..runtime._tensor import Tensor, share_version
from ..runtime._xp import register_xp


def _scatter_meta(
    x: Tensor, idx: Any, src: Any, dim: int, op: str, value: Any
) -> tuple[tuple[int, ...], np.dtype[Any]]:
    xs, ish = tuple(x.shape), tuple(idx.shape)
    if len(ish) != len(xs):
        raise OpError(f"{op}: index of shape {ish} must have as many dims as input {xs}")
    for d, (a, b) in enumerate(zip(ish, xs)):
        if d != dim and a > b:
            raise OpError(f"{op}: index {ish} is larger than input {xs} in dim {d} (only dim {dim} may be)")
    if src is not None:
        ss = tuple(src.shape)
        if len(ss) != len(xs) or any(a > b for a, b in zip(ish, ss)):
            raise OpError(f"{op}: src of shape {ss} must have as many dims as input {xs} and be at least index {ish}")
        if src.dtype != x.dtype:
            raise OpError(
                f"{op}: src dtype {src.dtype} must equal the input's dtype {x.dtype}; convert with .to(dtype)"
            )
    return xs, x.dtype


def _positions(x: np.ndarray, idx: np.ndarray, dim: int, op: str) -> tuple[Any, ...]:
    if idx.size and (idx.min() < 0 or idx.max() >= x.shape[dim]):
        raise IndexError(f"{op}: index out of bounds for dim {dim} with size {x.shape[dim]}")
    return _gather_index(idx.astype(np.intp, copy=False), dim)


def _used(src: np.ndarray, idx: np.ndarray) -> Any:
    """The block of ``src`` that the scatter reads (its leading ``idx.shape`` corner)."""
    return src[tuple(slice(0, n) for n in idx.shape)]


def _scatter_kernel(x: np.ndarray, idx: np.ndarray, src: Any, dim: int, op: str, value: Any) -> np.ndarray:
    out = x.copy()
    pos = _positions(x, idx, dim, op)
    vals = value if src is None else _used(src, idx)
    if op == "scatter":
        out[pos] = vals
    else:
        np.add.at(out, pos, vals)
    return out


def _src_grad(xp: Any, g: Any, src: Any, pos: tuple[Any, ...], ishape: tuple[int, ...]) -> Any:
    picked = g[pos]
    if tuple(src.shape) == ishape:
        return picked
    return xp.index_add(tuple(src.shape), tuple(slice(0, n) for n in ishape), picked)


def _scatter_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, idx, src = args
    iv = xp.value(idx)
    pos = _gather_index(iv.astype(np.intp, copy=False), kw["dim"])
    gx = gs = None
    if needs[0]:
        if kw["op"] == "scatter":
            keep = np.ones(tuple(x.shape), dtype=bool)
            keep[pos] = False
            gx = xp.where(xp.const(keep, g), g, 0)
        else:
            gx = g
    if needs[2]:
        gs = _src_grad(xp, g, src, pos, tuple(iv.shape))
    return (gx, None, gs)


OP_SCATTER = defop("scatter", _scatter_kernel, _scatter_meta, _scatter_rule)
OP_SCATTER_ADD = defop("scatter_add", _scatter_kernel, _scatter_meta, _scatter_rule)


def _scatter(op: str, input: Tensor, dim: int, index: Any, src: Any) -> Tensor:
    if not isinstance(input, Tensor):
        raise TypeError(f"{op}: input must be a Tensor, got {type(input).__name__}")
    idx = _index_arg(op, index)
    value = None
    if isinstance(src, (np.ndarray, list, tuple)):
        src = Tensor._wrap(np.asarray(src, dtype=input.dtype), input._dev)
    elif not isinstance(src, Tensor):
        if not isinstance(src, (int, float, bool, np.number)):
            raise TypeError(f"{op}: src must be a Tensor or a number, got {type(src).__name__}")
        src, value = None, src
    kw = {"dim": _dim(op, input, dim), "op": op, "value": value}
    return apply(OP_SCATTER if op == "scatter" else OP_SCATTER_ADD, (input, idx, src), kw)


def scatter(input: Tensor, dim: int, index: Any, src: Any = None, *, value: Any = None, reduce: Any = None) -> Tensor:
    """A copy of ``input`` with ``src`` (a tensor, or a number) written at ``index`` along ``dim``.

    ``reduce="add"`` is ``scatter_add``; for repeated indices the last write wins (PyTorch leaves it
    unspecified). Differentiable w.r.t. ``input`` and ``src``.
    """
    if src is None:
        src = value
    if src is None:
        raise TypeError("scatter: give src (a tensor) or value (a number)")
    if reduce is not None:
        if reduce != "add":
            raise OpError(f"scatter: reduce={reduce!r} is not supported; use 'add' or scatter_add")
        return _scatter("scatter_add", input, dim, index, src)
    return _scatter("scatter", input, dim, index, src)


def scatter_add(input: Tensor, dim: int, index: Any, src: Tensor) -> Tensor:
    """A copy of ``input`` with ``src`` added at ``index`` along ``dim`` (repeated indices accumulate)."""
    return _scatter("scatter_add", input, dim, index, src)


def _gather_meta(x: Tensor, idx: Any, dim: int) -> Any:
    if idx.ndim != x.ndim:
        raise OpError(f"gather: index of shape {tuple(idx.shape)} must have as many dims as input {x.shape}")
    for d, (a, b) in enumerate(zip(idx.shape, x.shape)):
        if d != dim and a > b:
            raise OpError(
                f"gather: index {tuple(idx.shape)} is larger than input {x.shape} in dim {d} "
                f"(only dim {dim} may be)"
            )
    return tuple(idx.shape), x.dtype


def _gather_kernel(x: np.ndarray, idx: np.ndarray, dim: int) -> np.ndarray:
    if idx.size and (idx.min() < 0 or idx.max() >= x.shape[dim]):
        raise IndexError(f"gather: index out of bounds for dim {dim} with size {x.shape[dim]}")
    sl = tuple(slice(0, n) if d != dim else slice(None) for d, n in enumerate(idx.shape))
    return np.take_along_axis(x[sl], idx.astype(np.intp, copy=False), axis=dim)


def _gather_index(idx: np.ndarray, dim: int) -> tuple[Any, ...]:
    """The full integer index tuple picking what gather(x, dim, idx) picks (for the scatter-add adjoint)."""
    nd = idx.ndim
    return tuple(
        idx if d == dim else np.arange(n).reshape([n if e == d else 1 for e in range(nd)])
        for d, n in enumerate(idx.shape)
    )


def _gather_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, idx = args
    return (xp.index_add(tuple(x.shape), _gather_index(xp.value(idx), kw["dim"]), g), None)


OP_GATHER = defop("gather", _gather_kernel, _gather_meta, _gather_rule)


def gather(input: Tensor, dim: int, index: Any) -> Tensor:
    """``out[i][j] = input[index[i][j]][j]`` (dim 0), like ``torch.gather``."""
    idx = _index_arg("gather", index)
    return apply(OP_GATHER, (input, idx), {"dim": _dim("gather", input, dim)})


def _isel_meta(x: Tensor, idx: Any, dim: int) -> Any:
    if idx.ndim > 1:
        raise OpError(f"index_select: index must be 0-d or 1-d, got shape {tuple(idx.shape)}")
    n = math.prod(idx.shape)
    return (*x.shape[:dim], n, *x.shape[dim + 1 :]), x.dtype


def _isel_kernel(x: np.ndarray, idx: np.ndarray, dim: int) -> np.ndarray:
    n = x.shape[dim]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"index_select: index out of range for dim {dim} with size {n}")
    return np.take(x, idx.reshape(-1), axis=dim)


def _isel_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, idx = args
    dim = kw["dim"]
    iv = xp.value(idx).reshape(-1) % x.shape[dim]
    return (xp.index_add(tuple(x.shape), (slice(None),) * dim + (iv,), g), None)


OP_INDEX_SELECT = defop("index_select", _isel_kernel, _isel_meta, _isel_rule)


def index_select(input: Tensor, dim: int, index: Any) -> Tensor:
    """The entries of ``input`` along ``dim`` at the 1-d ``index`` positions, like ``torch.index_select``."""
    idx = _index_arg("index_select", index)
    return apply(OP_INDEX_SELECT, (input, idx), {"dim": _dim("index_select", input, dim)})


def _norm_index(idx: Any, op: str = "getitem") -> Any:
    items = idx if isinstance(idx, tuple) else (idx,)
    out = []
    for i in items:
        if isinstance(i, Tensor):
            i = i._value()
        elif isinstance(i, list):
            i = np.asarray(i)
        if isinstance(i, np.ndarray) and i.dtype.kind not in "iub":
            raise OpError(f"{op}: index arrays must be integer or bool, got dtype {i.dtype}")
        out.append(i)
    return tuple(out)


def _is_int(i: Any) -> bool:
    return isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))


def _split_ints(items: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """PyTorch's order for an index mixing integers with index arrays: ``(ints, rest)`` or None.

    PyTorch selects with the integers first, then indexes what is left; numpy counts an integer as one
    more index array when arrays are present, and puts the indexed dims in front when the arrays and
    integers are not side by side (``x[1, :, [3, 0]]``: PyTorch (3, 2), numpy (2, 3)). Indexing with
    ``x[ints][rest]`` gives PyTorch's result.
    """
    if not any(_is_int(i) for i in items):
        return None
    if not any(isinstance(i, np.ndarray) and i.ndim > 0 for i in items):
        return None
    first: list[Any] = []
    rest: list[Any] = []
    for i in items:
        if _is_int(i):
            first.append(i)
        elif i is None:
            rest.append(i)
        elif i is Ellipsis:
            first.append(i)
            rest.append(i)
        else:
            # a bool mask spans as many dims as it has
            first.extend([slice(None)] * (i.ndim if isinstance(i, np.ndarray) and i.dtype == np.bool_ else 1))
            rest.append(i)
    return tuple(first), tuple(rest)


def _getitem_meta(a: Tensor, idx: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    probe = np.broadcast_to(np.empty((), a._dtype), a._shape)
    try:
        return probe[idx].shape, a._dtype
    except IndexError as e:
        raise OpError(f"getitem: index {idx!r} is invalid for shape {a._shape}: {e}") from None


def _getitem_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (xp.index_add(args[0].shape, kw["idx"], g),)


def _getitem_kernel(a: np.ndarray, idx: tuple[Any, ...]) -> np.ndarray:
    r = a[idx]
    if type(r) is not np.ndarray:  # every dim indexed by an int: numpy gives a scalar, PyTorch a 0-d view
        r = a[(*idx, Ellipsis)]
    return r  # type: ignore[no-any-return]


OP_GETITEM = defop("getitem", _getitem_kernel, _getitem_meta, _getitem_rule, saves=())


def _index_add(shape: tuple[int, ...], idx: Any, g: np.ndarray) -> np.ndarray:
    """Scatter-add ``g`` into zeros of ``shape`` at ``idx`` (the adjoint of ``x[idx]``)."""
    z = np.zeros(shape, dtype=g.dtype)
    if _is_basic(idx):
        z[idx] = g  # basic indexing never repeats an element
    else:
        np.add.at(z, idx, g)
    return z


def _is_basic(idx: Any) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return builtins.all(isinstance(i, (int, np.integer, slice, type(None), type(Ellipsis))) for i in items)


def _index_add_meta(g: Tensor, shape: tuple[int, ...], idx: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return shape, g._dtype


def _index_add_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g[kw["idx"]],)


OP_INDEX_ADD = defop(
    "index_backward", lambda g, shape, idx: _index_add(shape, idx, g), _index_add_meta, _index_add_rule
)


def index_add(shape: tuple[int, ...], idx: Any, g: Tensor) -> Tensor:
    """Zeros of ``shape`` with ``g`` added at ``idx`` (the adjoint of indexing)."""
    return apply(OP_INDEX_ADD, (g,), {"shape": tuple(shape), "idx": idx})


def getitem(x: Tensor, idx: Any) -> Tensor:
    """``x[idx]`` with basic (slices, ints, None, ...) and integer/bool array indexing, as in PyTorch."""
    items = _norm_index(idx)
    parts = _split_ints(items)
    if parts is not None:
        return apply(OP_GETITEM, (apply(OP_GETITEM, (x,), {"idx": parts[0]}),), {"idx": parts[1]})
    out = apply(OP_GETITEM, (x,), {"idx": items})
    if not any(isinstance(i, np.ndarray) for i in items):  # basic indexing: a view, as in PyTorch
        share_version(x, out)
    return out


def setitem_parts(idx: Any) -> tuple[list[Tensor], Any]:
    """For ``t[idx] = value``: the tensors in ``idx`` (to order the update after them) and
    ``assign(array, value, *their_arrays)``, which does the assignment with PyTorch's index order."""
    items = idx if isinstance(idx, tuple) else (idx,)
    tensors = [i for i in items if isinstance(i, Tensor)]
    for t in tensors:
        if t._dtype.kind not in "iub":
            raise OpError(f"setitem: index tensors must be integer or bool, got dtype {t._dtype}")
    template = _norm_index(tuple(None if isinstance(i, Tensor) else i for i in items), "setitem")
    where = [k for k, i in enumerate(items) if isinstance(i, Tensor)]

    def assign(a: np.ndarray, value: Any, *arrays: np.ndarray) -> None:
        full = list(template)
        for k, arr in zip(where, arrays):
            full[k] = arr
        parts = _split_ints(tuple(full))
        if parts is None:
            a[tuple(full)] = value
        else:
            a[parts[0]][parts[1]] = value  # a[ints] is a view: the assignment lands in `a`

    return tensors, assign


register_xp("index_add", _index_add, index_add)
