"""Adamax (``torch.optim.Adamax``, its exact single-tensor update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._optimizer import AdamFamily, fused_update
from ._port_common import grad_term, lerp_, torch_only_flags

__all__ = ["Adamax"]


class Adamax(AdamFamily):
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
        foreach, capturable, differentiable: PyTorch's kernel flags: ``foreach`` is accepted (one fused
            kernel per parameter either way), the other two must be False.
        maximize: Maximize the objective.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0, foreach: bool | None = None, *, maximize: bool = False,
        differentiable: bool = False, capturable: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "maximize": maximize,
                                  **torch_only_flags("Adamax", foreach, capturable, differentiable)})

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        first, (lr, eps, beta1, beta2, wd, maximize) = self._begin_step(p, group, state, "exp_avg", "exp_inf")
        clr = lr / (1 - beta1 ** state["step"])

        def kernel(pa: np.ndarray, ga: np.ndarray, m: np.ndarray, u: np.ndarray) -> None:
            if first:
                m.fill(0)
                u.fill(0)
            d = grad_term(pa, ga, maximize, wd)
            lerp_(m, d, 1 - beta1)
            u *= beta2
            np.maximum(u, np.abs(d) + eps, out=u)
            pa += -clr * (m / u)

        fused_update(p, kernel, g, state["exp_avg"], state["exp_inf"])
