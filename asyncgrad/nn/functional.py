"""Functional forms of the layers and losses, with ``torch.nn.functional``'s names and signatures.

Thin re-exports of the ops in `asyncgrad.runtime` (each one op with its backward rule), plus
``linear`` (one fused op: ``input @ weight.T + bias``) and wrappers that take PyTorch's argument names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import runtime as _rt
from ..runtime import (
    OpError,
    Tensor,
    apply,
    avg_pool2d,
    binary_cross_entropy_with_logits,
    conv2d,
    cross_entropy,
    defop,
    dropout,
    embedding,
    layer_norm,
    max_pool2d,
    mse_loss,
    nll_loss,
)
from ..runtime import gelu as _gelu_op

__all__ = [
    "avg_pool2d",
    "binary_cross_entropy_with_logits",
    "conv2d",
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "log_softmax",
    "max_pool2d",
    "mse_loss",
    "nll_loss",
    "relu",
    "sigmoid",
    "softmax",
    "tanh",
]


# ---- activations and linear --------------------------------------------------------------------


def _linear_meta(x: Any, w: Any, b: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise OpError(
            f"linear: input of shape {tuple(x.shape)} and weight of shape {tuple(w.shape)} do not fit: "
            "expected input (*, in_features) and weight (out_features, in_features)"
        )
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise OpError(f"linear: bias of shape {tuple(b.shape)} must be ({w.shape[0]},)")
    dt = np.result_type(x.dtype, w.dtype) if b is None else np.result_type(x.dtype, w.dtype, b.dtype)
    return (*x.shape[:-1], w.shape[0]), dt


def _linear_kernel(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    out = np.matmul(x, w.T)
    if b is not None:
        out += b
    return out


def _linear_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, w, _ = args
    n_out, n_in = w.shape
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    gx = gw = gb = None
    g2 = xp.reshape(g, (rows, n_out))
    if needs[0]:
        gx = xp.matmul(g, w)
    if needs[1]:
        # (out, rows) @ (rows, in): a fresh C-contiguous array, so AccumulateGrad can steal it
        gw = xp.matmul(xp.swapaxes(g2, 0, 1), xp.reshape(x, (rows, n_in)))
    if needs[2]:
        gb = xp.sum(g2, 0)
    return (gx, gw, gb)


OP_LINEAR = defop("linear", _linear_kernel, _linear_meta, _linear_rule)


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weight.T + bias`` as one op (one kernel forward, one fused rule backward).

    Args:
        input: ``(*, in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
    """
    return apply(OP_LINEAR, (input, weight, bias))


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """``max(input, 0)`` (``inplace`` is accepted for compatibility; the result is a new tensor)."""
    return _rt.relu(input)


def tanh(input: Tensor) -> Tensor:
    """Hyperbolic tangent."""
    return _rt.tanh(input)


def sigmoid(input: Tensor) -> Tensor:
    """Logistic sigmoid."""
    return _rt.sigmoid(input)


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """GELU, exact (erf) by default or with ``approximate="tanh"``."""
    return _gelu_op(input, approximate)


def softmax(input: Tensor, dim: int | None = None, dtype: Any = None) -> Tensor:
    """Softmax along ``dim`` (default: the last dim)."""
    if dtype is not None:
        input = input.to(dtype=dtype)
    return _rt.softmax(input, -1 if dim is None else dim)


def log_softmax(input: Tensor, dim: int | None = None, dtype: Any = None) -> Tensor:
    """Log-softmax along ``dim`` (default: the last dim), computed stably."""
    if dtype is not None:
        input = input.to(dtype=dtype)
    return _rt.log_softmax(input, -1 if dim is None else dim)
