"""Reductions: sum, mean, max/min (full, or along a dim with indices), argmax/argmin."""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..runtime._dispatch import apply
from ..runtime._meta import _dim, _float_check
from ..runtime._op import Op, OpError, defop
from ..runtime._promote import to_float
from ..runtime._tensor import Tensor
from ..runtime._xp import AG, NP, register_xp
from ._elementwise import abs as _abs
from ._elementwise import maximum, minimum, sqrt, where
from ._shape import broadcast_to, expand_dims, permute, reshape


def _norm_axes(op: str, shape: tuple[int, ...], dim: Any) -> tuple[int, ...] | None:
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, (int, np.integer)) else tuple(dim)
    if not dims:  # PyTorch: an empty dim list reduces over every dimension
        return None
    n = len(shape)
    out = []
    for d in dims:
        if not -builtins.max(n, 1) <= d < builtins.max(n, 1):
            raise OpError(
                f"{op}: dim {d} is out of range for a tensor of shape {shape} "
                f"(expected a dim in [{-builtins.max(n, 1)}, {builtins.max(n, 1) - 1}])"
            )
        out.append(int(d) % builtins.max(n, 1))
    if len(set(out)) != len(out):
        raise OpError(f"{op}: dim {dim} repeats a dimension")
    return tuple(sorted(out))


def _reduced_shape(shape: tuple[int, ...], axis: tuple[int, ...] | None, keepdims: bool) -> tuple[int, ...]:
    if axis is None:
        return (1,) * len(shape) if keepdims else ()
    if keepdims:
        return tuple(1 if i in axis else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in axis)


def _expand_back(xp: Any, g: Any, shape: tuple[int, ...], axis: Any, keepdims: bool) -> Any:
    """Broadcast a reduced gradient back over the reduced dimensions."""
    if not keepdims:
        if axis is None:
            g = xp.reshape(g, (1,) * len(shape))
        else:
            g = xp.expand_dims(g, axis)
    return xp.broadcast_to(g, shape)


_INT64 = np.dtype(np.int64)


def _sum_dtype(dt: np.dtype[Any]) -> np.dtype[Any]:
    """PyTorch sums bool and integer tensors (uint8 included; numpy gives uint64) in int64."""
    return _INT64 if dt.kind in "biu" else dt


def _sum_meta(a: Tensor, axis: Any, keepdims: bool) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return _reduced_shape(a._shape, axis, keepdims), _sum_dtype(a._dtype)


def _sum_kernel(a: np.ndarray, axis: Any, keepdims: bool) -> Any:
    if a.dtype.kind in "biu":
        return np.sum(a, axis=axis, keepdims=keepdims, dtype=_INT64)
    return np.sum(a, axis=axis, keepdims=keepdims)


def _sum_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x = args[0]
    return (_expand_back(xp, g, x.shape, kw["axis"], kw["keepdims"]),)


def _mean_meta(a: Tensor, axis: Any, keepdims: bool) -> tuple[tuple[int, ...], np.dtype[Any]]:
    dt = a._dtype if a._dtype.kind in "fc" else np.dtype(np.float64)
    return _reduced_shape(a._shape, axis, keepdims), dt


def _count(shape: tuple[int, ...], axis: Any) -> int:
    if axis is None:
        return int(np.prod(shape))
    return int(np.prod([shape[i] for i in axis]))


def _mean_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x = args[0]
    n = _count(x.shape, kw["axis"])
    return (_expand_back(xp, g, x.shape, kw["axis"], kw["keepdims"]) / n,)


OP_SUM = defop("sum", _sum_kernel, _sum_meta, _sum_rule, saves=())
OP_MEAN = defop(
    "mean", lambda a, axis, keepdims: np.mean(a, axis=axis, keepdims=keepdims), _mean_meta, _mean_rule, saves=()
)


