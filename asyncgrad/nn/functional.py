"""Functional forms of the layers and losses, with ``torch.nn.functional``'s names and signatures.

These are thin re-exports of the ops in `asyncgrad.runtime`. Where the runtime does not (yet) define an
op, a composite of the core ops with the same signature and semantics stands in for it, so code written
against this module keeps working whichever ops the runtime ships.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import runtime as _rt
from ..runtime import OpError, Tensor, apply, defop
from ..runtime._ops_act import gelu as _gelu_op

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


def _from_runtime(name: str, fallback: Callable[..., Any]) -> Callable[..., Any]:
    """The runtime's op called ``name`` if it has one, else ``fallback`` (same signature)."""
    f = getattr(_rt, name, None)
    return f if callable(f) else fallback


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction (use 'mean', 'sum' or 'none')")


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    _check_reduction(reduction)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


def _np_target(target: Any) -> np.ndarray:
    return target.numpy() if isinstance(target, Tensor) else np.asarray(target)


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


# ---- composites used until the runtime ships the op --------------------------------------------


def _dropout_composite(
    input: Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    generator: np.random.Generator | None = None,
) -> Tensor:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input * 0.0
    g = generator if generator is not None else _rt.default_generator()
    mask = (g.random(input.shape) >= p).astype(input.dtype) * np.asarray(1.0 / (1.0 - p), input.dtype)
    return input * mask


