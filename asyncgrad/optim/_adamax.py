"""Adamax (``torch.optim.Adamax``, its exact single-tensor update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._adam import _lerp_
from ._optimizer import Optimizer, fused_update, state_like
from ._port_common import check_torch_only_flags, nonneg

__all__ = ["Adamax"]


def check_betas(betas: tuple[float, float]) -> None:
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")


class Adamax(Optimizer):
    """Adamax: Adam with the infinity norm in place of the second moment.

    At step ``t``, as PyTorch computes it::

        g = -g if maximize;  g = g + weight_decay * p
        m = lerp(m, g, 1 - beta1);  u = max(beta2 * u, |g| + eps)
        p = p - (lr / (1 - beta1^t)) * m / u

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default 2e-3).
        betas: Decays of the first moment and of the infinity norm.
        eps: Added to ``|g|``.
        weight_decay: L2 penalty added to the gradient.
        foreach: Accepted (one fused kernel per parameter either way).
        maximize: Maximize the objective.
        differentiable: Must be False.
        capturable: Must be False.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0, foreach: bool | None = None, *, maximize: bool = False,
        differentiable: bool = False, capturable: bool = False,
    ) -> None:
        check_torch_only_flags("Adamax", capturable=capturable, differentiable=differentiable)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "foreach": foreach, "maximize": maximize, "differentiable": False,
                                  "capturable": False})

    def _check_group(self, group: dict[str, Any]) -> None:
        nonneg("learning rate", group["lr"])
        nonneg("epsilon value", group["eps"])
        check_betas(group["betas"])
        nonneg("weight_decay value", group["weight_decay"])

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr, eps = float(group["lr"]), float(group["eps"])
        beta1, beta2 = (float(b) for b in group["betas"])
        wd, maximize = float(group["weight_decay"]), bool(group["maximize"])
        first = "step" not in state
        if first:
            state["step"] = 0
            state["exp_avg"] = state_like(p)
            state["exp_inf"] = state_like(p)
        state["step"] += 1
        clr = lr / (1 - beta1 ** state["step"])

        def kernel(pa: np.ndarray, ga: np.ndarray, m: np.ndarray, u: np.ndarray) -> None:
            if first:
                m.fill(0)
                u.fill(0)
            d = -ga if maximize else ga
            if wd != 0:
                d = d + wd * pa
            _lerp_(m, d, 1 - beta1)
            u *= beta2
            np.maximum(u, np.abs(d) + eps, out=u)
            pa += -clr * (m / u)

        fused_update(p, kernel, g, state["exp_avg"], state["exp_inf"])
