"""Reductions: sum, mean, max/min (full, or along a dim with indices), argmax/argmin."""

from __future__ import annotations

import builtins
from typing import Any, NamedTuple

import numpy as np

from ._dispatch import OpError, apply, defop
from ._tensor import Tensor


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


def max(x: Tensor, dim: Any = None, keepdim: bool = False) -> Any:
    """``max(x)``: the largest element; ``max(x, dim)``: (values, indices); ``max(x, y)``: maximum."""
    if isinstance(dim, Tensor):
        from ._ops_elementwise import maximum

        return maximum(x, dim)
    if dim is None:
        return apply(OP_AMAX, (x,), {"axis": None, "keepdims": False})
    axes = _single_dim("max", x, dim)
    kw = {"axis": axes, "keepdims": bool(keepdim)}
    return MaxResult(apply(OP_MAX_DIM, (x,), kw), apply(OP_ARGMAX, (x,), kw))


def min(x: Tensor, dim: Any = None, keepdim: bool = False) -> Any:
    """``min(x)``: the smallest element; ``min(x, dim)``: (values, indices); ``min(x, y)``: minimum."""
    if isinstance(dim, Tensor):
        from ._ops_elementwise import minimum

        return minimum(x, dim)
    if dim is None:
        return apply(OP_AMIN, (x,), {"axis": None, "keepdims": False})
    axes = _single_dim("min", x, dim)
    kw = {"axis": axes, "keepdims": bool(keepdim)}
    return MaxResult(apply(OP_MIN_DIM, (x,), kw), apply(OP_ARGMIN, (x,), kw))


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
    from ._ops_elementwise import abs as _abs

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


Tensor.sum = sum  # type: ignore[attr-defined]
Tensor.mean = mean  # type: ignore[attr-defined]
Tensor.norm = norm  # type: ignore[attr-defined]
Tensor.max = max  # type: ignore[attr-defined]
Tensor.min = min  # type: ignore[attr-defined]
Tensor.amax = amax  # type: ignore[attr-defined]
Tensor.argmax = argmax  # type: ignore[attr-defined]
Tensor.argmin = argmin  # type: ignore[attr-defined]