def _layer_norm_composite(
    input: Tensor,
    normalized_shape: Sequence[int] | int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(input.shape[-len(ns) :]) != ns:
        raise ValueError(f"layer_norm: input shape {input.shape} does not end with normalized_shape {ns}")
    axes = tuple(range(input.ndim - len(ns), input.ndim))
    mu = input.mean(axes, keepdim=True)
    xc = input - mu
    var = (xc * xc).mean(axes, keepdim=True)
    y = xc / _rt.sqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _embedding_composite(
    input: Any,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError("embedding: max_norm, scale_grad_by_freq and sparse are not supported")
    idx = _np_target(input)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"embedding: indices must be integers, got dtype {idx.dtype}")
    out = weight[idx]
    if padding_idx is not None and weight.requires_grad:
        # no gradient flows to the padding row: route its lookups through a detached copy
        pad = padding_idx % weight.shape[0]
        keep = (idx != pad)[..., None].astype(weight.dtype)
        out = out * keep + weight.detach()[idx] * (1 - keep)
    return out


def _pick_log_probs(logp: Tensor, target: np.ndarray) -> Tensor:
    """``logp[n, target[n], d...]`` for (N, C, d...) log-probabilities and (N, d...) targets."""
    n = logp.shape[0]
    if logp.ndim == 2:
        return logp[np.arange(n), target]
    rest = [
        np.arange(s).reshape((1,) * (i + 1) + (s,) + (1,) * (target.ndim - 2 - i))
        for i, s in enumerate(target.shape[1:])
    ]
    return logp[(np.arange(n).reshape((n,) + (1,) * (target.ndim - 1)), target, *rest)]


def _nll_loss_composite(
    input: Tensor,
    target: Any,
    weight: Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
) -> Tensor:
    _check_reduction(reduction)
    t = _np_target(target).astype(np.int64, copy=False)
    if input.ndim == 1:
        input = input.unsqueeze(0)
        t = t.reshape(1)
    mask = t != ignore_index
    safe = np.where(mask, t, 0)
    c = input.shape[1]
    if safe.size and (safe.min() < 0 or safe.max() >= c):
        raise IndexError(f"nll_loss: target values must be in [0, {c}) or ignore_index, got {np.unique(t)}")
    picked = _pick_log_probs(input, safe)
    w = np.where(mask, 1.0, 0.0).astype(input.dtype)
    if weight is not None:
        w = w * _np_target(weight).astype(input.dtype)[safe]
    loss = -picked * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / float(w.sum())


def _cross_entropy_composite(
    input: Tensor,
    target: Any,
    weight: Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    _check_reduction(reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    class_dim = 0 if input.ndim == 1 else 1
    logp = _rt.log_softmax(input, class_dim)
    c = input.shape[class_dim]
    tarr = target if isinstance(target, Tensor) else np.asarray(target)
    if tarr.dtype.kind == "f":  # class probabilities
        probs = tarr
        if label_smoothing > 0:
            probs = probs * (1 - label_smoothing) + label_smoothing / c
        wshape = [1] * input.ndim
        wshape[class_dim] = c
        terms = logp * probs
        if weight is not None:
            terms = terms * _np_target(weight).astype(input.dtype).reshape(wshape)
        return _reduce(-terms.sum(class_dim), reduction)
    nll = _nll_loss_composite(logp, tarr, weight, ignore_index=ignore_index, reduction=reduction)
    if label_smoothing == 0.0:
        return nll
    t = _np_target(tarr).astype(np.int64, copy=False)
    if logp.ndim == 1:
        logp = logp.unsqueeze(0)
        t = t.reshape(1)
    mask = (t != ignore_index).astype(input.dtype)
    wshape = [1] * logp.ndim
    wshape[1] = c
    terms = logp
    if weight is not None:
        terms = terms * _np_target(weight).astype(input.dtype).reshape(wshape)
    mshape = list(mask.shape)
    mshape.insert(1, 1)
    smooth = -(terms * mask.reshape(mshape)).sum(1)
    if reduction == "none":
        smooth_r = smooth
    elif reduction == "sum":
        smooth_r = smooth.sum()
    else:
        safe = np.where(t != ignore_index, t, 0)
        denom = (
            float((_np_target(weight).astype(np.float64)[safe] * mask).sum())
            if weight is not None
            else float(mask.sum())
        )
        smooth_r = smooth.sum() / denom
    return nll * (1 - label_smoothing) + smooth_r * (label_smoothing / c)


def _mse_loss_composite(
    input: Tensor, target: Any, size_average: Any = None, reduce: Any = None, reduction: str = "mean"
) -> Tensor:
    d = input - target
    return _reduce(d * d, reduction)


def _bce_with_logits_composite(
    input: Tensor,
    target: Any,
    weight: Any = None,
    size_average: Any = None,
    reduce: Any = None,
    reduction: str = "mean",
    pos_weight: Any = None,
) -> Tensor:
    # stable form: (1 - y) x + (1 + (pw - 1) y) * (log(1 + exp(-|x|)) + max(-x, 0))
    softplus_neg = _rt.log(_rt.exp(-_rt.abs(input)) + 1.0) + _rt.relu(-input)
    if pos_weight is None:
        loss = (1 - target) * input + softplus_neg
    else:
        lw = (pos_weight - 1) * target + 1
        loss = (1 - target) * input + lw * softplus_neg
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


def _missing(name: str) -> Callable[..., Any]:
    def f(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"asyncgrad.nn.functional.{name}: this asyncgrad build has no {name} op in asyncgrad.runtime"
        )

    f.__name__ = name
    return f


dropout = _from_runtime("dropout", _dropout_composite)
layer_norm = _from_runtime("layer_norm", _layer_norm_composite)
embedding = _from_runtime("embedding", _embedding_composite)
nll_loss = _from_runtime("nll_loss", _nll_loss_composite)
cross_entropy = _from_runtime("cross_entropy", _cross_entropy_composite)
mse_loss = _from_runtime("mse_loss", _mse_loss_composite)
binary_cross_entropy_with_logits = _from_runtime(
    "binary_cross_entropy_with_logits", _bce_with_logits_composite
)
conv2d = _from_runtime("conv2d", _missing("conv2d"))
max_pool2d = _from_runtime("max_pool2d", _missing("max_pool2d"))
avg_pool2d = _from_runtime("avg_pool2d", _missing("avg_pool2d"))
