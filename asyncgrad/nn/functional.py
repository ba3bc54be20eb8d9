"""Functional forms of the layers and losses, with ``torch.nn.functional``'s names and signatures.

Thin re-exports of the ops in `asyncgrad.runtime` (each one op with its backward rule), plus
``linear`` (one fused op: ``input @ weight.T + bias``) and wrappers that take PyTorch's argument names.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import ops as _ops
from .. import runtime as _runtime
from ..ops import (
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    avg_pool2d,
    binary_cross_entropy,
    binary_cross_entropy_with_logits,
    conv1d,
    conv2d,
    conv_transpose1d,
    conv_transpose2d,
    cross_entropy,
    dropout,
    embedding,
    group_norm,
    huber_loss,
    interpolate,
    kl_div,
    l1_loss,
    layer_norm,
    linear,
    max_pool2d,
    mse_loss,
    nll_loss,
    scaled_dot_product_attention,
    smooth_l1_loss,
)
from ..ops import gelu as _gelu_op
from ..runtime import Tensor

__all__ = [
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "avg_pool2d",
    "batch_norm",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "conv1d",
    "conv2d",
    "conv_transpose1d",
    "conv_transpose2d",
    "cross_entropy",
    "dropout",
    "elu",
    "embedding",
    "gelu",
    "group_norm",
    "hardtanh",
    "huber_loss",
    "interpolate",
    "kl_div",
    "l1_loss",
    "layer_norm",
    "leaky_relu",
    "linear",
    "log_softmax",
    "max_pool2d",
    "mse_loss",
    "nll_loss",
    "normalize",
    "one_hot",
    "pad",
    "relu",
    "relu6",
    "scaled_dot_product_attention",
    "sigmoid",
    "silu",
    "smooth_l1_loss",
    "softmax",
    "softplus",
    "tanh",
]


# ---- activations and linear --------------------------------------------------------------------


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """``max(input, 0)`` (``inplace`` is accepted for compatibility; the result is a new tensor)."""
    return _ops.relu(input)


def tanh(input: Tensor) -> Tensor:
    """Hyperbolic tangent."""
    return _ops.tanh(input)


def sigmoid(input: Tensor) -> Tensor:
    """Logistic sigmoid."""
    return _ops.sigmoid(input)


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """GELU, exact (erf) by default or with ``approximate="tanh"``."""
    return _gelu_op(input, approximate)


def _softmax_args(name: str, input: Tensor, dim: int | None, dtype: Any) -> tuple[Tensor, int]:
    """``input`` cast to ``dtype`` (if given) and the dim to work along."""
    if dim is None:
        # PyTorch's legacy choice when no dim is given: 0 for 0-, 1- and 3-dim inputs, else 1
        warnings.warn(
            f"{name}() without dim picks a dim the old PyTorch way (0 for 0-, 1- and 3-dim inputs, else 1), "
            "which is deprecated there too; pass dim explicitly",
            UserWarning,
            stacklevel=3,
        )
        dim = 0 if input.ndim in (0, 1, 3) else 1
    if dtype is not None:
        input = input.to(dtype=dtype)
    return input, dim


def softmax(input: Tensor, dim: int | None = None, dtype: Any = None) -> Tensor:
    """Softmax along ``dim`` (without it, PyTorch's deprecated implicit choice, with a warning)."""
    input, dim = _softmax_args("softmax", input, dim, dtype)
    return _ops.softmax(input, dim)


def log_softmax(input: Tensor, dim: int | None = None, dtype: Any = None) -> Tensor:
    """Log-softmax along ``dim``, computed stably (without ``dim``: as `softmax`)."""
    input, dim = _softmax_args("log_softmax", input, dim, dtype)
    return _ops.log_softmax(input, dim)


# ---- more activations (composed of differentiable ops, so second derivatives come for free) ----------


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """``x`` where ``x > 0``, else ``negative_slope * x`` (``inplace`` is accepted; the result is new)."""
    return _ops.where(input > 0, input, input * negative_slope)


def silu(input: Tensor, inplace: bool = False) -> Tensor:
    """``x * sigmoid(x)`` (also called swish)."""
    return input * _ops.sigmoid(input)


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    """``x`` where ``x > 0``, else ``alpha * (exp(x) - 1)``."""
    pos = input > 0
    neg = _ops.where(pos, 0.0, input)  # keeps exp() finite (and its gradient 0) where x > 0
    return _ops.where(pos, input, _ops.expm1(neg) * alpha)


def softplus(input: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """``log(1 + exp(beta * x)) / beta``, and ``x`` itself where ``beta * x > threshold``."""
    bx = input * beta
    lin = bx > threshold
    safe = _ops.where(lin, 0.0, bx)
    return _ops.where(lin, input, _ops.log1p(_ops.exp(safe)) / beta)


def hardtanh(input: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> Tensor:
    """``input`` clamped to ``[min_val, max_val]``; the gradient is 0 outside the open interval (as torch)."""
    if min_val > max_val:
        raise ValueError("min_val cannot be greater than max_val")
    return _ops.where(input <= min_val, min_val, _ops.where(input >= max_val, max_val, input))


def relu6(input: Tensor, inplace: bool = False) -> Tensor:
    """``min(max(x, 0), 6)`` (``hardtanh(x, 0, 6)``)."""
    return hardtanh(input, 0.0, 6.0)


# ---- one_hot, pad, normalize ------------------------------------------------------------------------


def one_hot(tensor: Any, num_classes: int = -1) -> Tensor:
    """One-hot encoding of integer class values: an int64 tensor of shape ``(*tensor.shape, num_classes)``.

    ``num_classes=-1`` uses ``max + 1``. Waits for ``tensor``'s value (it checks the range); not
    differentiable.
    """
    dev: Any
    if isinstance(tensor, Tensor):
        a, dev = tensor._value(), tensor.device
    else:
        a, dev = np.asarray(tensor), "cpu"
    if a.dtype.kind not in "iu":
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if num_classes == -1:
        if a.size == 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        num_classes = int(a.max()) + 1
    if a.size:
        if a.min() < 0:
            raise RuntimeError("Class values must be non-negative.")
        if a.max() >= num_classes:
            raise RuntimeError("Class values must be smaller than num_classes.")
    out = (a[..., None] == np.arange(num_classes)).astype(np.int64)
    return _runtime.tensor(out, dtype=np.int64, device=dev)


def pad(input: Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Tensor:
    """Pad ``input`` (constant mode): ``pad = (left, right)`` for the last dim, then the one before, ...

    Negative amounts crop, as in torch. Differentiable. Only ``mode="constant"`` is supported.
    """
    if mode != "constant":
        raise NotImplementedError(f"pad: mode={mode!r} is not supported (only 'constant')")
    pad = [int(p) for p in pad]
    if len(pad) % 2:
        raise ValueError("Padding length must be divisible by 2")
    if len(pad) // 2 > input.ndim:
        raise ValueError("Padding length should be less than or equal to two times the input dimension")
    fill = 0 if value is None else value
    out = input
    for i in range(len(pad) // 2):
        dim = input.ndim - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        n = out.shape[dim]
        if lo < 0 or hi < 0:  # crop first
            start, stop = max(-lo, 0), n - max(-hi, 0)
            if stop < start:
                raise RuntimeError(f"pad: the padded size of dim {dim} would be negative")
            idx = (slice(None),) * dim + (slice(start, stop),)
            out = out[idx]
        parts = []
        if lo > 0:
            shape = list(out.shape)
            shape[dim] = lo
            parts.append(_runtime.full(tuple(shape), fill, dtype=input.dtype, device=input.device))
        parts.append(out)
        if hi > 0:
            shape = list(out.shape)
            shape[dim] = hi
            parts.append(_runtime.full(tuple(shape), fill, dtype=input.dtype, device=input.device))
        if len(parts) > 1:
            out = _ops.concat(parts, dim)
    return out


def normalize(input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: Any = None) -> Tensor:
    """``input / max(||input||_p, eps)`` along ``dim``."""
    if out is not None:
        raise NotImplementedError("normalize: out= is not supported")
    denom = _ops.clamp_min(_ops.norm(input, p, dim, keepdim=True), eps)
    return input / denom


# ---- batch norm ----------------------------------------------------------------------------------------


def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: Any = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Batch normalisation over the channel dim 1 of ``(N, C, *)`` inputs (``torch.nn.functional.batch_norm``).

    In training, the batch statistics normalise (biased variance) and, when given, ``running_mean`` /
    ``running_var`` are updated in place (in stream order, outside the graph) with
    ``running = (1 - momentum) * running + momentum * batch_stat`` (the unbiased variance for
    ``running_var``). ``momentum`` may be a number or a scalar Tensor. Otherwise the running statistics
    normalise. Built from differentiable ops, so gradients of every order flow to input, weight, bias.
    """
    if input.ndim < 2:
        raise ValueError(f"batch_norm: expected an input of at least 2 dims (N, C, *), got shape {input.shape}")
    c = input.shape[1]
    axes = (0, *range(2, input.ndim))
    bshape = (1, c) + (1,) * (input.ndim - 2)
    for name, v in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        if v is not None and tuple(v.shape) != (c,):
            raise RuntimeError(f"batch_norm: {name} should contain {c} elements not {int(np.prod(v.shape))}")
    if training:
        n = int(np.prod([input.shape[a] for a in axes]))
        if n <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {tuple(input.shape)}"
            )
        mean = _ops.mean(input, axes, keepdim=True)
        var = _ops.var(input, axes, keepdim=True, correction=0)
        if running_mean is not None or running_var is not None:
            with _runtime.no_grad():
                m = momentum
                if running_mean is not None:
                    new = mean.detach().reshape((c,)).to(dtype=running_mean.dtype) * m
                    running_mean.mul_(1 - m).add_(new)
                if running_var is not None:
                    unb = var.detach().reshape((c,)) * (n / (n - 1))
                    running_var.mul_(1 - m).add_(unb.to(dtype=running_var.dtype) * m)
    else:
        if running_mean is None or running_var is None:
            raise RuntimeError("batch_norm: running_mean and running_var must be defined in evaluation mode")
        mean = running_mean.reshape(bshape)
        var = running_var.reshape(bshape)
    out = (input - mean) * _ops.rsqrt(var + eps)
    if weight is not None:
        out = out * weight.reshape(bshape)
    if bias is not None:
        out = out + bias.reshape(bshape)
    return out
