"""RAdam (``torch.optim.RAdam``, its exact single-tensor update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._optimizer import AdamFamily, fused_update
from ._port_common import adam_moments_, grad_term, torch_only_flags

__all__ = ["RAdam"]


class RAdam(AdamFamily):
    """RAdam: Adam whose adaptive step is switched on, rectified, once its variance is tractable.

    At step ``t``, as PyTorch computes it::

        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        rho_inf = 2 / (1 - beta2) - 1;  rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)
        if rho_t > 5:  p = p - m / (1 - beta1^t) * lr * sqrt(1 - beta2^t) / (sqrt(v) + eps) * r_t
        else:          p = p - m / (1 - beta1^t) * lr
        r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))

    Args: as `NAdam` without ``momentum_decay``, but ``lr`` defaults to 1e-3.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0, decoupled_weight_decay: bool = False, *,
        foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "decoupled_weight_decay": decoupled_weight_decay, "maximize": maximize,
                                  **torch_only_flags("RAdam", foreach, capturable, differentiable)})

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        first, (lr, eps, beta1, beta2, wd, maximize) = self._begin_step(p, group, state, "exp_avg", "exp_avg_sq")
        decoupled = bool(group["decoupled_weight_decay"])
        step = state["step"]
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bc2
        rect = (((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
                if rho_t > 5.0 else 0.0)

        def kernel(pa: np.ndarray, ga: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
            d = grad_term(pa, ga, maximize, wd, lr, decoupled)
            adam_moments_(m, v, d, beta1, beta2, first)
            corrected = m / bc1
            if rho_t > 5.0:
                sq = np.sqrt(v)
                sq += eps
                pa -= corrected * lr * ((bc2**0.5) / sq) * rect
            else:
                pa -= corrected * lr

        fused_update(p, kernel, g, state["exp_avg"], state["exp_avg_sq"])