def sum(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Sum over ``dim`` (an int, a tuple, or None for all)."""
    return apply(OP_SUM, (x,), {"axis": _norm_axes("sum", x._shape, dim), "keepdims": bool(keepdim)})


def mean(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Mean over ``dim`` (an int, a tuple, or None for all)."""
    if x._dtype.kind not in "fc":
        raise OpError(f"mean: input dtype {x._dtype} is not floating point; convert with .to(dtype) first")
    return apply(OP_MEAN, (x,), {"axis": _norm_axes("mean", x._shape, dim), "keepdims": bool(keepdim)})


def _extreme_meta(a: Tensor, axis: Any, keepdims: bool) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if a.numel() == 0:
        raise OpError(f"max/min: cannot reduce an empty tensor of shape {a._shape}")
    return _reduced_shape(a._shape, axis, keepdims), a._dtype


def _amax_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # full reduction: ties share the gradient evenly (like torch.amax)
    x = args[0]
    axis, keepdims = kw["axis"], kw["keepdims"]
    ob = _expand_back(xp, out, x.shape, axis, keepdims)
    gb = _expand_back(xp, g, x.shape, axis, keepdims)
    hit = x == ob
    count = xp.sum(xp.where(hit, 1.0, 0.0), axis, True)
    return (xp.where(hit, gb, 0) / count,)


def _dim_rule(argf: Any) -> Any:
    def rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
        # along a dim: the gradient goes to the index the forward picked (like torch.max(x, dim))
        x = args[0]
        axis, keepdims = kw["axis"], kw["keepdims"]
        xv = xp.value(x)
        idx = np.expand_dims(argf(xv, axis=axis[0]), axis[0])
        mask = np.zeros(xv.shape, dtype=bool)
        np.put_along_axis(mask, idx, True, axis=axis[0])
        gb = _expand_back(xp, g, x.shape, axis, keepdims)
        return (xp.where(xp.const(mask, g), gb, 0),)

    return rule


OP_AMAX = defop(
    "amax", lambda a, axis, keepdims: np.max(a, axis=axis, keepdims=keepdims), _extreme_meta, _amax_rule,
    save_out=True,
)
OP_AMIN = defop(
    "amin", lambda a, axis, keepdims: np.min(a, axis=axis, keepdims=keepdims), _extreme_meta, _amax_rule,
    save_out=True,
)
OP_MAX_DIM = defop(
    "max", lambda a, axis, keepdims: np.max(a, axis=axis, keepdims=keepdims), _extreme_meta,
    _dim_rule(np.argmax),
)
OP_MIN_DIM = defop(
    "min", lambda a, axis, keepdims: np.min(a, axis=axis, keepdims=keepdims), _extreme_meta,
    _dim_rule(np.argmin),
)


def _arg_meta(a: Tensor, axis: Any, keepdims: bool) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return _reduced_shape(a._shape, axis, keepdims), np.dtype(np.int64)


def _argk(f: Any) -> Any:
    def k(a: np.ndarray, axis: Any, keepdims: bool) -> np.ndarray:
        if axis is None:
            r = np.asarray(f(a), dtype=np.int64)
            return r.reshape((1,) * a.ndim) if keepdims else r
        return f(a, axis=axis[0], keepdims=keepdims).astype(np.int64, copy=False)

    return k


OP_ARGMAX = defop("argmax", _argk(np.argmax), _arg_meta)
OP_ARGMIN = defop("argmin", _argk(np.argmin), _arg_meta)


class MaxResult(NamedTuple):
    """``(values, indices)`` from `max`/`min` along a dim, like ``torch.return_types.max``."""

    values: Tensor
    indices: Tensor


def _single_dim(op: str, x: Tensor, dim: Any) -> tuple[int, ...]:
    if not isinstance(dim, (int, np.integer)):
        raise OpError(f"{op}: dim must be a single int when returning indices, got {dim!r}")
    axes = _norm_axes(op, x._shape, dim)
    assert axes is not None
    return axes


def _extreme(
    op: str, x: Tensor, dim: Any, keepdim: bool, pairwise: Callable[[Tensor, Tensor], Tensor], whole: Op,
    values: Op, indices: Op,
) -> Any:
    """`max` or `min`: over all of ``x`` (``whole``), over ``dim`` with indices, or with another tensor."""
    if isinstance(dim, Tensor):
        return pairwise(x, dim)
    if dim is None:
        return apply(whole, (x,), {"axis": None, "keepdims": False})
    axes = _single_dim(op, x, dim)
    kw = {"axis": axes, "keepdims": bool(keepdim)}
    return MaxResult(apply(values, (x,), kw), apply(indices, (x,), kw))


def max(x: Tensor, dim: Any = None, keepdim: bool = False) -> Any:
    """``max(x)``: the largest element; ``max(x, dim)``: (values, indices); ``max(x, y)``: maximum."""
    return _extreme("max", x, dim, keepdim, maximum, OP_AMAX, OP_MAX_DIM, OP_ARGMAX)


def min(x: Tensor, dim: Any = None, keepdim: bool = False) -> Any:
    """``min(x)``: the smallest element; ``min(x, dim)``: (values, indices); ``min(x, y)``: minimum."""
    return _extreme("min", x, dim, keepdim, minimum, OP_AMIN, OP_MIN_DIM, OP_ARGMIN)


def amax(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Largest values over ``dim`` (ties share the gradient)."""
    return apply(OP_AMAX, (x,), {"axis": _norm_axes("amax", x._shape, dim), "keepdims": bool(keepdim)})


def argmax(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Index of the largest value (flattened when ``dim`` is None)."""
    axes = None if dim is None else _single_dim("argmax", x, dim)
    return apply(OP_ARGMAX, (x,), {"axis": axes, "keepdims": bool(keepdim)})


def argmin(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Index of the smallest value (flattened when ``dim`` is None)."""
    axes = None if dim is None else _single_dim("argmin", x, dim)
    return apply(OP_ARGMIN, (x,), {"axis": axes, "keepdims": bool(keepdim)})


# ---- vector norms -----------------------------------------------------------------------------------


def _norm2_meta(a: Tensor, axis: Any, keepdims: bool) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return _reduced_shape(a._shape, axis, keepdims), a._dtype


def _norm2_kernel(a: np.ndarray, axis: Any, keepdims: bool) -> np.ndarray:
    return np.asarray(np.sqrt(np.sum(a * a, axis=axis, keepdims=keepdims)), a.dtype)


def _norm2_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # d|x|/dx = x / |x|; where |x| == 0 every x in the slice is 0, and the gradient is 0 (PyTorch's choice)
    x = args[0]
    safe = xp.where(out == 0, 1, out)
    return (_expand_back(xp, g / safe, x.shape, kw["axis"], kw["keepdims"]) * x,)


OP_NORM2 = defop("norm2", _norm2_kernel, _norm2_meta, _norm2_rule, save_out=True)


def norm(x: Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False) -> Tensor:
    """The vector ``p``-norm over ``dim`` (all elements when None), as ``torch.norm``.

    ``p``: 2 or "fro" (the default), 1, any other positive number, or ``inf`` / ``-inf`` (max / min of
    the absolute values). Differentiable; the 2-norm's gradient at 0 is 0, as in PyTorch.
    """
    if x._dtype.kind not in "fc":
        raise OpError(f"norm: input dtype {x._dtype} is not floating point; convert with .to(dtype) first")
    axis = _norm_axes("norm", x._shape, dim)
    if p == "fro" or p == 2:
        return apply(OP_NORM2, (x,), {"axis": axis, "keepdims": bool(keepdim)})

    a = _abs(x)
    if p == float("inf"):
        return amax(a, dim, keepdim)
    if p == float("-inf"):
        return -amax(-a, dim, keepdim)
    if p == 1:
        return sum(a, dim, keepdim)
    if isinstance(p, str) or not p > 0:
        raise OpError(f"norm: p={p!r} is not supported; use a positive number, inf, -inf or 'fro'")
    return sum(a**p, dim, keepdim) ** (1.0 / p)


def _lse_kernel(x: np.ndarray, axis: Any, keepdims: bool) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    s = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return np.asarray(s if keepdims else np.squeeze(s, axis=axis))


def _lse_meta(x: Tensor, axis: Any, keepdims: bool) -> Any:
    # bool and integer inputs compute in the default float dtype, like PyTorch's
    return _reduced_shape(x.shape, axis, keepdims), to_float(x.dtype)


def _lse_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x = args[0]
    axis, keepdims = kw["axis"], kw["keepdims"]
    ob = _expand_back(xp, out, tuple(x.shape), axis, keepdims)
    gb = _expand_back(xp, g, tuple(x.shape), axis, keepdims)
    return (gb * xp.exp(x - ob),)


OP_LOGSUMEXP = defop("logsumexp", _lse_kernel, _lse_meta, _lse_rule, save_out=True, cast_in=True)


def logsumexp(input: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """log(sum(exp(input))) over ``dim`` (int or tuple; None for all), computed stably."""
    axes = _norm_axes("logsumexp", input.shape, dim)
    if axes is None:
        axes = tuple(range(input.ndim))
    return apply(OP_LOGSUMEXP, (input,), {"axis": axes, "keepdims": bool(keepdim)})


def _cumsum_meta(x: Tensor, axis: int, dtype: Any) -> Any:
    if dtype is not None:
        return x.shape, dtype
    dt = x.dtype
    return x.shape, (np.dtype(np.int64) if dt.kind in "biu" else dt)


def _cumsum_kernel(x: np.ndarray, axis: int, dtype: Any) -> np.ndarray:
    if dtype is None and x.dtype.kind in "biu":
        dtype = np.int64
    return np.cumsum(x, axis=axis, dtype=dtype)


def _cumsum_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    rev = (slice(None),) * kw["axis"] + (slice(None, None, -1),)
    return (xp.cumsum(g[rev], kw["axis"])[rev],)


OP_CUMSUM = defop("cumsum", _cumsum_kernel, _cumsum_meta, _cumsum_rule)


def cumsum(input: Tensor, dim: int, *, dtype: Any = None) -> Tensor:
    """Cumulative sum along ``dim`` (integers accumulate in int64, like PyTorch)."""
    if input.ndim == 0:

        return reshape(cumsum(reshape(input, (1,)), 0, dtype=dtype), ())
    return apply(
        OP_CUMSUM,
        (input,),
        {"axis": _dim("cumsum", input, dim), "dtype": None if dtype is None else np.dtype(dtype)},
    )


def np_cumsum(x: np.ndarray, axis: int) -> np.ndarray:
    return np.cumsum(x, axis=axis)


def ag_cumsum(x: Tensor, axis: int) -> Tensor:
    return apply(OP_CUMSUM, (x,), {"axis": axis, "dtype": None})


def _var_meta(x: Tensor, axis: Any, keepdims: bool, correction: float) -> Any:
    _float_check("var", x)
    return _reduced_shape(x.shape, axis, keepdims), x.dtype


def _var_kernel(x: np.ndarray, axis: Any, keepdims: bool, correction: float) -> np.ndarray:
    n = _count(x.shape, axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = np.mean(x, axis=axis, keepdims=True)
        d = x - mu
        s = np.sum(d * d, axis=axis, keepdims=keepdims)
        return np.asarray(s / x.dtype.type(builtins.max(n - correction, 0)), dtype=x.dtype)


def _var_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x = args[0]
    axis, keepdims, c = kw["axis"], kw["keepdims"], kw["correction"]
    shape = tuple(x.shape)
    n = _count(shape, axis)
    d = x - xp.sum(x, axis, True) / n
    gb = _expand_back(xp, g, shape, axis, keepdims)
    denom = builtins.max(n - c, 0)
    return (gb * d * (2.0 / denom if denom else math.inf),)


OP_VAR = defop("var", _var_kernel, _var_meta, _var_rule)


def _var_args(op: str, x: Tensor, dim: Any, unbiased: Any, keepdim: bool, correction: Any) -> dict[str, Any]:
    if isinstance(dim, bool):  # var(x, unbiased)
        dim, unbiased = None, dim
    if unbiased is not None and correction is not None:
        raise OpError(f"{op}: pass either unbiased or correction, not both")
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    return {"axis": _norm_axes(op, x.shape, dim), "keepdims": bool(keepdim), "correction": float(correction)}


def var(
    input: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *, correction: Any = None
) -> Tensor:
    """Variance over ``dim`` with Bessel's ``correction`` (default 1; ``unbiased=False`` means 0)."""
    return apply(OP_VAR, (input,), _var_args("var", input, dim, unbiased, keepdim, correction))


def std(
    input: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *, correction: Any = None
) -> Tensor:
    """Standard deviation: ``sqrt(var(...))`` with the same arguments."""

    return sqrt(apply(OP_VAR, (input,), _var_args("std", input, dim, unbiased, keepdim, correction)))


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

    if not (x.numpy() == 0).any():
        return _expand_back(AG, out, tuple(x.shape), axis, keepdims) / x
    perm, inv, lead = _to_last(tuple(x.shape), axis)
    n = int(np.prod([x.shape[i] for i in perm[len(lead) :]], dtype=np.int64))
    flat = reshape(permute(x, tuple(perm)), (*lead, n))
    square = broadcast_to(expand_dims(flat, -2), (*lead, n, n))
    others = prod(where(np.eye(n, dtype=bool), 1, square), -1)
    return permute(reshape(others, tuple(x.shape[i] for i in perm)), tuple(inv))


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


# the rule namespaces' reductions (see `runtime._xp`)
register_xp("sum", lambda x, axis=None, keepdims=False: np.sum(x, axis=axis, keepdims=keepdims),
            lambda x, axis=None, keepdims=False: sum(x, axis, keepdims))
register_xp("cumsum", np_cumsum, ag_cumsum)
