"""More reductions with PyTorch's names: prod (gradient exact where the input has zeros), all, any, amin."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._dispatch import apply, defop
from ._ops_reduce import OP_AMIN, _expand_back, _norm_axes, _reduced_shape
from ._tensor import Tensor
from ._xp import NP

# ---- prod ------------------------------------------------------------------------------------------------


def _prod_dtype(dt: np.dtype[Any]) -> np.dtype[Any]:
    return np.dtype(np.int64) if dt.kind in "biu" else dt  # PyTorch: bool and integers multiply in int64


def _prod_meta(a: Tensor, axis: Any, keepdims: bool) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return _reduced_shape(tuple(a.shape), axis, keepdims), _prod_dtype(a.dtype)


def _prod_kernel(a: np.ndarray, axis: Any, keepdims: bool) -> np.ndarray:
    return np.asarray(np.prod(a, axis=axis, keepdims=keepdims, dtype=_prod_dtype(a.dtype)))


def _to_last(shape: tuple[int, ...], axis: Any) -> tuple[list[int], list[int], tuple[int, ...]]:
    """The permutation moving the reduced axes last, its inverse, and the kept leading shape."""
    nd = len(shape)
    red = list(range(nd)) if axis is None else list(axis)
    keep = [i for i in range(nd) if i not in red]
    perm = keep + red
    return perm, [int(i) for i in np.argsort(perm)], tuple(shape[i] for i in keep)


def _np_prod_others(x: np.ndarray, axis: Any) -> np.ndarray:
    """For each element, the product of the other elements of its slice (exclusive prefix x suffix products:
    exact with zeros, no division)."""
    perm, inv, lead = _to_last(x.shape, axis)
    flat = np.transpose(x, perm).reshape((*lead, -1))
    left = np.ones_like(flat)
    right = np.ones_like(flat)
    if flat.shape[-1] > 1:
        np.cumprod(flat[..., :-1], axis=-1, out=left[..., 1:])
        right[..., :-1] = np.cumprod(flat[..., :0:-1], axis=-1)[..., ::-1]
    shaped = (left * right).reshape(tuple(x.shape[i] for i in perm))
    return np.transpose(shaped, inv)


def _ag_prod_others(x: Tensor, out: Tensor, axis: Any, keepdims: bool) -> Tensor:
    """`_np_prod_others` as recorded ops (create_graph): ``out / x`` when no element is 0, else the product
    over each slice with the element itself replaced by 1 (smooth everywhere, so higher derivatives at
    zeros are right too; it builds an n x n block per slice, only for inputs that contain zeros)."""
    from ._ops_elementwise import where
    from ._ops_shape import broadcast_to, expand_dims, permute, reshape

    if not (x.numpy() == 0).any():
        return _expand_back(_ag(), out, tuple(x.shape), axis, keepdims) / x
    perm, inv, lead = _to_last(tuple(x.shape), axis)
    n = int(np.prod([x.shape[i] for i in perm[len(lead) :]], dtype=np.int64))
    flat = reshape(permute(x, tuple(perm)), (*lead, n))
    square = broadcast_to(expand_dims(flat, -2), (*lead, n, n))
    others = prod(where(np.eye(n, dtype=bool), 1, square), -1)
    return permute(reshape(others, tuple(x.shape[i] for i in perm)), tuple(inv))


def _ag() -> Any:
    from ._apply import ag_namespace

    return ag_namespace()


def _prod_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x = args[0]
    axis, keepdims = kw["axis"], kw["keepdims"]
    gb = _expand_back(xp, g, tuple(x.shape), axis, keepdims)
    if xp is NP:
        return (gb * _np_prod_others(x, axis),)
    return (gb * _ag_prod_others(x, out, axis, keepdims),)


OP_PROD = defop("prod", _prod_kernel, _prod_meta, _prod_rule, save_out=True)


def prod(input: Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:
    """Product of the elements over ``dim`` (all when None), like ``torch.prod``.

    The gradient is the product of the other elements, so it is exact where the input has zeros.
    """
    x = input if dtype is None else input.to(dtype=dtype)
    return apply(OP_PROD, (x,), {"axis": _norm_axes("prod", tuple(x.shape), dim), "keepdims": bool(keepdim)})


# ---- all / any -----------------------------------------------------------------------------------------


def _logical_meta(a: Tensor, axis: Any, keepdims: bool) -> tuple[tuple[int, ...], np.dtype[Any]]:
    # PyTorch keeps uint8 for uint8 inputs, bool otherwise
    dt = np.dtype(np.uint8) if a.dtype == np.uint8 else np.dtype(np.bool_)
    return _reduced_shape(tuple(a.shape), axis, keepdims), dt


def _logical_kernel(f: Any) -> Any:
    def k(a: np.ndarray, axis: Any, keepdims: bool) -> np.ndarray:
        r = np.asarray(f(a, axis=axis, keepdims=keepdims))
        return r.astype(np.uint8) if a.dtype == np.uint8 else r

    return k


OP_ALL = defop("all", _logical_kernel(np.all), _logical_meta)
OP_ANY = defop("any", _logical_kernel(np.any), _logical_meta)


def all(input: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Whether every element (over ``dim``; all when None) is nonzero: a bool tensor."""
    return apply(OP_ALL, (input,), {"axis": _norm_axes("all", tuple(input.shape), dim), "keepdims": bool(keepdim)})


def any(input: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Whether any element (over ``dim``; all when None) is nonzero: a bool tensor."""
    return apply(OP_ANY, (input,), {"axis": _norm_axes("any", tuple(input.shape), dim), "keepdims": bool(keepdim)})


# ---- amin ------------------------------------------------------------------------------------------------


def amin(input: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Smallest values over ``dim`` (ties share the gradient), like ``torch.amin``."""
    return apply(OP_AMIN, (input,), {"axis": _norm_axes("amin", tuple(input.shape), dim), "keepdims": bool(keepdim)})


def _install() -> None:
    T = Tensor
    for f in (prod, all, any, amin):
        setattr(T, f.__name__, f)


_install()
