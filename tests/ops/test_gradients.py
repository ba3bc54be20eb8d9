"""Every op's gradient against central finite differences (float64), second derivatives of the
elementwise ops and matmul, and meta (shape/dtype predicted before the kernel) vs the real result on both
the inline and the queued (worker lane) path.

One table drives everything: each `Case` names the op it covers, a function of tensors, and its inputs.
Second derivatives are checked for every case (the issue asks for the elementwise ops and matmul).
Inputs keep away from kinks and ties (relu/abs near 0, max/maximum ties) so differences are smooth.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.devices import INLINE_MAX_ELEMENTS
from tests._util import channels_last, set_inline_limit

R = np.random.default_rng(20240601)
TIMEOUT = 20  # seconds: a hang fails the test instead of the run


def rn(*s: int) -> np.ndarray:
    return R.standard_normal(s)


def pos(*s: int) -> np.ndarray:
    """Positive, away from 0 (log, sqrt, pow bases)."""
    return R.uniform(0.5, 2.0, s)


def away(*s: int) -> np.ndarray:
    """Either sign, |x| >= 0.2 (relu, abs, divisors)."""
    return R.choice([-1.0, 1.0], s) * R.uniform(0.2, 1.5, s)


def grid(*s: int, off: float = 0.0) -> np.ndarray:
    """Multiples of 0.1 plus ``off``: two grids with offsets 0 and 0.05 never tie (maximum/minimum)."""
    return R.integers(-20, 20, s) * 0.1 + off


def distinct(*s: int) -> np.ndarray:
    """Pairwise distinct values at least 0.05 apart (max/min reductions: no ties)."""
    n = int(np.prod(s))
    return R.permutation(np.arange(n) * 0.1 - 0.05 * n).reshape(s)


@dataclass
class Case:
    op: str
    name: str
    fn: Callable[..., Any]
    inputs: list[np.ndarray]
    gg: bool = True  # also check second derivatives (every op in the table has them)

    def __repr__(self) -> str:
        return self.name


CASES: list[Case] = []


def case(op: str, label: str, fn: Callable[..., Any], *inputs: np.ndarray, gg: bool = True) -> None:
    # 0-d draws come back as numpy scalars: as 0-d arrays they are differentiated inputs of gradcheck
    CASES.append(Case(op, f"{op}-{label}", fn, [np.asarray(a) for a in inputs], gg))


def _s(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


# ---- elementwise binary (several shapes, broadcasting) -------------------------------------------

BIN_SHAPES = [((3, 4), (3, 4)), ((3, 1, 4), (5, 4)), ((), (2, 3)), ((2, 1), (1, 3)), ((4,), (3, 4))]
for sa, sb in BIN_SHAPES:
    lbl = f"{_s(sa)}-{_s(sb)}"
    case("add", lbl, lambda a, b: a + b, rn(*sa), rn(*sb))
    case("sub", lbl, lambda a, b: a - b, rn(*sa), rn(*sb))
    case("mul", lbl, lambda a, b: a * b, rn(*sa), rn(*sb))
    case("div", lbl, lambda a, b: a / b, rn(*sa), away(*sb))
    case("pow", lbl, lambda a, b: a**b, pos(*sa), rn(*sb))
    case("maximum", lbl, ag.maximum, grid(*sa), grid(*sb, off=0.05))
    case("minimum", lbl, ag.minimum, grid(*sa), grid(*sb, off=0.05))
case("add", "fn", ag.add, rn(2, 3), rn(3))
case("sub", "fn", ag.sub, rn(2, 3), rn(3))
case("mul", "fn", ag.mul, rn(2, 3), rn(3))
case("div", "fn", ag.div, rn(2, 3), away(3))
case("pow", "fn", ag.pow, pos(2, 3), rn(3))
case("maximum", "method", lambda a, b: a.maximum(b), grid(3), grid(2, 3, off=0.05))
case("maximum", "via-max", lambda a, b: ag.max(a, b), grid(3), grid(2, 3, off=0.05))
case("add", "self", lambda a: a + a, rn(3, 2))
case("mul", "self", lambda a: a * a, rn(3, 2))
case("sub", "self-mul", lambda a: a * a - a, rn(3, 2))

# ---- scalar operands ------------------------------------------------------------------------------

case("mul", "scalar-right", lambda x: x * 2.0, rn(3, 4))
case("mul", "scalar-left", lambda x: 2.0 * x, rn(3, 4))
case("add", "scalar", lambda x: x + 1.5, rn(3, 4))
case("add", "scalar-left", lambda x: 1.5 + x, rn(4))
case("sub", "scalar-right", lambda x: x - 1.5, rn(4))
case("sub", "scalar-left", lambda x: 1.5 - x, rn(3, 4))
case("div", "scalar-right", lambda x: x / 2.0, rn(3, 4))
case("div", "scalar-left", lambda x: 2.0 / x, away(3, 4))
case("pow", "int-exponent", lambda x: x**3, rn(3, 4))
case("pow", "square", lambda x: x**2, rn(5))
case("pow", "float-exponent", lambda x: x**2.5, pos(3, 4))
case("pow", "negative-exponent", lambda x: x**-1.5, pos(4))
case("pow", "scalar-base", lambda x: 2.0**x, rn(3, 4))
case("pow", "scalar-base-small", lambda x: 0.5**x, rn(2, 3))
case("remainder", "tensor-tensor", lambda a, b: a % b, rn(3, 4), away(4))
case("remainder", "scalar-divisor", lambda a: a % 0.7, grid(3, 4, off=0.03))
case("remainder", "scalar-dividend", lambda b: 2.5 % b, away(5))

# ---- elementwise unary ------------------------------------------------------------------------------

for shp in [(), (5,), (2, 3, 4)]:
    lbl = _s(shp)
    case("neg", lbl, lambda x: -x, rn(*shp))
    case("exp", lbl, ag.exp, rn(*shp))
    case("log", lbl, ag.log, pos(*shp))
    case("tanh", lbl, ag.tanh, rn(*shp))
    case("sigmoid", lbl, ag.sigmoid, rn(*shp))
    case("relu", lbl, ag.relu, away(*shp))
    case("sqrt", lbl, ag.sqrt, pos(*shp))
    case("abs", lbl, ag.abs, away(*shp))
case("neg", "fn", ag.neg, rn(3))
case("exp", "method", lambda x: x.exp(), rn(3))
case("log", "method", lambda x: x.log(), pos(3))
case("tanh", "method", lambda x: x.tanh(), rn(3))
case("sigmoid", "large", ag.sigmoid, np.array([-30.0, -3.0, 0.5, 3.0, 30.0]))
case("relu", "method", lambda x: x.relu(), away(3))
case("sqrt", "method", lambda x: x.sqrt(), pos(3))
case("abs", "operator", lambda x: abs(x), away(3))

# ---- where -------------------------------------------------------------------------------------------

C34 = R.random((3, 4)) > 0.5
C31 = np.array([[True], [False], [True]])
case("where", "same-shape", lambda x, y: ag.where(ag.tensor(C34), x, y), rn(3, 4), rn(3, 4))
case("where", "broadcast", lambda x, y: ag.where(ag.tensor(C31), x, y), rn(3, 4), rn(4))
case("where", "scalar-other", lambda x: ag.where(ag.tensor(C34), x * x, 0.0), rn(3, 4))
case("where", "cond-from-tensor", lambda x: ag.where(x > 0, x, x * 3.0), away(2, 5))

# ---- matmul ---------------------------------------------------------------------------------------------

MM = [
    ((3, 4), (4, 5), "2d"),
    ((2, 3, 4), (2, 4, 5), "batched"),
    ((2, 1, 3, 4), (5, 4, 2), "batched-broadcast"),
    ((3, 4), (2, 4, 5), "2d-by-batched"),
    ((4,), (4, 5), "1d-2d"),
    ((3, 4), (4,), "2d-1d"),
    ((4,), (4,), "1d-1d"),
    ((4,), (2, 4, 3), "1d-batched"),
    ((2, 3, 4), (4,), "batched-1d"),
]
for sa, sb, lbl in MM:
    case("matmul", lbl, lambda a, b: a @ b, rn(*sa), rn(*sb))
case("matmul", "fn", ag.matmul, rn(2, 3), rn(3, 2))
case("matmul", "method", lambda a, b: a.matmul(b), rn(3), rn(3, 2))
case("matmul", "self", lambda a: a @ a, rn(3, 3))

# ---- reductions ------------------------------------------------------------------------------------------

for name, f in [("sum", ag.sum), ("mean", ag.mean)]:
    case(name, "full", lambda x, f=f: f(x), rn(3, 4))
    case(name, "full-1d", lambda x, f=f: f(x), rn(5))
    case(name, "dim1", lambda x, f=f: f(x, 1), rn(2, 3, 4))
    case(name, "dims02", lambda x, f=f: f(x, (0, 2)), rn(2, 3, 4))
    case(name, "dim-neg-keepdim", lambda x, f=f: f(x, -1, keepdim=True), rn(2, 3, 4))
    case(name, "dim0-keepdim", lambda x, f=f: f(x, 0, keepdim=True), rn(3, 4))
    case(name, "full-keepdim", lambda x, f=f: f(x, None, keepdim=True), rn(3, 4))
case("sum", "method", lambda x: x.sum(1), rn(3, 4))
case("mean", "method", lambda x: x.mean(0), rn(3, 4))

case("max", "full", ag.max, distinct(3, 4))
case("max", "full-method", lambda x: x.max(), distinct(2, 3, 2))
case("max", "dim1", lambda x: ag.max(x, 1).values, distinct(3, 4))
case("max", "dim0-keepdim", lambda x: ag.max(x, 0, keepdim=True).values, distinct(3, 4))
case("max", "dim-neg", lambda x: x.max(-1)[0], distinct(2, 3, 4))
case("max", "amax-dim", lambda x: ag.amax(x, 1), distinct(3, 4))
case("min", "full", ag.min, distinct(3, 4))
case("min", "dim1-keepdim", lambda x: ag.min(x, 1, keepdim=True).values, distinct(3, 4))

# ---- shape ops ---------------------------------------------------------------------------------------------

case("reshape", "2d", lambda x: x.reshape(6, 4), rn(2, 3, 4))
case("reshape", "infer", lambda x: ag.reshape(x, (-1,)), rn(2, 3, 4))
case("reshape", "3d", lambda x: x.reshape((4, 1, 6)), rn(2, 3, 4))
case("reshape", "of-transposed", lambda x: x.T.reshape(12), rn(3, 4))
case("transpose", "2d", lambda x: ag.transpose(x, 0, 1), rn(3, 4))
case("transpose", "3d", lambda x: x.transpose(0, 2), rn(2, 3, 4))
case("transpose", "T", lambda x: x.T, rn(3, 4))
case("permute", "3d", lambda x: ag.permute(x, (2, 0, 1)), rn(2, 3, 4))
case("permute", "method", lambda x: x.permute(1, 2, 0), rn(2, 3, 4))
case("broadcast_to", "lead", lambda x: ag.broadcast_to(x, (3, 4)), rn(4))
case("broadcast_to", "inner", lambda x: x.broadcast_to(2, 3, 4), rn(3, 1))
case("broadcast_to", "scalar", lambda x: ag.broadcast_to(x, (2, 2)), rn())
case("concat", "dim0", lambda a, b, c: ag.concat([a, b, c], 0), rn(2, 3), rn(4, 3), rn(1, 3))
case("concat", "dim1", lambda a, b: ag.concat([a, b], dim=1), rn(2, 3), rn(2, 1))
case("concat", "dim-neg", lambda a, b: ag.cat((a, b), -1), rn(2, 2, 3), rn(2, 2, 2))
case("concat", "same-twice", lambda a: ag.concat([a, a * 2.0], 0), rn(2, 3))
case("stack", "dim0", lambda a, b, c: ag.stack([a, b, c]), rn(2, 3), rn(2, 3), rn(2, 3))
case("stack", "dim-neg", lambda a, b: ag.stack([a, b], -1), rn(2, 3), rn(2, 3))
case("stack", "dim1", lambda a, b: ag.stack([a, b], 1), rn(4), rn(4))

# ---- indexing ----------------------------------------------------------------------------------------------

case("getitem", "int", lambda x: x[1], rn(3, 4))
case("getitem", "negative-int", lambda x: x[-1, 2], rn(3, 4))
case("getitem", "slices", lambda x: x[:, 1:3], rn(3, 4))
case("getitem", "step-reverse", lambda x: x[::2, ::-1], rn(5, 4))
case("getitem", "none-ellipsis", lambda x: x[None, ..., 0], rn(2, 3, 4))
case("getitem", "int-none-slice", lambda x: x[1, None, 2:], rn(3, 4))
case("getitem", "ellipsis", lambda x: x[..., 1], rn(2, 3, 4))
case("getitem", "int-array-repeated", lambda x: x[[0, 2, 0]], rn(3, 4))
case("getitem", "int-array-2d", lambda x: x[np.array([[0, 1], [1, 1]]), 2], rn(3, 4))
case("getitem", "int-array-cols-repeated", lambda x: x[:, [3, 0, 3]], rn(3, 4))
case("getitem", "int-array-pairs", lambda x: x[[0, 1, 2, 0], [3, 3, 0, 3]], rn(3, 4))
case("getitem", "tensor-index", lambda x: x[ag.tensor([2, 2, 0])], rn(3, 4))
MASK = R.random((3, 4)) > 0.4
ROWS = np.array([True, False, True])
case("getitem", "bool-mask", lambda x: x[MASK], rn(3, 4))
case("getitem", "bool-rows", lambda x: x[ROWS], rn(3, 4))
case("getitem", "bool-tensor-mask", lambda x: x[x > 0], away(3, 4))
case("getitem", "slice-then-bool", lambda x: x[1:, ROWS[:2]], rn(3, 2))

# ---- softmax -----------------------------------------------------------------------------------------------

for name, f in [("softmax", ag.softmax), ("log_softmax", ag.log_softmax)]:
    case(name, "last", lambda x, f=f: f(x), rn(3, 4))
    case(name, "dim0", lambda x, f=f: f(x, 0), rn(3, 4))
    case(name, "3d-dim1", lambda x, f=f: f(x, dim=1), rn(2, 3, 4))
    case(name, "1d", lambda x, f=f: f(x, -1), rn(5))
case("softmax", "method", lambda x: x.softmax(-1), rn(2, 3))
case("log_softmax", "method", lambda x: x.log_softmax(0), rn(2, 3))
case("log_softmax", "large-logits", lambda x: ag.log_softmax(x * 50.0), rn(2, 4))

# ---- more elementwise math ------------------------------------------------------------------------------

for shp in [(), (5,), (2, 3)]:
    lbl = _s(shp)
    case("sin", lbl, ag.sin, rn(*shp))
    case("cos", lbl, ag.cos, rn(*shp))
    case("log1p", lbl, ag.log1p, pos(*shp) - 0.4)
    case("expm1", lbl, ag.expm1, rn(*shp))
    case("erf", lbl, ag.erf, rn(*shp))
    case("rsqrt", lbl, ag.rsqrt, pos(*shp))
    case("reciprocal", lbl, ag.reciprocal, away(*shp))
    case("square", lbl, ag.square, rn(*shp))
# rounding: inputs off the jumps (multiples of 0.1 plus 0.03); the gradient is 0
case("floor", "2x3", ag.floor, grid(2, 3, off=0.03))
case("ceil", "method", lambda x: x.ceil() * x, grid(4, off=0.03))
case("round", "2x3", lambda x: ag.round(x) + x, grid(2, 3, off=0.03))
case("round", "decimals", lambda x: x.round(decimals=1) * x, grid(4, off=0.03) / 7)
case("sin", "method", lambda x: x.sin() * x.cos(), rn(4))
case("square", "method", lambda x: x.square().rsqrt(), away(3))
case("lerp", "scalar-weight", lambda a, b: ag.lerp(a, b, 0.3), rn(2, 3), rn(2, 3))
case("lerp", "tensor-weight", lambda a, b, w: a.lerp(b, w), rn(2, 3), rn(3), R.uniform(0, 1, (2, 1)))
case("lerp", "weight-above-half", lambda a, b, w: ag.lerp(a, b, w), rn(4), rn(4), R.uniform(0.6, 1.2, (4,)))
NONFINITE = np.array([1.0, np.nan, -2.0, np.inf, 0.5, -np.inf])
case("nan_to_num", "finite", lambda x: ag.nan_to_num(x) * x, rn(2, 3))
case(
    "nan_to_num",
    "nonfinite",
    lambda x: ag.nan_to_num(x + ag.tensor(NONFINITE), nan=0.5, posinf=3.0, neginf=-3.0) * x,
    rn(6),
)

# ---- more reductions ------------------------------------------------------------------------------------


def with_zeros(*s: int, k: int = 1) -> np.ndarray:
    """Random values with ``k`` exact zeros in every row (the prod gradient's hard case)."""
    a = rn(*s)
    for row in a.reshape(-1, s[-1]):
        row[R.choice(s[-1], k, replace=False)] = 0.0
    return a


case("prod", "full", ag.prod, rn(3, 4))
case("prod", "dim1", lambda x: ag.prod(x, 1), rn(2, 3, 4))
case("prod", "dim0-keepdim", lambda x: x.prod(0, keepdim=True), rn(3, 4))
case("prod", "scalar", lambda x: ag.prod(x), rn())
case("prod", "one-zero", lambda x: x.prod(-1), with_zeros(3, 4))
case("prod", "two-zeros", lambda x: x.prod(1), with_zeros(2, 5, k=2))
case("prod", "one-zero-full", ag.prod, with_zeros(2, 3))
case("prod", "zero-dim0", lambda x: ag.prod(x, 0), with_zeros(4, 3).T.copy())
case("amin", "dim1", lambda x: ag.amin(x, 1), distinct(3, 4))
case("amin", "method-dims", lambda x: x.amin((0, 2), keepdim=True), distinct(2, 3, 2))

# ---- more shape ops -------------------------------------------------------------------------------------

case("split", "int", lambda x: ag.split(x, 2, 1)[2] * ag.split(x, 2, 1)[0][:, :1], rn(3, 5))
case("split", "sizes", lambda x: ag.concat(list(x.split([1, 3, 1], 0))[::-1], 0), rn(5, 2))
case("chunk", "3", lambda x: ag.chunk(x, 3, -1)[1], rn(2, 7))
case("unbind", "dim1", lambda x: ag.stack(ag.unbind(x, 1)[::-1]), rn(2, 3))
case("narrow", "neg-start", lambda x: x.narrow(1, -3, 2), rn(2, 5))
case("flip", "dims", lambda x: ag.flip(x, (0, 2)), rn(2, 3, 4))
case("flip", "method", lambda x: x.flip(1) * x, rn(3, 3))
case("roll", "dims", lambda x: ag.roll(x, (1, -2), (0, 1)), rn(3, 4))
case("roll", "flat", lambda x: x.roll(5), rn(2, 3))
case("movedim", "pair", lambda x: ag.movedim(x, (0, 1), (2, 0)), rn(2, 3, 4))
case("swapaxes", "method", lambda x: x.swapaxes(0, -1), rn(2, 3, 4))
case("unflatten", "infer", lambda x: ag.unflatten(x, 1, (2, -1)), rn(3, 6))
case("repeat", "more-dims", lambda x: x.repeat(2, 1, 3), rn(2, 3))
case("repeat", "same-dims", lambda x: ag.repeat(x, (3, 2)), rn(2, 2))
case("repeat_interleave", "int-dim", lambda x: ag.repeat_interleave(x, 3, dim=1), rn(2, 3))
case("repeat_interleave", "flat", lambda x: x.repeat_interleave(2), rn(2, 2))
case("repeat_interleave", "counts", lambda x: ag.repeat_interleave(x, [2, 0, 1], dim=0), rn(3, 2))
case("tril", "k0", ag.tril, rn(3, 4))
case("tril", "batched-k-1", lambda x: x.tril(-1), rn(2, 3, 3))
case("triu", "k1", lambda x: ag.triu(x, 1), rn(4, 3))
case("triu", "method", lambda x: x.triu() @ x, rn(3, 3))
case("diag", "1d-to-2d", lambda v: ag.diag(v, 1), rn(3))
case("diag", "2d-to-1d", lambda x: x.diag(-1), rn(3, 4))
case("diag", "square", lambda x: ag.diag(x) * ag.diag(x), rn(3, 3))
case("trace", "2d", lambda x: ag.trace(x * x), rn(3, 4))

# ---- more linalg ---------------------------------------------------------------------------------------

case("mm", "2d", ag.mm, rn(3, 4), rn(4, 2))
case("bmm", "3d", lambda a, b: a.bmm(b), rn(2, 3, 4), rn(2, 4, 2))
case("dot", "1d", ag.dot, rn(5), rn(5))
case("outer", "1d", lambda a, b: a.outer(b), rn(3), rn(4))
case("addmm", "bias-row", lambda c, a, b: ag.addmm(c, a, b), rn(2), rn(3, 4), rn(4, 2))
case("addmm", "beta-alpha", lambda c, a, b: c.addmm(a, b, beta=0.5, alpha=-2.0), rn(3, 2), rn(3, 4), rn(4, 2))
case("addmm", "beta0", lambda c, a, b: ag.addmm(c, a, b, beta=0), rn(3, 2), rn(3, 4), rn(4, 2))

# ---- sorting, selection, scatter -------------------------------------------------------------------------

case("sort", "last", lambda x: ag.sort(x).values, distinct(3, 4))
case("sort", "dim0-descending", lambda x: x.sort(0, descending=True)[0], distinct(4, 3))
case("sort", "values-times-x", lambda x: ag.sort(x, -1).values * x, distinct(2, 5))
case("topk", "largest", lambda x: ag.topk(x, 2).values, distinct(3, 5))
case("topk", "smallest-dim0", lambda x: x.topk(3, 0, largest=False).values, distinct(4, 2))
case("masked_select", "broadcast", lambda x: ag.masked_select(x, ag.tensor(C31)), rn(3, 4))
case("masked_select", "method", lambda x: x.masked_select(x > 0) * 2.0, away(2, 5))
IDX = np.array([[0, 2, 1, 2], [1, 0, 2, 0]])
case("scatter", "src", lambda x, s: x.scatter(0, ag.tensor(IDX), s), rn(3, 4), rn(2, 4))
case("scatter", "larger-src", lambda x, s: ag.scatter(x, 1, ag.tensor(IDX[:, :3]), s), rn(2, 4), rn(3, 5))
case("scatter", "value", lambda x: x.scatter(0, ag.tensor(IDX), 1.5) * x, rn(3, 4))
case("scatter_add", "repeated", lambda x, s: x.scatter_add(1, ag.tensor([[0, 0, 3], [2, 2, 2]]), s), rn(2, 4), rn(2, 3))
case("scatter_add", "src-times", lambda x, s: ag.scatter_add(x, 0, ag.tensor(IDX), s * s), rn(3, 4), rn(2, 4))

REQUIRED_OPS = {
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "pow",
    "exp",
    "log",
    "tanh",
    "sigmoid",
    "relu",
    "sqrt",
    "abs",
    "maximum",
    "minimum",
    "where",
    "matmul",
    "sum",
    "mean",
    "max",
    "reshape",
    "transpose",
    "permute",
    "broadcast_to",
    "concat",
    "stack",
    "getitem",
    "softmax",
    "log_softmax",
    "sin",
    "cos",
    "floor",
    "ceil",
    "round",
    "log1p",
    "expm1",
    "erf",
    "rsqrt",
    "reciprocal",
    "square",
    "lerp",
    "nan_to_num",
    "prod",
    "amin",
    "split",
    "chunk",
    "unbind",
    "narrow",
    "flip",
    "roll",
    "movedim",
    "swapaxes",
    "unflatten",
    "repeat",
    "repeat_interleave",
    "tril",
    "triu",
    "diag",
    "trace",
    "mm",
    "bmm",
    "dot",
    "outer",
    "addmm",
    "sort",
    "topk",
    "masked_select",
    "scatter",
    "scatter_add",
}
GG_OPS = {
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "pow",
    "exp",
    "log",
    "tanh",
    "sigmoid",
    "relu",
    "sqrt",
    "abs",
    "maximum",
    "minimum",
    "where",
    "matmul",
}


def test_table_covers_every_op() -> None:
    ops = {c.op for c in CASES}
    assert REQUIRED_OPS <= ops, REQUIRED_OPS - ops
    assert GG_OPS <= {c.op for c in CASES if c.gg}
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("c", CASES, ids=repr)
async def test_gradcheck(rt: Any, c: Case) -> None:
    with trio.fail_after(TIMEOUT):
        await ag.autograd.gradcheck(c.fn, c.inputs, rtol=1e-4)


@pytest.mark.parametrize("c", [c for c in CASES if c.gg], ids=repr)
async def test_gradgradcheck(rt: Any, c: Case) -> None:
    with trio.fail_after(TIMEOUT):
        await ag.autograd.gradgradcheck(c.fn, c.inputs, rtol=1e-4)


async def test_gradcheck_catches_a_wrong_rule(rt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: a deliberately wrong backward rule must fail it."""
    op = ag.OPS["tanh"]
    monkeypatch.setattr(op, "rule", lambda xp, g, args, out, kw, needs: (g * (1 - out),))
    with pytest.raises(ag.autograd.GradcheckError, match="analytic and numerical gradients of input 0"):
        await ag.autograd.gradcheck(ag.tanh, [rn(3)], rtol=1e-4)


# ---- meta vs result, inline path vs queued path ------------------------------------------------------------


class KernelSpy:
    """Wraps every op's kernel: checks the op's meta against what the kernel really returned, and records
    on which thread each kernel ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mismatches: list[str] = []
        self.threads: list[tuple[str, int]] = []
        for op in ag.OPS.values():
            monkeypatch.setattr(op, "kernel", self._wrap(op, op.kernel, op.meta))

    def _wrap(self, op: Any, kernel: Any, meta: Any) -> Any:
        def spy(*arrays: Any, **kw: Any) -> Any:
            res = kernel(*arrays, **kw)
            self.threads.append((op.name, threading.get_ident()))
            targs = [
                ag.Tensor._wrap(np.asarray(a), None) if isinstance(a, (np.ndarray, np.generic)) else a
                for a in arrays
            ]
            shape, dtype = meta(*targs, **kw)
            real = np.asarray(res)
            if tuple(shape) != real.shape or np.dtype(dtype) != real.dtype:
                self.mismatches.append(
                    f"{op.name}: meta says {tuple(shape)} {np.dtype(dtype)}, "
                    f"kernel gave {real.shape} {real.dtype}"
                )
            return res

        return spy


async def _run(c: Case, inputs: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray], tuple[Any, Any]]:
    leaves = [ag.tensor(a, requires_grad=True) for a in inputs]
    out = c.fn(*leaves)
    predicted = (out.shape, out.dtype)  # known before the value (meta)
    w = np.random.default_rng(7).standard_normal(out.shape)
    with trio.fail_after(TIMEOUT):
        grads = await ag.grad((out * ag.tensor(w)).sum(), leaves, allow_unused=True)
        await out.ready()
    value = out.numpy()
    assert predicted == (value.shape, value.dtype), (predicted, value.shape, value.dtype)
    gs = []
    for g, a in zip(grads, inputs):
        ga = np.zeros_like(a) if g is None else g.numpy()
        assert ga.shape == a.shape and ga.dtype == a.dtype
        gs.append(ga)
    return value, gs, predicted


def _assert_same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    np.testing.assert_array_equal(a[0], b[0])
    for x, y in zip(a[1], b[1]):
        np.testing.assert_array_equal(x, y)
    assert a[2] == b[2]


@pytest.mark.parametrize("c", CASES, ids=repr)
async def test_meta_inline_and_queued_agree(rt: Any, c: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = KernelSpy(monkeypatch)
    main = threading.get_ident()
    set_inline_limit(monkeypatch, 1 << 40)
    inline = await _run(c, c.inputs)
    assert spy.threads and all(t == main for _, t in spy.threads), "inline path ran a kernel on a lane"
    spy.threads.clear()
    set_inline_limit(monkeypatch, -1)
    queued = await _run(c, c.inputs)
    assert spy.threads and all(t != main for _, t in spy.threads), "queued path ran a kernel inline"
    assert not spy.mismatches, spy.mismatches
    _assert_same(inline, queued)


BIG = 72  # BIG * BIG > INLINE_MAX_ELEMENTS
BIG_CASES = [
    Case("add", "add", lambda a, b: a + b, [rn(BIG, BIG), rn(BIG)]),
    Case("mul", "mul-scalar", lambda a: a * 2.0, [rn(BIG, BIG)]),
    Case("div", "div", lambda a, b: a / b, [rn(BIG, BIG), away(BIG, 1)]),
    Case("pow", "pow", lambda a: a**3, [rn(BIG, BIG)]),
    Case("exp", "exp-log-sqrt", lambda a: ag.sqrt(ag.log(ag.exp(a) + 1.0)), [rn(BIG, BIG)]),
    Case("tanh", "tanh-sigmoid", lambda a: ag.tanh(a) * ag.sigmoid(a), [rn(BIG, BIG)]),
    Case("relu", "relu-abs", lambda a: ag.relu(a) + ag.abs(a), [away(BIG, BIG)]),
    Case("maximum", "maximum", ag.maximum, [grid(BIG, BIG), grid(BIG, off=0.05)]),
    Case("where", "where", lambda a, b: ag.where(a > 0, a, b), [away(BIG, BIG), rn(BIG, BIG)]),
    Case("matmul", "matmul", lambda a, b: a @ b, [rn(BIG, BIG), rn(BIG, BIG)]),
    Case("matmul", "batched", lambda a, b: a @ b, [rn(2, BIG, 40), rn(40, BIG)]),
    Case("sum", "sum-dim", lambda a: a.sum(0) * a.mean(1), [rn(BIG, BIG)]),
    Case("max", "max-dim", lambda a: ag.max(a, 1, keepdim=True).values * a, [distinct(BIG, BIG)]),
    Case("softmax", "softmax", lambda a: ag.softmax(a, 0) + ag.log_softmax(a), [rn(BIG, BIG)]),
    Case("reshape", "reshape-T", lambda a: a.T.reshape(BIG * 8, BIG // 8) * 1.0, [rn(BIG, BIG)]),
    Case("permute", "permute", lambda a: ag.permute(a, (1, 2, 0)) * 1.0, [rn(2, BIG, BIG)]),
    Case("broadcast_to", "bcast", lambda a: ag.broadcast_to(a, (BIG, BIG)) * 1.0, [rn(BIG)]),
    Case(
        "concat",
        "concat-stack",
        lambda a, b: ag.concat([a, b]) + ag.stack([a, b]).sum(0)[:1],
        [rn(BIG, BIG), rn(BIG, BIG)],
    ),
    Case("getitem", "index", lambda a: a[[0, 3, 3, 5] * 1100] * 1.0, [rn(8, 2)]),
    Case("getitem", "mask", lambda a: a[a > 0] * 1.0, [away(BIG, BIG)]),
]


@pytest.mark.parametrize("c", BIG_CASES, ids=repr)
async def test_large_inputs_go_to_lanes(rt: Any, c: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the default threshold, outputs above INLINE_MAX_ELEMENTS are computed on worker lanes; the
    values and gradients equal those of the inline path bit for bit."""
    spy = KernelSpy(monkeypatch)
    main = threading.get_ident()
    queued = await _run(c, c.inputs)
    big = [t for name, t in spy.threads if name != "astype"]
    assert any(t != main for t in big), "no kernel ran on a lane"
    assert queued[0].size > INLINE_MAX_ELEMENTS or any(a.size > INLINE_MAX_ELEMENTS for a in c.inputs)
    set_inline_limit(monkeypatch, 1 << 40)
    inline = await _run(c, c.inputs)
    assert not spy.mismatches, spy.mismatches
    _assert_same(inline, queued)


async def test_gradgradcheck_catches_a_detached_rule(rt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that is right to first order but cuts the graph (uses a plain value) fails gradgradcheck."""
    op = ag.OPS["tanh"]
    monkeypatch.setattr(
        op, "rule", lambda xp, g, args, out, kw, needs: (g * (1 - xp.const(xp.value(out) ** 2, g)),)
    )
    await ag.autograd.gradcheck(ag.tanh, [rn(3)], rtol=1e-4)
    with pytest.raises(ag.autograd.GradcheckError, match="gradgradcheck: analytic and numerical gradients of input 0"):
        await ag.autograd.gradgradcheck(ag.tanh, [rn(3)], rtol=1e-4)


Fn = Callable[..., Any]


# ---- second derivatives (create_graph=True) ------------------------------------------------------------


def _second_cases(rng: np.random.Generator) -> dict[str, tuple[Fn, list[np.ndarray]]]:
    x4 = rng.standard_normal((2, 4, 5, 5))
    w4 = rng.standard_normal((4, 2, 3, 3))
    pool_x = rng.permutation(2 * 3 * 7 * 8).reshape(2, 3, 7, 8) / 10.0
    x3 = rng.standard_normal((3, 4, 5))
    t = rng.integers(0, 4, (3, 5))
    t[0, 0] = 2
    cw = rng.uniform(0.5, 2, 4)
    gidx = rng.integers(0, 4, (3, 6, 2))
    return {
        # the tanh makes the loss non-quadratic, so every adjoint op of conv2d is exercised
        "conv2d": (
            lambda x, w, b: ag.tanh(ag.conv2d(x, w, b, stride=2, padding=1, groups=2)),
            [x4, w4, rng.standard_normal(4)],
        ),
        "conv2d_channels_last": (
            lambda x, w: ag.tanh(ag.conv2d(x, w, None, dilation=2, padding=2, groups=2)),
            [channels_last(x4), w4],
        ),
        "max_pool2d": (lambda x: ag.max_pool2d(x, 3, 2, 1, 1, True) ** 2, [pool_x]),
        "avg_pool2d": (lambda x: ag.tanh(ag.avg_pool2d(x, 3, 2, 1, True, False)), [pool_x]),
        "embedding": (
            lambda w: ag.embedding(np.array([[0, 2, 2], [5, 1, 2]]), w) ** 3,
            [rng.standard_normal((6, 3))],
        ),
        "layer_norm": (
            lambda x, w, b: ag.layer_norm(x, (5,), w, b),
            [x3, rng.standard_normal(5), rng.standard_normal(5)],
        ),
        "dropout": (lambda x: ag.dropout(x, 0.4, generator=np.random.default_rng(3)) ** 2, [x3]),
        "logsumexp": (lambda x: x.logsumexp(1), [x3]),
        "clamp": (lambda x: ag.clamp(x, -0.5, 0.5) ** 2, [x3]),
        "gather": (lambda x: ag.gather(x, 1, ag.tensor(gidx)) ** 2, [x3]),
        "index_select": (lambda x: ag.index_select(x, 1, np.array([2, 0, 2])) ** 2, [x3]),
        "cumsum": (lambda x: ag.cumsum(x, 1) ** 2, [x3]),
        "einsum": (lambda a, b: ag.einsum("bij,bjk->bik", a, b) ** 2, [x3, rng.standard_normal((3, 5, 2))]),
        "einsum_diag": (lambda a: ag.einsum("iij->j", a) ** 2, [rng.standard_normal((3, 3, 2))]),
        "var": (lambda x: ag.var(x, 1), [x3]),
        "std": (lambda x: ag.std(x, (0, 2), correction=0), [x3]),
        "cross_entropy": (
            lambda x: ag.cross_entropy(x, t, ag.tensor(cw), ignore_index=2, label_smoothing=0.1),
            [x3[:, :4]],
        ),
        "cross_entropy_none": (lambda x: ag.cross_entropy(x, t, reduction="none"), [x3[:, :4]]),
        "nll_loss": (lambda x: ag.nll_loss(ag.log_softmax(x, 1), t, ag.tensor(cw)), [x3[:, :4]]),
        "mse_loss": (lambda x, y: ag.tanh(ag.mse_loss(x, y)), [x3, rng.standard_normal((3, 4, 5))]),
        "bce_with_logits": (
            lambda x, t, w, pw: ag.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw),
            [x3, rng.uniform(0, 1, (3, 4, 5)), rng.uniform(0.5, 2, (4, 1)), rng.uniform(0.5, 3, 5)],
        ),
    }


@pytest.mark.parametrize("name", sorted(_second_cases(np.random.default_rng(0))))
async def test_second_derivatives(name: str) -> None:
    async with ag.open_runtime():
        fn, ins = _second_cases(np.random.default_rng(42))[name]
        await ag.autograd.gradgradcheck(fn, ins, directions=2, eps=1e-5, atol=1e-6, rtol=1e-4, seed=7)
