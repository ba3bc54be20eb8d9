"""NAdam (``torch.optim.NAdam``, its exact single-tensor update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._optimizer import AdamFamily, fused_update
from ._port_common import (
    adam_moments_,
    grad_term,
    scalar_state,
    scalar_state_mul,
    torch_only_flags,
)

__all__ = ["NAdam"]


class NAdam(AdamFamily):
    """NAdam: Adam with Nesterov momentum and a momentum schedule.

    At step ``t``, as PyTorch computes it::

        mu_t = beta1 * (1 - 0.5 * 0.96^(t * momentum_decay));  prod_t = prod_{t-1} * mu_t
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        denom = sqrt(v / (1 - beta2^t)) + eps
        p = p - lr * (1 - mu_t) / (1 - prod_t) * g / denom - lr * mu_{t+1} / (1 - prod_t * mu_{t+1}) * m / denom

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default 2e-3).
        betas: Decays of the moments.
        eps: Added to the denominator.
        weight_decay: L2 penalty (added to the gradient, or decoupled as AdamW's).
        momentum_decay: The momentum schedule's decay (default 4e-3).
        decoupled_weight_decay: ``p = p * (1 - lr * weight_decay)`` instead of the L2 term.
        foreach, capturable, differentiable: PyTorch's kernel flags: ``foreach`` is accepted (one fused
            kernel per parameter either way), the other two must be False.
        maximize: Maximize the objective.
    """

    _hyper_checks = (*AdamFamily._hyper_checks, ("momentum_decay", "momentum_decay value"))

    def __init__(
        self, params: Iterable[Any], lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0, momentum_decay: float = 4e-3,
        decoupled_weight_decay: bool = False, *, foreach: bool | None = None, maximize: bool = False,
        capturable: bool = False, differentiable: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "momentum_decay": momentum_decay,
                                  "decoupled_weight_decay": decoupled_weight_decay, "maximize": maximize,
                                  **torch_only_flags("NAdam", foreach, capturable, differentiable)})

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        first, (lr, eps, beta1, beta2, wd, maximize) = self._begin_step(
            p, group, state, "exp_avg", "exp_avg_sq", mu_product=scalar_state(1.0)
        )
        decoupled, md = bool(group["decoupled_weight_decay"]), float(group["momentum_decay"])
        step = state["step"]
        bc2 = 1 - beta2**step
        mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * md)))
        mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * md)))
        state["mu_product"] = prod = scalar_state_mul(state["mu_product"], mu)
        c_grad = -lr * (1.0 - mu) / (1.0 - prod)
        c_avg = (-lr * mu_next) / (1.0 - prod * mu_next)

        def kernel(pa: np.ndarray, ga: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
            d = grad_term(pa, ga, maximize, wd, lr, decoupled)
            adam_moments_(m, v, d, beta1, beta2, first)
            denom = np.sqrt(v / bc2)
            denom += eps
            pa += c_grad * (d / denom)
            pa += c_avg * (m / denom)

        fused_update(p, kernel, g, state["exp_avg"], state["exp_avg_sq"])
