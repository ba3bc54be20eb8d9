"""Elementwise ops: forward kernels with their backward rules next to them.

Rule signature: ``rule(xp, g, args, out, kw, needs) -> tuple`` (one entry per argument, None where no
gradient is needed). The engine reduces broadcast gradients to the input shapes and checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..devices import lane_empty
from ..kernels import JIT, fusable, sigmoid_backward, tanh_backward
from ..runtime._dispatch import apply, apply1, apply2
from ..runtime._meta import broadcast_shapes, check_int_div
from ..runtime._op import Op, OpError, defop
from ..runtime._promote import result_type, result_type2, to_float
from ..runtime._tensor import Tensor
from ..runtime._xp import NP, register_xp
from ._slices import sliced_flat

_udtype: dict[tuple[Any, Any], np.dtype[Any]] = {}


def _ufunc_dtype(ufunc: Any, dt: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype numpy gives unary ``ufunc`` for input dtype ``dt`` (cached); for ops that keep their
    input's dtype, numpy and PyTorch agree (it raises where PyTorch does, e.g. negating a bool)."""
    key = (ufunc, dt)
    r = _udtype.get(key)
    if r is None:
        r = _udtype[key] = ufunc(np.empty(0, dt)).dtype
    return r


def _dt(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x._dtype
    if isinstance(x, np.ndarray):
        return x.dtype
    return x


def _sh(x: Any) -> tuple[int, ...]:
    if isinstance(x, Tensor):
        return x._shape
    if type(x) in _PY_SCALARS:  # np.shape() costs microseconds per call on the recording path
        return ()
    return np.shape(x)


_PY_SCALARS = frozenset((int, float, bool, complex))


def _unary_meta(ufunc: Any) -> Any:
    """Meta of a unary op that keeps its input's dtype (neg, abs, sign, relu)."""

    def meta(a: Tensor) -> tuple[tuple[int, ...], np.dtype[Any]]:
        return a._shape, _ufunc_dtype(ufunc, a._dtype)

    return meta


def _same_dtype_meta(a: Tensor) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return a._shape, a._dtype


def _float_unary_meta(a: Tensor) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Meta of a unary op that computes in floating point (exp, log, sqrt, ...): bool and integer
    inputs give the default float dtype, float32 (PyTorch; numpy gives float64)."""
    return a._shape, to_float(a._dtype)


def _binary_meta(name: str, kind: str = "") -> Any:
    """Meta of a binary op; ``kind``: "float" (true division: integers give the default float dtype),
    "bool" (comparisons), "pow" (no bool), or "" (the promoted dtype, PyTorch's result_type)."""

    def meta(a: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
        return broadcast_shapes(name, _sh(a), _sh(b)), result_type2(a, b)

    def float_meta(a: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
        return broadcast_shapes(name, _sh(a), _sh(b)), to_float(result_type2(a, b))

    def bool_meta(a: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
        result_type2(a, b)  # rejects operands that are neither tensors nor numbers
        return broadcast_shapes(name, _sh(a), _sh(b)), _BOOL

    def pow_meta(a: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
        dt = result_type2(a, b)
        # PyTorch has no bool pow kernel; only a bool tensor to a Python bool power works (numpy's
        # result, int8, is cast back)
        if dt == _BOOL and not (isinstance(a, Tensor) and type(b) is bool):
            raise OpError("pow: not implemented for bool tensors; convert with .to(dtype) first")
        return broadcast_shapes(name, _sh(a), _sh(b)), dt

    return {"": meta, "float": float_meta, "bool": bool_meta, "pow": pow_meta}[kind]


_BOOL = np.dtype(np.bool_)
# dtype kinds for which numpy's own result dtype is PyTorch's (see `Op.fast_kinds`)
_ALL_KINDS = "biufc"
_FLOAT_KINDS = "fc"


def _zero_like(xp: Any, g: Any) -> Any:
    return g * 0


# ---- binary arithmetic ----------------------------------------------------------------------------


def _add_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g if needs[0] else None, g if needs[1] else None)


def _sub_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g if needs[0] else None, -g if needs[1] else None)


def _mul_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    a, b = args
    return (g * b if needs[0] else None, g * a if needs[1] else None)


def _div_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    a, b = args
    ga = g / b if needs[0] else None
    gb = -g * a / (b * b) if needs[1] else None
    return (ga, gb)


def _pow_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    a, b = args
    ga = gb = None
    # 0 ** -1 and log(0) are expected on the way to the masked values: no warnings for them
    with np.errstate(divide="ignore", invalid="ignore"):
        if needs[0]:
            if not hasattr(b, "shape"):  # a Python number exponent
                ga = g * 0 if b == 0 else g * b * a ** (b - 1)
            else:
                # b * a**(b-1) is 0 * inf where a == 0 and b == 0: PyTorch takes 0 wherever b == 0
                ga = g * xp.where(b == 0, 0, b * a ** (b - 1))
        if needs[1]:
            if not hasattr(a, "shape"):  # a Python number base
                gb = g * (a**b) * float(np.log(a)) if a > 0 else g * 0
            else:
                # d/db a**b = a**b log a; where a == 0 the limit is 0 (PyTorch's convention)
                safe = xp.where(a > 0, a, 1)
                gb = g * xp.where(a > 0, a**b * xp.log(safe), 0)
    return (ga, gb)


def _remainder_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # a % b = a - b * floor(a / b): d/da = 1, d/db = -floor(a / b) = (a % b - a) / b
    a, b = args
    return (g if needs[0] else None, g * ((a % b - a) / b) if needs[1] else None)


def _true_divide(a: Any, b: Any) -> Any:
    return np.true_divide(a, b)


OP_ADD = defop(
    "add", np.add, _binary_meta("add"), _add_rule, cast_in=True, fast_kinds=_ALL_KINDS, saves=()
)
OP_SUB = defop(
    "sub", np.subtract, _binary_meta("sub"), _sub_rule, cast_in=True, fast_kinds=_ALL_KINDS, saves=()
)
OP_MUL = defop("mul", np.multiply, _binary_meta("mul"), _mul_rule, cast_in=True, fast_kinds=_ALL_KINDS)
OP_DIV = defop(
    "div", np.true_divide, _binary_meta("div", "float"), _div_rule, cast_in=True, fast_kinds=_FLOAT_KINDS,
    doc="Elementwise true division with broadcasting.",
)
OP_POW = defop(
    "pow", np.power, _binary_meta("pow", "pow"), _pow_rule, cast_in=True, fast_kinds="iufc",
    doc="Elementwise ``a ** b``.",
)
OP_REMAINDER = defop(
    "remainder", np.remainder, _binary_meta("remainder"), _remainder_rule, cast_in=True, fast_kinds="iuf",
    doc="Elementwise ``a % b`` with the sign of ``b`` (Python's and PyTorch's modulo).",
)
# piecewise constant: no gradient flows (PyTorch has no derivative for it either)
OP_FLOOR_DIVIDE = defop(
    "floor_divide", np.floor_divide, _binary_meta("floor_divide"), None, cast_in=True, fast_kinds="iuf",
    doc="Elementwise ``a // b``, rounded toward minus infinity (not differentiable).",
)


def _maxmin_rule(greater: bool) -> Any:
    def rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
        a, b = args
        wins = (a > b) if greater else (a < b)
        tie = a == b
        # a tie splits the gradient evenly, as PyTorch does
        ga = xp.where(wins, g, xp.where(tie, g * 0.5, 0)) if needs[0] else None
        gb = xp.where(wins, 0, xp.where(tie, g * 0.5, g)) if needs[1] else None
        return (ga, gb)

    return rule


OP_MAXIMUM = defop(
    "maximum", np.maximum, _binary_meta("maximum"), _maxmin_rule(True), cast_in=True, fast_kinds=_ALL_KINDS,
    doc="Elementwise maximum (ties split the gradient).",
)
OP_MINIMUM = defop(
    "minimum", np.minimum, _binary_meta("minimum"), _maxmin_rule(False), cast_in=True, fast_kinds=_ALL_KINDS,
    doc="Elementwise minimum (ties split the gradient).",
)


def _check_operand(name: str, x: Any) -> Any:
    if isinstance(x, Tensor) or isinstance(x, (int, float, bool, np.number)):
        return x
    if isinstance(x, (np.ndarray, list, tuple)):
        return np.asarray(x)
    raise TypeError(f"{name}: unsupported operand type {type(x).__name__}; use a Tensor or a number")


def add(a: Any, b: Any) -> Tensor:
    """Elementwise ``a + b`` with broadcasting."""
    return apply2(OP_ADD, a, b)


def sub(a: Any, b: Any) -> Tensor:
    """Elementwise ``a - b`` with broadcasting."""
    return apply2(OP_SUB, a, b)


def mul(a: Any, b: Any) -> Tensor:
    """Elementwise ``a * b`` with broadcasting."""
    out = apply2(OP_MUL, a, b)
    if out._data is not None:  # computed inline: nothing to note (see `_tensor_mul`)
        return out
    if type(a) is Tensor:
        return _scaled(out, a, b)
    return _scaled(out, b, a)


def _scaled(out: Tensor, t: Any, k: Any) -> Tensor:
    """Note on a queued, graph-free ``tensor * number`` result what it is, so that an in-place ``p -= out``
    can compute ``p - number * tensor`` in one pass instead (`_inplace.scaled_update`)."""
    if out._data is None and not out._rg and type(k) in _NUMBERS and type(t) is Tensor and t._dtype is out._dtype:
        out.__dict__["_scaled"] = (t, k)
    return out


_NUMBERS = (float, int)


def _tensor_mul(s: Tensor, o: Any) -> Tensor:
    out = apply2(OP_MUL, s, o)
    # `_scaled`'s first test here: an inline (computed) result needs no note, and no call per op
    return out if out._data is not None else _scaled(out, s, o)


def _tensor_rmul(s: Tensor, o: Any) -> Tensor:
    out = apply2(OP_MUL, o, s)
    return out if out._data is not None else _scaled(out, s, o)


def _unary(op: Op) -> Callable[[Tensor], Tensor]:
    """The public function of a one-input op (named and documented by its `defop`): ``f(x)`` records it."""

    def f(x: Tensor) -> Tensor:
        return apply1(op, x)

    f.__name__ = f.__qualname__ = op.name
    f.__doc__ = op.doc
    return f


def _binary(op: Op) -> Callable[[Any, Any], Tensor]:
    """The public function of a two-input op with broadcasting: ``f(a, b)`` records it on both."""

    def f(a: Any, b: Any) -> Tensor:
        return apply2(op, a, b)

    f.__name__ = f.__qualname__ = op.name
    f.__doc__ = op.doc
    return f


div, pow, remainder, floor_divide, maximum, minimum = map(
    _binary, (OP_DIV, OP_POW, OP_REMAINDER, OP_FLOOR_DIVIDE, OP_MAXIMUM, OP_MINIMUM)
)


# ---- unary ----------------------------------------------------------------------------------------


def _neg_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (-g,)


def _exp_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g * out,)


def _log_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g / args[0],)


def _tanh_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # one compiled pass instead of three ufuncs, bit-identical (with the kernels off, the expression below
    # is the twin itself: no check per node)
    if JIT and fusable(g, out):
        return (tanh_backward(g, out),)
    return (g * (1 - out * out),)


def _sigmoid_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    if JIT and fusable(g, out):
        return (sigmoid_backward(g, out),)
    return (g * out * (1 - out),)


def _relu_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # multiplying by the mask is ~8x faster than np.where on float32 (measured: 30 vs 250 us on 128x512)
    a = args[0]
    if xp is NP and g.dtype == a.dtype and g.flags.c_contiguous and g.shape == a.shape:
        out = lane_empty(g.shape, g.dtype)
        if not a.flags.c_contiguous:
            return (np.multiply(g, a > 0, out=out),)
        gf, af, of = g.reshape(-1), a.reshape(-1), out.reshape(-1)
        sliced_flat(lambda lo, hi: np.multiply(gf[lo:hi], af[lo:hi] > 0, out=of[lo:hi]), g.size)
        return (out,)
    return (g * (a > 0),)


def _sqrt_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g / (2 * out),)


def _abs_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g * xp.sign(args[0]),)


