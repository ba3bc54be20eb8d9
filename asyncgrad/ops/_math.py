"""More elementwise math with PyTorch's names and semantics, each with its backward rule.

sin, cos, floor, ceil, round, log1p, expm1, erf, rsqrt, reciprocal, square, lerp, nan_to_num; the
predicates isnan, isinf, isfinite (bool results, no gradient); allclose and equal (Python bools).

floor/ceil/round have a zero gradient (like PyTorch: their outputs require grad, the gradient is 0), and
keep integer inputs as they are. Rules are written against ``xp`` (see `_xp`), so all have second
derivatives; ``sin``/``cos`` are added to both rule namespaces here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..kernels import erf32
from ..runtime._dispatch import apply
from ..runtime._meta import broadcast_shapes
from ..runtime._op import OpError, defop
from ..runtime._promote import result_type
from ..runtime._tensor import Tensor
from ..runtime._xp import register_xp
from ._elementwise import _dt, _float_unary_meta, _sh, _ufunc_dtype, _unary, _unary_meta

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


# ---- trigonometric -----------------------------------------------------------------------------------


def _sin_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g * xp.cos(args[0]),)


def _cos_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (-g * xp.sin(args[0]),)


OP_SIN = defop("sin", np.sin, _float_unary_meta, _sin_rule, cast_in=True, fast_kinds="fc", doc="Elementwise sine.")
OP_COS = defop("cos", np.cos, _float_unary_meta, _cos_rule, cast_in=True, fast_kinds="fc", doc="Elementwise cosine.")


sin, cos = map(_unary, (OP_SIN, OP_COS))


# ---- rounding (zero gradient; integers pass through) -------------------------------------------------


def _round_meta(a: Tensor, **kw: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    dt = a.dtype
    if dt.kind == "b":
        raise OpError(f"rounding: input dtype {dt} is not supported; convert to an integer or float dtype first")
    return tuple(a.shape), dt


def _rounding(ufunc: Any) -> Any:
    def kernel(a: np.ndarray) -> np.ndarray:
        return a.copy() if a.dtype.kind in "iu" else ufunc(a)

    return kernel


def _round_kernel(a: np.ndarray, decimals: int) -> np.ndarray:
    if a.dtype.kind in "iu":
        return a.copy() if decimals >= 0 else np.round(a, decimals)
    return np.round(a, decimals)  # half to even, as PyTorch


def _zero_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g * 0,)


OP_FLOOR = defop("floor", _rounding(np.floor), _round_meta, _zero_rule)
OP_CEIL = defop("ceil", _rounding(np.ceil), _round_meta, _zero_rule)
OP_ROUND = defop("round", _round_kernel, _round_meta, _zero_rule)


def floor(x: Tensor) -> Tensor:
    """Elementwise floor (gradient 0, as PyTorch; integer tensors are returned unchanged)."""
    return apply(OP_FLOOR, (x,))


def ceil(x: Tensor) -> Tensor:
    """Elementwise ceiling (gradient 0, as PyTorch; integer tensors are returned unchanged)."""
    return apply(OP_CEIL, (x,))


def round(x: Tensor, *, decimals: int = 0) -> Tensor:
    """Round half to even, to ``decimals`` decimal places (gradient 0), like ``torch.round``."""
    return apply(OP_ROUND, (x,), {"decimals": int(decimals)})


# ---- exp/log variants, erf, powers ------------------------------------------------------------------


def _log1p_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g / (args[0] + 1),)


def _expm1_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g * (out + 1),)


def _erf_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x = args[0]
    return (g * (_TWO_OVER_SQRT_PI * xp.exp(-(x * x))),)


def _rsqrt_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # d/dx x^(-1/2) = -1/2 x^(-3/2) = -1/2 out^3
    return (g * (-0.5 * out * out * out),)


def _reciprocal_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (-g * out * out,)


def _square_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g * (2 * args[0]),)


_float_meta = _float_unary_meta  # bool and integers give the default float dtype, as in PyTorch


def _erf_kernel(a: np.ndarray) -> np.ndarray:
    return np.asarray(_erf(a), dtype=_ufunc_dtype(np.sqrt, a.dtype))


def _rsqrt_kernel(a: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):  # rsqrt(0) = inf, as PyTorch
        return np.reciprocal(np.sqrt(a))


def _reciprocal_kernel(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "biu":  # np.reciprocal on integers truncates (1/2 -> 0); PyTorch gives floats
        a = a.astype(_ufunc_dtype(np.sqrt, a.dtype))
    with np.errstate(divide="ignore"):
        return np.reciprocal(a)


OP_LOG1P = defop(
    "log1p", np.log1p, _float_meta, _log1p_rule, cast_in=True, fast_kinds="fc",
    doc="Elementwise ``log(1 + x)``, accurate for small ``x``.",
)
OP_EXPM1 = defop(
    "expm1", np.expm1, _float_meta, _expm1_rule, save_out=True, cast_in=True, fast_kinds="fc",
    doc="Elementwise ``exp(x) - 1``, accurate for small ``x``.",
)
OP_ERF = defop("erf", _erf_kernel, _float_meta, _erf_rule, cast_in=True, doc="Elementwise error function.")
OP_RSQRT = defop(
    "rsqrt", _rsqrt_kernel, _float_meta, _rsqrt_rule, save_out=True, cast_in=True,
    doc="Elementwise ``1 / sqrt(x)``.",
)
OP_RECIPROCAL = defop(
    "reciprocal", _reciprocal_kernel, _float_meta, _reciprocal_rule, save_out=True, cast_in=True,
    doc="Elementwise ``1 / x`` (integers give floats, as PyTorch).",
)
OP_SQUARE = defop(
    "square", np.square, _unary_meta(np.square), _square_rule,
    doc="Elementwise ``x * x`` (integers stay integers).",
)


log1p, expm1, erf, rsqrt, reciprocal, square = map(
    _unary, (OP_LOG1P, OP_EXPM1, OP_ERF, OP_RSQRT, OP_RECIPROCAL, OP_SQUARE)
)


# ---- lerp ----------------------------------------------------------------------------------------------


def _lerp_meta(a: Any, b: Any, w: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    da, db = _dt(a), _dt(b)
    if da != db:
        raise OpError(
            f"lerp: start and end must have the same dtype, got {da} and {db}; convert one with .to(dtype)"
        )
    if da.kind not in "fc":
        raise OpError(f"lerp: expected floating point tensors, got dtype {da}")
    shape = broadcast_shapes("lerp", broadcast_shapes("lerp", _sh(a), _sh(b)), _sh(w))
    return shape, da  # a number weight keeps the tensors' dtype, as in PyTorch


def _lerp_kernel(a: np.ndarray, b: np.ndarray, w: Any) -> np.ndarray:
    # PyTorch's formula: exact at both ends (w == 0 gives a, w == 1 gives b)
    d = b - a
    return np.asarray(np.where(np.abs(w) < 0.5, a + w * d, b - d * (1 - w)))


def _lerp_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    a, b, w = args
    return (
        g * (1 - w) if needs[0] else None,
        g * w if needs[1] else None,
        g * (b - a) if needs[2] else None,
    )


OP_LERP = defop("lerp", _lerp_kernel, _lerp_meta, _lerp_rule)


def lerp(input: Tensor, end: Tensor, weight: Any) -> Tensor:
    """``input + weight * (end - input)``, with broadcasting; ``weight`` is a number or a tensor."""
    if not isinstance(end, Tensor):
        raise TypeError(f"lerp: end must be a Tensor, got {type(end).__name__}")
    if not isinstance(weight, (Tensor, int, float)):
        raise TypeError(f"lerp: weight must be a Tensor or a number, got {type(weight).__name__}")
    return apply(OP_LERP, (input, end, weight))


# ---- nan_to_num ----------------------------------------------------------------------------------------


def _n2n_meta(a: Tensor, nan: float, posinf: Any, neginf: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return tuple(a.shape), a.dtype


def _n2n_kernel(a: np.ndarray, nan: float, posinf: Any, neginf: Any) -> np.ndarray:
    return np.nan_to_num(a, copy=True, nan=nan, posinf=posinf, neginf=neginf)


def _n2n_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # PyTorch: grad * isfinite(x); replaced values are constants
    return (xp.where(xp.const(np.isfinite(xp.value(args[0])), g), g, 0),)


OP_NAN_TO_NUM = defop("nan_to_num", _n2n_kernel, _n2n_meta, _n2n_rule)


def nan_to_num(input: Tensor, nan: float = 0.0, posinf: Any = None, neginf: Any = None) -> Tensor:
    """Replace NaN with ``nan``, +inf/-inf with ``posinf``/``neginf`` (default: the dtype's extremes)."""
    return apply(OP_NAN_TO_NUM, (input,), {"nan": float(nan), "posinf": posinf, "neginf": neginf})


# ---- predicates (bool results, not differentiable) -----------------------------------------------------


def _pred_meta(a: Tensor) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return tuple(a.shape), np.dtype(np.bool_)


OP_ISNAN = defop("isnan", np.isnan, _pred_meta, doc="Elementwise: is NaN (a bool tensor).")
OP_ISINF = defop("isinf", np.isinf, _pred_meta, doc="Elementwise: is +inf or -inf (a bool tensor).")
OP_ISFINITE = defop(
    "isfinite", np.isfinite, _pred_meta,
    doc="Elementwise: is neither NaN nor infinite (a bool tensor).",
)


isnan, isinf, isfinite = map(_unary, (OP_ISNAN, OP_ISINF, OP_ISFINITE))


# ---- whole-tensor comparisons (Python bools; wait for the values) -----------------------------------


def _array(op: str, x: Any) -> np.ndarray:
    if isinstance(x, Tensor):
        return x._value()
    raise TypeError(f"{op}: expected Tensors, got {type(x).__name__}")


def allclose(input: Tensor, other: Tensor, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> bool:
    """Whether ``|input - other| <= atol + rtol * |other|`` everywhere (with broadcasting), as a bool."""
    a, b = _array("allclose", input), _array("allclose", other)
    if a.dtype != b.dtype:
        raise OpError(
            f"allclose: tensors must have the same dtype, got {a.dtype} and {b.dtype}; "
            "convert one with .to(dtype) first"
        )
    broadcast_shapes("allclose", a.shape, b.shape)
    return bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan))


