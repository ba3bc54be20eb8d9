"""RMSprop (PyTorch's exact update, optional momentum and centering)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._optimizer import Optimizer, count_step, fused_update, state_like
from ._port_common import group_floats, lerp_

__all__ = ["RMSprop"]


class RMSprop(Optimizer):
    """RMSprop (``torch.optim.RMSprop``).

    For each parameter, with gradient ``g``::

        g = -g if maximize;  g = g + weight_decay * p  (if weight_decay)
        v = alpha * v + (1 - alpha) * g * g
        avg = sqrt(v - m * m) + eps   with  m = lerp(m, g, 1 - alpha)   if centered
        avg = sqrt(v) + eps                                             otherwise
        b = momentum * b + g / avg;  p = p - lr * b                     if momentum > 0
        p = p - lr * g / avg                                            otherwise

    The state (``square_avg``, ``grad_avg`` if centered, ``momentum_buffer`` if momentum > 0) starts at
    zero and has the parameter's memory layout; one fused in-place kernel per parameter per step, on the
    calling task's stream, evaluated in PyTorch's order so float64 results match it bit for bit.

    Args:
        params: Parameters, named parameters or parameter groups.
        lr: Learning rate.
        alpha: Smoothing constant of the squared-gradient average.
        eps: Added to the denominator.
        weight_decay: L2 penalty (added to the gradient).
        momentum: Momentum factor.
        centered: Normalize by an estimate of the gradient's variance instead of its second moment.
        maximize: Maximize the objective.
    """

    _hyper_checks = (
        ("lr", "learning rate"),
        ("eps", "epsilon value"),
        ("momentum", "momentum value"),
        ("weight_decay", "weight_decay value"),
        ("alpha", "alpha value"),
    )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "alpha": alpha,
            "eps": eps,
            "centered": centered,
            "weight_decay": weight_decay,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr, alpha, eps, wd, momentum = group_floats(group, "lr", "alpha", "eps", "weight_decay", "momentum")
        centered = bool(group["centered"])
        maximize = bool(group["maximize"])
        fresh: set[str] = set()
        if count_step(p, state, "square_avg"):
            fresh.add("square_avg")
        # buffers a group gains later (momentum / centered switched on) start at zero, as PyTorch's would
        # be created with the state; PyTorch raises KeyError there, this keeps going
        if momentum > 0 and state.get("momentum_buffer") is None:
            state["momentum_buffer"] = state_like(p)
            fresh.add("momentum_buffer")
        if centered and state.get("grad_avg") is None:
            state["grad_avg"] = state_like(p)
            fresh.add("grad_avg")
        sq_t: Tensor = state["square_avg"]
        ga_t: Tensor | None = state["grad_avg"] if centered else None
        buf_t: Tensor | None = state["momentum_buffer"] if momentum > 0 else None
        zero_sq = "square_avg" in fresh
        zero_ga = "grad_avg" in fresh
        zero_buf = "momentum_buffer" in fresh

        def kernel(pa: np.ndarray, gr: np.ndarray, sq: np.ndarray, *rest: np.ndarray) -> None:
            it = iter(rest)
            gavg = next(it) if centered else None
            buf = next(it) if momentum > 0 else None
            if zero_sq:
                sq.fill(0)
            if gavg is not None and zero_ga:
                gavg.fill(0)
            if buf is not None and zero_buf:
                buf.fill(0)
            d = -gr if maximize else gr
            if wd != 0.0:
                d = d + wd * pa
            sq *= alpha
            sq += ((1.0 - alpha) * d) * d
            if gavg is not None:
                lerp_(gavg, d, 1.0 - alpha)
                avg = sq - gavg * gavg
                np.sqrt(avg, out=avg)
            else:
                avg = np.sqrt(sq)
            avg += eps
            if buf is not None:
                buf *= momentum
                buf += d / avg
                pa += (-lr) * buf
            else:
                pa += ((-lr) * d) / avg

        others: list[Tensor] = [g, sq_t]
        if ga_t is not None:
            others.append(ga_t)
        if buf_t is not None:
            others.append(buf_t)
        fused_update(p, kernel, *others)