def _sigmoid_kernel(a: np.ndarray) -> np.ndarray:
    # split by sign so exp never overflows
    out = np.empty_like(a, dtype=np.result_type(a.dtype, np.float16))
    pos = a >= 0
    np.divide(1, 1 + np.exp(-a, where=pos, out=np.zeros_like(out)), out=out, where=pos)
    e = np.exp(a, where=~pos, out=np.zeros_like(out))
    np.divide(e, 1 + e, out=out, where=~pos)
    return out


def _relu_kernel(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f" and a.flags.c_contiguous:
        out = lane_empty(a.shape, a.dtype)
        af, of = a.reshape(-1), out.reshape(-1)
        sliced_flat(lambda lo, hi: np.maximum(af[lo:hi], 0, out=of[lo:hi]), a.size)
        return out
    if a.dtype.kind == "b":  # the inline fast path skips the meta; numpy would give int64
        raise _relu_bool()
    return np.maximum(a, 0)


def _sign_kernel(a: np.ndarray) -> np.ndarray:
    return a.copy() if a.dtype == _BOOL else np.sign(a)  # numpy has no bool sign; PyTorch's is the identity


def _relu_bool() -> OpError:
    return OpError("relu: not implemented for bool tensors (like PyTorch); convert with .to(dtype) first")


def _relu_meta(a: Tensor) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if a._dtype.kind == "b":
        raise _relu_bool()
    return a._shape, a._dtype


# exp, log, tanh, sigmoid, sqrt compute bool and integer inputs in the default float dtype (cast first);
# neg, abs, sign, relu keep their input's dtype (numpy agrees for every dtype kind)
_F = _FLOAT_KINDS
OP_NEG = defop(
    "neg", np.negative, _unary_meta(np.negative), _neg_rule, fast_kinds=_ALL_KINDS, saves=(),
    doc="Elementwise negation.",
)
# exp, tanh, sigmoid and sqrt rules read only the output (saves=(): no input version to record or check,
# as PyTorch saves only their result)
OP_EXP = defop(
    "exp", np.exp, _float_unary_meta, _exp_rule, save_out=True, cast_in=True, fast_kinds=_F, saves=(),
    doc="Elementwise exponential.",
)
OP_LOG = defop(
    "log", np.log, _float_unary_meta, _log_rule, cast_in=True, fast_kinds=_F,
    doc="Elementwise natural logarithm.",
)
OP_TANH = defop(
    "tanh", np.tanh, _float_unary_meta, _tanh_rule, save_out=True, cast_in=True, fast_kinds=_F, saves=(),
    doc="Elementwise hyperbolic tangent.",
)
OP_SIGMOID = defop(
    "sigmoid", _sigmoid_kernel, _float_unary_meta, _sigmoid_rule, save_out=True, cast_in=True, fast_kinds=_F,
    saves=(),
    doc="Elementwise logistic sigmoid (overflow-safe).",
)
OP_RELU = defop("relu", _relu_kernel, _relu_meta, _relu_rule, fast_kinds=_ALL_KINDS, doc="Elementwise max(x, 0).")
OP_SQRT = defop(
    "sqrt", np.sqrt, _float_unary_meta, _sqrt_rule, save_out=True, cast_in=True, fast_kinds=_F, saves=(),
    doc="Elementwise square root.",
)
OP_ABS = defop(
    "abs", np.abs, _unary_meta(np.abs), _abs_rule, fast_kinds=_ALL_KINDS,
    doc="Elementwise absolute value (gradient sign(x), 0 at 0).",
)
OP_SIGN = defop(
    "sign", _sign_kernel, _same_dtype_meta, fast_kinds=_ALL_KINDS,
    doc="Elementwise sign (not differentiable: no gradient flows).",
)


neg, exp, log, tanh, sigmoid, relu, sqrt, abs, sign = map(
    _unary, (OP_NEG, OP_EXP, OP_LOG, OP_TANH, OP_SIGMOID, OP_RELU, OP_SQRT, OP_ABS, OP_SIGN)
)


# ---- where, copies, casts -------------------------------------------------------------------------


def _where_meta(c: Any, a: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if isinstance(c, (Tensor, np.ndarray)) and _dt(c) != np.bool_:
        raise OpError(f"where: condition must have dtype bool, got {_dt(c)}; compare first, e.g. x > 0")
    shape = broadcast_shapes("where", broadcast_shapes("where", _sh(c), _sh(a)), _sh(b))
    # PyTorch's result_type of x and y (where(mask, 1.0, 0.0) is float32); np.where picks and the
    # dispatcher casts the pick, which equals picking from cast operands
    return shape, result_type(a, b)


def _where_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    c = args[0]
    return (
        None,
        xp.where(c, g, 0) if needs[1] else None,
        xp.where(c, 0, g) if needs[2] else None,
    )


OP_WHERE = defop("where", np.where, _where_meta, _where_rule)


def where(condition: Any, x: Any, y: Any) -> Tensor:
    """Elementwise ``x`` where ``condition`` else ``y`` (gradients flow to x and y only)."""
    for v in (condition, x, y):
        if isinstance(v, Tensor):
            break
    else:
        raise TypeError("where: expected at least one Tensor argument")
    return apply(OP_WHERE, (condition, x, y))


# ---- comparisons (not differentiable) -------------------------------------------------------------


def _cmp(name: str, ufunc: Any) -> Any:
    doc = f"Elementwise ``a {name} b`` as a bool tensor (not differentiable)."
    return _binary(defop(name, ufunc, _binary_meta(name, "bool"), fast_kinds=_ALL_KINDS, doc=doc))


lt = _cmp("lt", np.less)
le = _cmp("le", np.less_equal)
gt = _cmp("gt", np.greater)
ge = _cmp("ge", np.greater_equal)
eq = _cmp("eq", np.equal)
ne = _cmp("ne", np.not_equal)


# ---- operators on Tensor --------------------------------------------------------------------------


# the rule namespaces' elementwise functions (see `runtime._xp`)
for _name, _np_fn, _ag_fn in (
    ("exp", np.exp, exp), ("log", np.log, log), ("tanh", np.tanh, tanh), ("sqrt", np.sqrt, sqrt),
    ("sign", np.sign, sign), ("abs", np.abs, abs), ("where", np.where, where),
):
    register_xp(_name, _np_fn, _ag_fn)


greater, greater_equal, less, less_equal, not_equal = gt, ge, lt, le, ne



def addcmul(input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Tensor:
    """``input + value * tensor1 * tensor2`` (broadcasting; differentiable in all three)."""
    return input + value * (tensor1 * tensor2)  # type: ignore[no-any-return]



def addcdiv(input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Tensor:
    """``input + value * tensor1 / tensor2`` (broadcasting; differentiable in all three)."""
    check_int_div("addcdiv", tensor1, tensor2)
    return input + value * (tensor1 / tensor2)  # type: ignore[no-any-return]