def equal(input: Tensor, other: Tensor) -> bool:
    """True if both tensors have the same shape and the same elements (NaN is never equal), as a bool."""
    a, b = _array("equal", input), _array("equal", other)
    return bool(np.array_equal(a, b))


# ---- rule namespaces and Tensor methods ------------------------------------------------------------


def _clamp_meta(x: Tensor, lo: Any, hi: Any) -> Any:
    shape = x.shape
    for v in (lo, hi):
        if v is not None:
            shape = broadcast_shapes(
                "clamp", shape, tuple(np.shape(v) if not isinstance(v, Tensor) else v.shape)
            )
    # PyTorch's result_type of input, min and max (an int tensor clamped to 0.5 is float32); the kernel
    # picks with numpy and the dispatcher casts the pick, which equals picking from cast operands
    return shape, result_type(x, lo, hi)


def _clamp_kernel(x: np.ndarray, lo: Any, hi: Any) -> np.ndarray:
    out = x
    if lo is not None:
        out = np.maximum(out, lo)
    if hi is not None:
        out = np.minimum(out, hi)
    return np.asarray(out)


def _clamp_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # PyTorch's clamp_backward_min_max: x gets g inside [min, max]; min gets g where x < min (and
    # min < max); max gets g where x > max (or max < min, where the result is max everywhere).
    # The masks are constants (numpy), also under create_graph.
    x, lo, hi = (None if a is None else xp.value(a) for a in args)
    inside = True
    if lo is not None:
        inside = x >= lo
    if hi is not None:
        inside = inside & (x <= hi)
    gx = xp.where(inside, g, 0) if needs[0] else None
    glo = ghi = None
    if needs[1]:
        assert lo is not None  # needs[1] means a tensor bound was given
        m = x < lo
        glo = xp.where(m & (lo < hi) if hi is not None else m, g, 0)
    if needs[2]:
        assert hi is not None
        m = x > hi
        ghi = xp.where(m | (hi < lo) if lo is not None else m, g, 0)
    return (gx, glo, ghi)


