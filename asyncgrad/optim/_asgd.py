"""ASGD (``torch.optim.ASGD``, its exact single-tensor update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._optimizer import Optimizer, count_step, fused_update
from ._port_common import grad_term, scalar_state, torch_only_flags

__all__ = ["ASGD"]


class ASGD(Optimizer):
    """Averaged SGD: SGD with a decaying step and a running average ``ax`` of the parameters.

    At step ``t``, as PyTorch computes it::

        p = p * (1 - lambd * eta) - eta * g
        ax = ax + (p - ax) * mu   (ax = p while mu == 1)
        eta = lr / (1 + lambd * lr * t)^alpha;  mu = 1 / max(1, t - t0)

    ``eta`` and ``mu`` are kept as PyTorch keeps them: rounded to float32 unless the default dtype is
    float64.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default 1e-2).
        lambd: Decay term (default 1e-4).
        alpha: Power of the step decay (default 0.75).
        t0: Step at which averaging starts (default 1e6).
        weight_decay: L2 penalty added to the gradient.
        foreach, capturable, differentiable: PyTorch's kernel flags: ``foreach`` is accepted (one fused
            kernel per parameter either way), the other two must be False.
        maximize: Maximize the objective.
    """

    _hyper_checks = (("lr", "learning rate"), ("weight_decay", "weight_decay value"))

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-2, lambd: float = 1e-4, alpha: float = 0.75,
        t0: float = 1e6, weight_decay: float = 0, foreach: bool | None = None, *, maximize: bool = False,
        differentiable: bool = False, capturable: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "lambd": lambd, "alpha": alpha, "t0": t0,
                                  "weight_decay": weight_decay, "maximize": maximize,
                                  **torch_only_flags("ASGD", foreach, capturable, differentiable)})

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr, lambd, alpha, t0 = (float(group[k]) for k in ("lr", "lambd", "alpha", "t0"))
        wd, maximize = float(group["weight_decay"]), bool(group["maximize"])
        first = count_step(p, state, "ax", eta=scalar_state(lr), mu=scalar_state(1.0))
        step = state["step"]
        eta, mu = state["eta"], state["mu"]

        def kernel(pa: np.ndarray, ga: np.ndarray, ax: np.ndarray) -> None:
            if first:
                ax.fill(0)
            d = grad_term(pa, ga, maximize, wd)
            pa *= 1 - lambd * eta
            pa += -eta * d
            if mu != 1:
                ax += (pa - ax) * mu
            else:
                np.copyto(ax, pa)

        fused_update(p, kernel, g, state["ax"])
        state["eta"] = scalar_state(lr / ((1 + lambd * lr * step) ** alpha))
        state["mu"] = scalar_state(1 / max(1, step - t0))
