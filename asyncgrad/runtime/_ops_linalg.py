"""Linear algebra: matmul (1-D, 2-D and batched with broadcasting)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._dispatch import OpError, apply, broadcast_shapes, defop
from ._tensor import Tensor
from ._xp import sum_to


def _matmul_meta(a: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
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
    return tuple(out), np.result_type(da, db)


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


OP_MATMUL = defop("matmul", np.matmul, _matmul_meta, _matmul_rule)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with numpy/PyTorch semantics (1-D operands, batched broadcasting)."""
    return apply(OP_MATMUL, (a, b))


def _install() -> None:
    Tensor.__matmul__ = lambda s, o: apply(OP_MATMUL, (s, o))  # type: ignore[attr-defined,method-assign]
    Tensor.__rmatmul__ = lambda s, o: apply(OP_MATMUL, (o, s))  # type: ignore[attr-defined,method-assign]
    Tensor.matmul = matmul  # type: ignore[attr-defined,method-assign]


_install()