OP_CLAMP = defop("clamp", _clamp_kernel, _clamp_meta, _clamp_rule)


def clamp(input: Tensor, min: Any = None, max: Any = None) -> Tensor:
    """Limit ``input`` to [min, max] (numbers or tensors; either may be None, not both)."""
    if min is None and max is None:
        raise OpError("clamp: at least one of 'min' or 'max' must not be None")
    return apply(OP_CLAMP, (input, min, max))


clip = clamp  # PyTorch's alias


def clamp_min(input: Tensor, min: Any) -> Tensor:
    return clamp(input, min=min)


def clamp_max(input: Tensor, max: Any) -> Tensor:
    return clamp(input, max=max)


_erf_impl: Any = None



def _erf(x: np.ndarray) -> np.ndarray:
    """Vectorised erf: float32 by `kernels.erf32`; other dtypes by scipy's (exact to the last ulp) when installed,
    imported on first use only (importing scipy costs ~0.5 s and ~20 MB, too much for `import asyncgrad`)."""
    if isinstance(x, np.ndarray) and x.dtype == np.float32:
        return erf32(x)
    global _erf_impl
    if _erf_impl is None:
        try:
            from scipy.special import erf as scipy_erf

            _erf_impl = scipy_erf
        except ImportError:  # pragma: no cover - exercised only without scipy
            scalar = np.frompyfunc(math.erf, 1, 1)
            _erf_impl = lambda v: np.asarray(scalar(v), dtype=np.result_type(v, np.float32))  # noqa: E731
    return _erf_impl(x)  # type: ignore[no-any-return]


register_xp("sin", np.sin, sin)
register_xp("cos", np.cos, cos)
