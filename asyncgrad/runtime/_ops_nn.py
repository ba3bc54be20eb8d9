"""Neural-network ops of the core: softmax and log_softmax (numerically stable)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._dispatch import OpError, apply, defop
from ._tensor import Tensor


def _softmax_kernel(a: np.ndarray, axis: int) -> np.ndarray:
    z = a - np.max(a, axis=axis, keepdims=True)
    e = np.exp(z)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def _log_softmax_kernel(a: np.ndarray, axis: int) -> np.ndarray:
    z = a - np.max(a, axis=axis, keepdims=True)
    z -= np.log(np.sum(np.exp(z), axis=axis, keepdims=True))
    return z


def _meta(a: Tensor, axis: int) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if a._dtype.kind not in "fc":
        raise OpError(f"softmax: input dtype {a._dtype} is not floating point")
    return a._shape, a._dtype


def _softmax_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    ax = kw["axis"]
    return (out * (g - xp.sum(g * out, ax, True)),)


def _log_softmax_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    ax = kw["axis"]
    return (g - xp.exp(out) * xp.sum(g, ax, True),)


OP_SOFTMAX = defop("softmax", _softmax_kernel, _meta, _softmax_rule, save_out=True)
OP_LOG_SOFTMAX = defop("log_softmax", _log_softmax_kernel, _meta, _log_softmax_rule, save_out=True)


def _axis(op: str, x: Tensor, dim: int) -> int:
    n = max(x.ndim, 1)
    if not -n <= dim < n:
        raise OpError(f"{op}: dim {dim} is out of range for shape {x._shape}")
    return dim % n


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """exp(x) normalised along ``dim``."""
    return apply(OP_SOFTMAX, (x,), {"axis": _axis("softmax", x, dim)})


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """log(softmax(x)) along ``dim``, computed stably."""
    return apply(OP_LOG_SOFTMAX, (x,), {"axis": _axis("log_softmax", x, dim)})


Tensor.softmax = softmax  # type: ignore[attr-defined]
Tensor.log_softmax = log_softmax  # type: ignore[attr-defined]
