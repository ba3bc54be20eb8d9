"""Adam and AdamW (PyTorch's exact formulas, optional AMSGrad)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..kernels import adam_update
from ..runtime import Tensor
from ._optimizer import AdamFamily, fused_update, state_like

__all__ = ["Adam", "AdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
_MOMENTS_AMSGRAD = (*_MOMENTS, "max_exp_avg_sq")


class Adam(AdamFamily):
    """Adam (``torch.optim.Adam``), with L2 ``weight_decay`` added to the gradient.

    For each parameter, at step ``t``::

        g = -g if maximize;  g = g + weight_decay * p  (if weight_decay)
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        v_hat = max(v_hat, v) if amsgrad else v
        p = p - (lr / (1 - beta1^t)) * m / (sqrt(v_hat) / sqrt(1 - beta2^t) + eps)

    One fused in-place kernel per parameter per step, on the calling task's stream; the moment
    estimates have the parameter's memory layout.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Added to the denominator.
        weight_decay: L2 penalty (coupled, added to the gradient).
        amsgrad: Use the AMSGrad variant.
        maximize: Maximize the objective.
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        amsgrad = bool(group["amsgrad"])
        decoupled = self._decoupled
        first, (lr, eps, beta1, beta2, wd, maximize) = self._begin_step(
            p, group, state, *(_MOMENTS_AMSGRAD if amsgrad else _MOMENTS)
        )
        if not first and amsgrad and state.get("max_exp_avg_sq") is None:
            # AMSGrad switched on after the first step: its running maximum starts at zero
            state["max_exp_avg_sq"] = state_like(p)
            state["max_exp_avg_sq"].zero_()
        step = state["step"]
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        step_size = lr / bias_correction1
        bc2_sqrt = math.sqrt(bias_correction2)
        others: list[Tensor] = [g, state["exp_avg"], state["exp_avg_sq"]]
        if amsgrad:
            others.append(state["max_exp_avg_sq"])

        def kernel(pa: np.ndarray, ga: np.ndarray, m: np.ndarray, v: np.ndarray, vmax: Any = None) -> None:
            adam_update(pa, ga, m, v, vmax, first, maximize, decoupled, lr, wd, beta1, beta2, eps, step_size,
                        bc2_sqrt)

        fused_update(p, kernel, *others)


class AdamW(Adam):
    """Adam with decoupled weight decay (``torch.optim.AdamW``): ``p = p * (1 - lr * weight_decay)``
    before the Adam update, instead of adding ``weight_decay * p`` to the gradient.

    Takes `Adam`'s arguments; ``weight_decay`` is the decoupled decay, by default 1e-2.
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
