"""Linear algebra: matmul (1-D, 2-D and batched with broadcasting)."""

from __future__ import annotations

import math
import string
from typing import Any

import numpy as np

from ..devices import (
    HOST_CACHE_MIN_BYTES,
    blas_boost_available,
    blas_boosted,
    blas_solo,
    blas_unboost,
    idle_siblings,
    lane_empty,
    run_parts,
)
from ..kernels._rows import col_sum
from ..runtime._dispatch import apply
from ..runtime._meta import broadcast_shapes
from ..runtime._op import OpError, defop
from ..runtime._tensor import Tensor
from ..runtime._xp import NP, register_xp, sum_to
from ._elementwise import where
from ._shape import broadcast_to, expand_dims

_meta_cache: dict[tuple[Any, ...], tuple[tuple[int, ...], np.dtype[Any]]] = {}


def _matmul_meta(a: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    # a training records the same few products every step: remember the answer per shapes and dtypes
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        key = (a._shape, b._shape, a._dtype, b._dtype)
        r = _meta_cache.get(key)
        if r is None:
            r = _matmul_meta_uncached(a, b)
            if len(_meta_cache) < 4096:
                _meta_cache[key] = r
        return r
    return _matmul_meta_uncached(a, b)


def _matmul_meta_uncached(a: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    sa, sb = a.shape, b.shape
    if len(sa) == 0 or len(sb) == 0:
        raise OpError(f"matmul: both operands need at least 1 dim, got shapes {tuple(sa)} and {tuple(sb)}")
    a2 = (1, *sa) if len(sa) == 1 else sa
    b2 = (*sb, 1) if len(sb) == 1 else sb
    if a2[-1] != b2[-2]:
        raise OpError(
            f"matmul: shapes {tuple(sa)} and {tuple(sb)} are not aligned: (..., n, k) @ (..., k, m) needs "
            f"equal k, got {a2[-1]} and {b2[-2]}"
        )
    try:
        batch = broadcast_shapes("matmul", tuple(a2[:-2]), tuple(b2[:-2]))
    except OpError:
        # name the operands' shapes, not just their batch parts
        raise OpError(
            f"matmul: shapes {tuple(sa)} and {tuple(sb)} have batch dimensions {tuple(a2[:-2])} and "
            f"{tuple(b2[:-2])} that cannot be broadcast together; make each batch dimension equal or 1"
        ) from None
    out = (*batch, a2[-2], b2[-1])
    if len(sa) == 1:
        out = out[:-2] + out[-1:]
    if len(sb) == 1:
        out = out[:-1]
    da = a._dtype if isinstance(a, Tensor) else a.dtype
    db = b._dtype if isinstance(b, Tensor) else b.dtype
    if da != db:  # PyTorch does not promote in matmul either: a silent float64 product would hide a bug
        raise OpError(
            f"matmul: expected both operands to have the same dtype, got {da} (shape {tuple(sa)}) and {db} "
            f"(shape {tuple(sb)}); convert one with .to(dtype)"
        )
    return tuple(out), np.dtype(da)


def _matmul_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    a, b = args
    sa, sb = tuple(a.shape), tuple(b.shape)
    # promote 1-D operands to matrices, then undo it on the gradients
    a2 = xp.reshape(a, (1, *sa)) if len(sa) == 1 else a
    b2 = xp.reshape(b, (*sb, 1)) if len(sb) == 1 else b
    g2 = g
    if len(sa) == 1:
        g2 = xp.expand_dims(g2, -2 if len(sb) > 1 else 0)
    if len(sb) == 1:
        g2 = xp.expand_dims(g2, -1)
    ga = gb = None
    if needs[0]:
        ga = sum_to(xp, xp.matmul(g2, xp.swapaxes(b2, -1, -2)), tuple(a2.shape))
        ga = xp.reshape(ga, sa) if len(sa) == 1 else ga
    if needs[1]:
        gb = sum_to(xp, xp.matmul(xp.swapaxes(a2, -1, -2), g2), tuple(b2.shape))
        gb = xp.reshape(gb, sb) if len(sb) == 1 else gb
    return (ga, gb)


# A 2-D product of at least this many flops is split across idle sibling lanes. Lending a slice costs
# a thread wake-up and a GIL hand-off (tens of us, up to a loop tick under load), so each slice
# should be worth well over that: at ~25 GFLOP/s per core this is ~1 ms of single-core work.
SPLIT_MIN_FLOPS = 24_000_000


def matmul_kernel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.matmul``; a large 2-D product writes into a cached buffer, split across idle lanes."""
    if a.ndim != 2 or b.ndim != 2:
        return np.matmul(a, b)
    m, k = a.shape
    n = b.shape[1]
    dtype = np.result_type(a.dtype, b.dtype)
    if m * n * dtype.itemsize < HOST_CACHE_MIN_BYTES and 2 * m * n * k < SPLIT_MIN_FLOPS:
        return np.matmul(a, b)
    out = lane_empty((m, n), dtype)
    if blas_solo():  # the lone training has every lane's BLAS threads already
        np.matmul(a, b, out=out)
        return out
    ways = 1 + len(idle_siblings())
    if ways < 2 or 2 * m * n * k < SPLIT_MIN_FLOPS:
        np.matmul(a, b, out=out)
        return out
    if blas_boost_available():
        # BLAS's own threads (no GIL, spinning briefly) beat handing slices to sibling lanes (W1)
        blas_boosted(ways)
        try:
            np.matmul(a, b, out=out)
        finally:
            blas_unboost()
        return out
    # split the longer side of the output into contiguous row or column blocks, one per lane (two per
    # lane measured no better on W1/W5: smaller blocks run less efficiently in BLAS)
    rows = m >= n
    length = m if rows else n
    ways = min(ways, length)
    cuts = [length * i // ways for i in range(ways + 1)]

    def part(lo: int, hi: int) -> Any:
        if rows:
            return lambda: np.matmul(a[lo:hi], b, out=out[lo:hi])
        return lambda: np.matmul(a, b[:, lo:hi], out=out[:, lo:hi])

    run_parts([part(cuts[i], cuts[i + 1]) for i in range(ways)])
    return out


def contraction_work(args: tuple[Any, ...], n: int, kw: dict[str, Any]) -> int:
    """A product's multiply-adds: output elements x the contracted length (`Op.work`)."""
    a = args[0]
    return n * (a._shape[-1] if a._shape else 1)


OP_MATMUL = defop("matmul", matmul_kernel, _matmul_meta, _matmul_rule, work=contraction_work)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with numpy/PyTorch semantics (1-D operands, batched broadcasting)."""
    return apply(OP_MATMUL, (a, b))


# ---- mm, bmm, dot, outer, addmm: matmul with PyTorch's stricter shape and dtype checks --------------------


def _same_dtype(op: str, a: Tensor, b: Tensor, what: str) -> None:
    if a.dtype != b.dtype:
        raise OpError(
            f"{op}: expected {what} to have the same dtype, got {a.dtype} and {b.dtype}; "
            "convert one with .to(dtype) first"
        )


def _ndims(op: str, want: int, **ts: Tensor) -> None:
    for name, t in ts.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
        if t.ndim != want:
            raise OpError(f"{op}: {name} must be {want}-D, got shape {tuple(t.shape)}")


def _mm_check(op: str, a: Tensor, b: Tensor) -> None:
    _ndims(op, 2, mat1=a, mat2=b)
    if a.shape[1] != b.shape[0]:
        raise OpError(
            f"{op}: mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and "
            f"{b.shape[0]}x{b.shape[1]}): mat1's columns must equal mat2's rows"
        )
    _same_dtype(op, a, b, "mat1 and mat2")


def mm(input: Tensor, mat2: Tensor) -> Tensor:
    """The product of two matrices (2-D only, same dtype), like ``torch.mm``."""
    _mm_check("mm", input, mat2)
    return apply(OP_MATMUL, (input, mat2))


def bmm(input: Tensor, mat2: Tensor) -> Tensor:
    """Batched matrix product of (b, n, k) and (b, k, m) tensors (no broadcasting), like ``torch.bmm``."""
    _ndims("bmm", 3, input=input, mat2=mat2)
    if input.shape[0] != mat2.shape[0] or input.shape[2] != mat2.shape[1]:
        raise OpError(
            f"bmm: shapes {tuple(input.shape)} and {tuple(mat2.shape)} do not fit (b, n, k) @ (b, k, m): "
            "batch sizes and inner dims must be equal"
        )
    _same_dtype("bmm", input, mat2, "input and mat2")
    return apply(OP_MATMUL, (input, mat2))


def dot(input: Tensor, other: Tensor) -> Tensor:
    """The inner product of two 1-D tensors of equal length, like ``torch.dot``."""
    _ndims("dot", 1, input=input, other=other)
    if input.shape != other.shape:
        raise OpError(
            f"dot: expected vectors of equal length, got shapes {tuple(input.shape)} and {tuple(other.shape)}"
        )
    _same_dtype("dot", input, other, "both vectors")
    return apply(OP_MATMUL, (input, other))


def outer(input: Tensor, vec2: Tensor) -> Tensor:
    """The outer product ``input[i] * vec2[j]`` of two 1-D tensors, like ``torch.outer``."""

    _ndims("outer", 1, input=input, vec2=vec2)
    return expand_dims(input, 1) * expand_dims(vec2, 0)


def addmm(input: Tensor, mat1: Tensor, mat2: Tensor, *, beta: Any = 1, alpha: Any = 1) -> Tensor:
    """``beta * input + alpha * (mat1 @ mat2)``, ``input`` broadcast to the product's shape (torch.addmm).

    With ``beta=0`` the input is ignored (its NaN and inf do not propagate; its gradient is 0), as PyTorch.
    """

    _mm_check("addmm", mat1, mat2)
    shape = (mat1.shape[0], mat2.shape[1])
    if not isinstance(input, Tensor):
        raise TypeError(f"addmm: input must be a Tensor, got {type(input).__name__}")
    try:
        ok = np.broadcast_shapes(tuple(input.shape), shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise OpError(f"addmm: input of shape {tuple(input.shape)} cannot be broadcast to the product's shape {shape}")
    p = apply(OP_MATMUL, (mat1, mat2))
    if alpha != 1:
        p = p * alpha
    if beta == 0:
        return where(np.ones(shape, dtype=bool), p, broadcast_to(input, shape))
    return p + (input if beta == 1 else input * beta)


def _parse_einsum(equation: str, shapes: list[tuple[int, ...]]) -> tuple[list[str], str]:
    """Explicit subscripts (no ellipsis, explicit output) for ``equation`` on operands of ``shapes``."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise OpError(
            f"einsum: equation {equation!r} names {len(terms)} operands but {len(shapes)} were given"
        )
    used = set(eq) - set(".,->")
    for c in used:
        if c not in string.ascii_letters:
            raise OpError(f"einsum: subscripts must be letters, got {c!r} in {equation!r}")
    free = [c for c in string.ascii_letters if c not in used]
    n_ell = 0
    for t, s in zip(terms, shapes):
        if "..." in t:
            n_ell = max(n_ell, len(s) - (len(t) - 3))
    ell = "".join(free[:n_ell])
    out_terms = []
    for t, s in zip(terms, shapes):
        if "..." in t:
            k = len(s) - (len(t) - 3)
            if k < 0:
                raise OpError(f"einsum: operand of shape {s} has fewer dims than subscripts {t!r}")
            t = t.replace("...", ell[n_ell - k :])
        if len(t) != len(s):
            raise OpError(f"einsum: subscripts {t!r} do not match an operand with {len(s)} dims (shape {s})")
        out_terms.append(t)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(out_terms)
        out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
    return out_terms, out


def _einsum_meta(*ops: Any, terms: list[str], out: str) -> Any:
    sizes: dict[str, int] = {}
    for t, o in zip(terms, ops):
        for c, n in zip(t, o.shape):
            m = sizes.get(c, 1)
            if m != n and m != 1 and n != 1:
                raise OpError(f"einsum: subscript {c!r} has sizes {m} and {n} in different operands")
            sizes[c] = max(m, n) if n != 1 else m
    for c in out:
        if c not in sizes:
            raise OpError(f"einsum: output subscript {c!r} appears in no operand")
    if len(set(out)) != len(out):
        raise OpError(f"einsum: output subscripts {out!r} repeat a letter")
    dt = np.result_type(*[o.dtype for o in ops])
    return tuple(sizes[c] for c in out), dt


def _einsum_kernel(*ops: np.ndarray, terms: list[str], out: str) -> np.ndarray:
    eq = ",".join(terms) + "->" + out
    big = len(ops) > 2 or sum(o.size for o in ops) > 4096
    return np.asarray(np.einsum(eq, *ops, optimize="greedy" if big and len(ops) > 1 else False))


def _einsum_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    terms, o = kw["terms"], kw["out"]
    grads: list[Any] = []
    for k, (t, need) in enumerate(zip(terms, needs)):
        if not need:
            grads.append(None)
            continue
        others = [(terms[j], args[j]) for j in range(len(terms)) if j != k]
        avail = set(o).union(*[set(tj) for tj, _ in others])
        uniq = "".join(dict.fromkeys(t))
        have = "".join(c for c in uniq if c in avail)
        eq = ",".join([o, *[tj for tj, _ in others]]) + "->" + have
        gk = xp.einsum(eq, g, *[a for _, a in others])
        shape = tuple(args[k].shape)
        size = {c: n for c, n in zip(t, shape)}
        if len(have) < len(uniq):  # letters summed away in this operand alone: broadcast back
            pos = [i for i, c in enumerate(uniq) if c not in avail]
            gk = xp.expand_dims(gk, tuple(pos))
            gk = xp.broadcast_to(
                gk, tuple(size[c] if c not in avail else gk.shape[i] for i, c in enumerate(uniq))
            )
        if len(uniq) < len(t):  # repeated letters (a diagonal): scatter onto it
            u = len(uniq)
            idx = tuple(
                np.arange(size[c]).reshape([-1 if uniq.index(c) == q else 1 for q in range(u)]) for c in t
            )
            gk = xp.index_add(shape, idx, gk)
        grads.append(gk)
    return tuple(grads)


OP_EINSUM = defop("einsum", _einsum_kernel, _einsum_meta, _einsum_rule)


def einsum(equation: str, *operands: Any) -> Tensor:
    """Einstein summation like ``torch.einsum`` (ellipsis, implicit output, broadcasting of size-1 dims)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    for o in operands:
        if not isinstance(o, Tensor):
            raise TypeError(f"einsum: operands must be Tensors, got {type(o).__name__}")
    terms, out = _parse_einsum(equation, [tuple(o.shape) for o in operands])
    return apply(OP_EINSUM, tuple(operands), {"terms": terms, "out": out})


def np_einsum(eq: str, *ops: np.ndarray) -> np.ndarray:
    terms, out = eq.split("->")
    return _einsum_kernel(*ops, terms=terms.split(","), out=out)


def ag_einsum(eq: str, *ops: Tensor) -> Tensor:
    terms, out = eq.split("->")
    return apply(OP_EINSUM, tuple(ops), {"terms": terms.split(","), "out": out})


# the rule namespaces' products (see `runtime._xp`): the numpy side is the lane-aware kernel
register_xp("matmul", matmul_kernel, matmul)
register_xp("einsum", np_einsum, ag_einsum)


def _linear_meta(x: Any, w: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise OpError(
            f"linear: input of shape {tuple(x.shape)} and weight of shape {tuple(w.shape)} do not fit: "
            "expected input (*, in_features) and weight (out_features, in_features)"
        )
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise OpError(f"linear: bias of shape {tuple(b.shape)} must be ({w.shape[0]},)")
    for name, t in (("input", x), ("bias", b)):
        if t is not None and t.dtype != w.dtype:  # PyTorch does not promote here either
            raise OpError(
                f"linear: {name} has dtype {t.dtype} but the weight has {w.dtype}; they must match "
                "(convert the input with .to(dtype), or the module with .to(dtype) / .double())"
            )
    return (*x.shape[:-1], w.shape[0]), np.dtype(w.dtype)



def _linear_kernel(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    if x.ndim > 2:
        # one (rows, in) @ (in, out) GEMM: np.matmul on a stack runs one small GEMM per leading index and
        # packs the weight again for each (3-4x slower for an LSTM LM's (35, 20, 200) @ (200, 10000))
        out = np.matmul(x.reshape(-1, x.shape[-1]), w.T).reshape(*x.shape[:-1], w.shape[0])
    else:
        out = np.matmul(x, w.T)
    if b is not None:
        out += b
    return out



def _linear_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, w, _ = args
    n_out, n_in = w.shape
    rows = math.prod(x.shape[:-1])
    gx = gw = gb = None
    g2 = xp.reshape(g, (rows, n_out))
    if needs[0]:
        # 2-D, as in the forward: one GEMM, not one per leading index
        gx = xp.matmul(g, w) if g.ndim <= 2 else xp.reshape(xp.matmul(g2, w), tuple(x.shape))
    if needs[1]:
        # (out, rows) @ (rows, in): a fresh C-contiguous array, so AccumulateGrad can steal it
        gw = xp.matmul(xp.swapaxes(g2, 0, 1), xp.reshape(x, (rows, n_in)))
    if needs[2]:
        gb = col_sum(g2) if xp is NP else xp.sum(g2, 0)
    return (gx, gw, gb)



OP_LINEAR = defop("linear", _linear_kernel, _linear_meta, _linear_rule, work=contraction_work)



def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weight.T + bias`` as one op (one kernel forward, one fused rule backward).

    Args:
        input: ``(*, in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
    """
    return apply(OP_LINEAR, (input, weight, bias))
