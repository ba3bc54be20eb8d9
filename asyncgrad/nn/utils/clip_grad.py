"""Gradient clipping (``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``), in stream order.

Everything here is tensor work queued on the calling task's stream after the work that produces the
gradients (a backward may still be running on the device): the norms, the clipping coefficient and
the in-place scaling of each ``.grad``. Nothing waits on the host unless ``error_if_nonfinite=True``
(which must read the norm). Gradients are scaled / clamped in place, so they keep their memory layout
(the gradient layout contract).
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

import numpy as np

from ...ops import clamp, isfinite, norm, stack
from ...runtime import Tensor, no_grad, tensor

_P = ParamSpec("_P")
_R = TypeVar("_R")

__all__ = ["clip_grad_norm", "clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm"]


def _tensor_list(tensors: Tensor | Iterable[Tensor]) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


def get_total_norm(
    tensors: Tensor | Iterable[Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """The ``norm_type``-norm of the norms of ``tensors`` (as if they were concatenated), a 0-dim tensor.

    Args:
        tensors: A tensor or an iterable of tensors (usually gradients).
        norm_type: The p of the p-norm; ``inf`` for the largest absolute value.
        error_if_nonfinite: Raise ``RuntimeError`` if the norm is nan or inf (reads the norm: waits for
            it to be computed).
        foreach: Accepted for PyTorch compatibility; there is one implementation.

    Returns:
        The norm, on the first tensor's device (``tensor(0.)`` when there are no tensors).
    """
    ts = _tensor_list(tensors)
    norm_type = float(norm_type)
    if not ts:
        return tensor(0.0)
    with no_grad():
        first = ts[0].device
        norms = [norm(t.detach(), norm_type) for t in ts]
        dtype = np.result_type(*[n.dtype for n in norms])
        norms = [n.to(first, dtype) for n in norms]
        total = norm(stack(norms), norm_type)
    if error_if_nonfinite and not bool(isfinite(total).item()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


def clip_grads_with_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    total_norm: Tensor,
    foreach: bool | None = None,
) -> None:
    """Scale the gradients of ``parameters`` in place by ``min(1, max_norm / (total_norm + 1e-6))``.

    The coefficient is a tensor: no host sync, the scaling is queued in stream order.
    """
    grads = [p.grad for p in _tensor_list(parameters) if p.grad is not None]
    max_norm = float(max_norm)
    if not grads:
        return
    with no_grad():
        coef = clamp(max_norm / (total_norm + 1e-6), max=1.0)
        cache: dict[Any, Tensor] = {}
        for g in grads:
            key = (g.device, g.dtype)
            c = cache.get(key)
            if c is None:
                # cast first, as PyTorch's in-place multiply by a 0-dim tensor computes in the grad's dtype
                c = cache[key] = coef.to(g.device, g.dtype)
            g.mul_(c)


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Clip the gradients of ``parameters`` so that their total norm is at most ``max_norm``.

    The total norm is computed as if all gradients were concatenated into one vector; every gradient
    is multiplied in place by ``min(1, max_norm / (total_norm + 1e-6))``, in stream order after the
    work producing it (no host sync, unless ``error_if_nonfinite``). Gradients keep their layout.

    Args:
        parameters: A tensor or an iterable of tensors whose ``.grad`` is clipped (None grads skipped).
        max_norm: The largest allowed norm.
        norm_type: The p of the p-norm; ``inf`` for the largest absolute value.
        error_if_nonfinite: Raise ``RuntimeError`` if the total norm is nan or inf (reads the norm).
        foreach: Accepted for PyTorch compatibility; there is one implementation.

    Returns:
        The total norm of the gradients before clipping (a 0-dim tensor).
    """
    if isinstance(parameters, Tensor):
        params = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        params = list(parameters)
        if is_generator and not params:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    grads = [p.grad for p in params if p.grad is not None]
    total_norm = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    clip_grads_with_norm_(params, max_norm, total_norm, foreach)
    return total_norm


def _deprecated_alias(fn: Callable[_P, _R], name: str) -> Callable[_P, _R]:
    """``fn`` under its old name ``name``, warning (FutureWarning, as PyTorch) at each call."""

    @functools.wraps(fn)
    def alias(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        warnings.warn(
            f"`asyncgrad.nn.utils.{name}` is now deprecated in favor of `asyncgrad.nn.utils.{fn.__name__}`.",
            FutureWarning,
            stacklevel=2,
        )
        return fn(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = name
    alias.__doc__ = f"Deprecated alias of `{fn.__name__}` (as in PyTorch)."
    return alias


clip_grad_norm = _deprecated_alias(clip_grad_norm_, "clip_grad_norm")


def clip_grad_value_(
    parameters: Tensor | Iterable[Tensor], clip_value: float, foreach: bool | None = None
) -> None:
    """Clamp the gradients of ``parameters`` in place to ``[-clip_value, clip_value]``, in stream order."""
    clip_value = float(clip_value)
    with no_grad():
        for p in _tensor_list(parameters):
            if p.grad is not None:
                p.grad.clamp_(min=-clip_value, max=clip_value)
