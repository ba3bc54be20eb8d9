"""Adadelta (``torch.optim.Adadelta``, its exact single-tensor update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._optimizer import Optimizer, count_step, fused_update
from ._port_common import grad_term, nonneg, torch_only_flags

__all__ = ["Adadelta"]


class Adadelta(Optimizer):
    """Adadelta: per-parameter steps from running averages of squared gradients and squared updates.

    At each step, as PyTorch computes it::

        g = -g if maximize;  g = g + weight_decay * p
        v = rho * v + (1 - rho) * g * g
        delta = sqrt(u + eps) / sqrt(v + eps) * g
        u = rho * u + (1 - rho) * delta * delta
        p = p - lr * delta

    Args:
        params: Parameters or parameter groups.
        lr: Scales the update (default 1.0).
        rho: Decay of the running averages (default 0.9).
        eps: Added inside the square roots (default 1e-6).
        weight_decay: L2 penalty added to the gradient.
        foreach, capturable, differentiable: PyTorch's kernel flags: ``foreach`` is accepted (one fused
            kernel per parameter either way), the other two must be False.
        maximize: Maximize the objective.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6,
        weight_decay: float = 0, foreach: bool | None = None, *, capturable: bool = False,
        maximize: bool = False, differentiable: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay, "maximize": maximize,
                                  **torch_only_flags("Adadelta", foreach, capturable, differentiable)})

    def _check_group(self, group: dict[str, Any]) -> None:
        nonneg("learning rate", group["lr"])
        if not 0.0 <= group["rho"] <= 1.0:
            raise ValueError(f"Invalid rho value: {group['rho']}")
        nonneg("epsilon value", group["eps"])
        nonneg("weight_decay value", group["weight_decay"])

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr, rho, eps = float(group["lr"]), float(group["rho"]), float(group["eps"])
        wd, maximize = float(group["weight_decay"]), bool(group["maximize"])
        first = count_step(p, state, "square_avg", "acc_delta")

        def kernel(pa: np.ndarray, ga: np.ndarray, v: np.ndarray, u: np.ndarray) -> None:
            if first:
                v.fill(0)
                u.fill(0)
            d = grad_term(pa, ga, maximize, wd)
            v *= rho
            v += (1 - rho) * d * d
            std = np.sqrt(v + eps)
            delta = np.sqrt(u + eps)
            delta /= std
            delta *= d
            u *= rho
            u += (1 - rho) * delta * delta
            pa -= lr * delta

        fused_update(p, kernel, g, state["square_avg"], state["acc_delta"])
