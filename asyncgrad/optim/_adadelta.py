"""Adadelta (``torch.optim.Adadelta``, its exact single-tensor update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._optimizer import Optimizer, fused_update, state_like
from ._port_common import check_torch_only_flags, nonneg

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
        foreach: Accepted (one fused kernel per parameter either way).
        capturable: Must be False.
        maximize: Maximize the objective.
        differentiable: Must be False.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6,
        weight_decay: float = 0, foreach: bool | None = None, *, capturable: bool = False,
        maximize: bool = False, differentiable: bool = False,
    ) -> None:
        check_torch_only_flags("Adadelta", capturable=capturable, differentiable=differentiable)
        super().__init__(params, {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay,
                                  "foreach": foreach, "maximize": maximize, "capturable": False,
                                  "differentiable": False})

    def _check_group(self, group: dict[str, Any]) -> None:
        nonneg("learning rate", group["lr"])
        if not 0.0 <= group["rho"] <= 1.0:
            raise ValueError(f"Invalid rho value: {group['rho']}")
        nonneg("epsilon value", group["eps"])
        nonneg("weight_decay value", group["weight_decay"])

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr, rho, eps = float(group["lr"]), float(group["rho"]), float(group["eps"])
        wd, maximize = float(group["weight_decay"]), bool(group["maximize"])
        first = "step" not in state
        if first:
            state["step"] = 0
            state["square_avg"] = state_like(p)
            state["acc_delta"] = state_like(p)
        state["step"] += 1

        def kernel(pa: np.ndarray, ga: np.ndarray, v: np.ndarray, u: np.ndarray) -> None:
            if first:
                v.fill(0)
                u.fill(0)
            d = -ga if maximize else ga
            if wd != 0:
                d = d + wd * pa
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
