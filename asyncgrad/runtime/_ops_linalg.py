"""Linear algebra: matmul (1-D, 2-D and batched with broadcasting)."""

from __future__ import annotations

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
from ._dispatch import OpError, apply, broadcast_shapes, defop
from ._tensor import Tensor
from ._xp import NP, sum_to

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


OP_MATMUL = defop("matmul", matmul_kernel, _matmul_meta, _matmul_rule)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with numpy/PyTorch semantics (1-D operands, batched broadcasting)."""
    return apply(OP_MATMUL, (a, b))


def _install() -> None:
    NP.matmul = staticmethod(matmul_kernel)  # type: ignore[assignment,arg-type]
    Tensor.__matmul__ = lambda s, o: apply(OP_MATMUL, (s, o))  # type: ignore[attr-defined,method-assign]
    Tensor.__rmatmul__ = lambda s, o: apply(OP_MATMUL, (o, s))  # type: ignore[attr-defined,method-assign]
    Tensor.matmul = matmul  # type: ignore[attr-defined,method-assign]


_install()


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
    from ._ops_shape import expand_dims

    _ndims("outer", 1, input=input, vec2=vec2)
    return expand_dims(input, 1) * expand_dims(vec2, 0)


def addmm(input: Tensor, mat1: Tensor, mat2: Tensor, *, beta: Any = 1, alpha: Any = 1) -> Tensor:
    """``beta * input + alpha * (mat1 @ mat2)``, ``input`` broadcast to the product's shape (torch.addmm).

    With ``beta=0`` the input is ignored (its NaN and inf do not propagate; its gradient is 0), as PyTorch.
    """
    from ._ops_elementwise import where
    from ._ops_shape import broadcast_to

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


def _install_more() -> None:
    for f in (mm, bmm, dot, outer, addmm):
        setattr(Tensor, f.__name__, f)


_install_more()
