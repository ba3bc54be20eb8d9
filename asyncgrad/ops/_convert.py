"""Conversions and copies: astype, to_device, clone, contiguous, copy_to_layout, alias (each differentiable)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime import _grad_mode
from ..runtime._dispatch import apply
from ..runtime._grad_mode import no_grad
from ..runtime._layout import empty_like_contract
from ..runtime._node import OpNode
from ..runtime._op import EMPTY, Op, defop
from ..runtime._runtime import current_stream
from ..runtime._tensor import Tensor, share_version
from ..runtime._xp import register_xp


def _same_meta(a: Tensor, **kw: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return a._shape, a._dtype


def _identity_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g,)


OP_CLONE = defop("clone", lambda a: np.copy(a, order="K"), _same_meta, _identity_rule, saves=())


OP_CONTIGUOUS = defop("contiguous", np.ascontiguousarray, _same_meta, _identity_rule, saves=())


def clone(x: Tensor) -> Tensor:
    """A copy with the same strides (differentiable)."""
    return apply(OP_CLONE, (x,))


def contiguous(x: Tensor) -> Tensor:
    """A C-contiguous copy (differentiable)."""
    return apply(OP_CONTIGUOUS, (x,))


def _copy_layout_kernel(a: np.ndarray, like: np.ndarray) -> np.ndarray:

    out = empty_like_contract(like)
    np.copyto(out, a)
    return out


OP_COPY_LAYOUT = defop("copy_to_layout", _copy_layout_kernel, _same_meta, _identity_rule, saves=())


def copy_to_layout(x: Tensor, like: np.ndarray) -> Tensor:
    """A differentiable copy of ``x`` with the layout the gradient contract gives ``like``."""
    return apply(OP_COPY_LAYOUT, (x,), {"like": like})


def _astype_meta(a: Tensor, dtype: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return a._shape, np.dtype(dtype)


def _astype_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (xp.astype(g, args[0].dtype),)


OP_ASTYPE = defop("astype", lambda a, dtype: a.astype(dtype), _astype_meta, _astype_rule, saves=())


def astype(x: Tensor, dtype: Any) -> Tensor:
    """Convert to ``dtype`` (gradient converted back)."""
    return apply(OP_ASTYPE, (x,), {"dtype": np.dtype(dtype)})


def to_device(x: Tensor, dev: Any) -> Tensor:
    """Copy to another device of the same kind (CPU devices share host memory)."""
    data = np.array(x._value(), copy=True, order="K")
    out = Tensor._wrap(data, dev)
    if x._rg:

        if _grad_mode.is_grad_enabled():

            node = OpNode(OP_TO, (x,), EMPTY, current_stream(x._dev))
            out._grad_fn = node
            out._rg = True
    return out


def _to_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    if isinstance(g, Tensor):
        return (to_device(g, args[0]._dev),)
    return (g,)


OP_TO: Op = defop("to", lambda a: a, _same_meta, _to_rule, saves=())


OP_ALIAS = defop("alias", lambda a: a, lambda a: (a._shape, a._dtype))


def alias(x: Tensor, share: bool = True) -> Tensor:
    """A new graph-free tensor object sharing ``x``'s value (used by detach of a pending tensor), and with
    ``share`` its version counter."""

    with no_grad():
        out = apply(OP_ALIAS, (x,))
    if share:
        share_version(x, out)
    return out


register_xp("astype", lambda x, dtype: x.astype(dtype, copy=False), astype)
