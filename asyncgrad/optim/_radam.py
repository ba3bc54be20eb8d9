"""RAdam (``torch.optim.RAdam``, its exact single-tensor update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._adam import _lerp_
from ._adamax import check_betas
from ._optimizer import Optimizer, fused_update, state_like
from ._port_common import check_torch_only_flags, nonneg

__all__ = ["RAdam"]


class RAdam(Optimizer):
    """RAdam: Adam whose adaptive step is switched on, rectified, once its variance is tractable.

    At step ``t``, as PyTorch computes it::

        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        rho_inf = 2 / (1 - beta2) - 1;  rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)
        if rho_t > 5:  p = p - m / (1 - beta1^t) * lr * sqrt(1 - beta2^t) / (sqrt(v) + eps) * r_t
        else:          p = p - m / (1 - beta1^t) * lr
        r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default 1e-3).
        betas: Decays of the moments.
        eps: Added to the denominator.
        weight_decay: L2 penalty (added to the gradient, or decoupled as AdamW's).
        decoupled_weight_decay: ``p = p * (1 - lr * weight_decay)`` instead of the L2 term.
        foreach: Accepted (one fused kernel per parameter either way).
        maximize: Maximize the objective.
        capturable: Must be False.
        differentiable: Must be False.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0, decoupled_weight_decay: bool = False, *,
        foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        check_torch_only_flags("RAdam", capturable=capturable, differentiable=differentiable)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "decoupled_weight_decay": decoupled_weight_decay, "foreach": foreach,
                                  "maximize": maximize, "capturable": False, "differentiable": False})

    def _check_group(self, group: dict[str, Any]) -> None:
        nonneg("learning rate", group["lr"])
        nonneg("epsilon value", group["eps"])
        check_betas(group["betas"])
        nonneg("weight_decay value", group["weight_decay"])

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr, eps = float(group["lr"]), float(group["eps"])
        beta1, beta2 = (float(b) for b in group["betas"])
        wd, maximize = float(group["weight_decay"]), bool(group["maximize"])
        decoupled = bool(group["decoupled_weight_decay"])
        first = "step" not in state
        if first:
            state["step"] = 0
            state["exp_avg"] = state_like(p)
            state["exp_avg_sq"] = state_like(p)
        state["step"] += 1
        step = state["step"]
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bc2
        rect = (((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
                if rho_t > 5.0 else 0.0)

        def kernel(pa: np.ndarray, ga: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
            if first:
                m.fill(0)
                v.fill(0)
            d = -ga if maximize else ga
            if wd != 0:
                if decoupled:
                    pa *= 1 - lr * wd
                else:
                    d = d + wd * pa
            _lerp_(m, d, 1 - beta1)
            v *= beta2
            v += (1 - beta2) * d * d
            corrected = m / bc1
            if rho_t > 5.0:
                sq = np.sqrt(v)
                sq += eps
                pa -= corrected * lr * ((bc2**0.5) / sq) * rect
            else:
                pa -= corrected * lr

        fused_update(p, kernel, g, state["exp_avg"], state["exp_avg_sq"])
