"""Adagrad (PyTorch's exact update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor, no_grad
from ._optimizer import Optimizer, fused_update, state_like
from ._port_common import group_floats, nonneg

__all__ = ["Adagrad"]


class Adagrad(Optimizer):
    """Adagrad (``torch.optim.Adagrad``).

    For each parameter, at step ``t``::

        g = -g if maximize;  g = g + weight_decay * p  (if weight_decay)
        clr = lr / (1 + (t - 1) * lr_decay)
        s = s + g * g
        p = p - clr * g / (sqrt(s) + eps)

    As in PyTorch, the state (``step`` 0 and ``sum`` filled with ``initial_accumulator_value``) is
    created in the constructor for every parameter (so `state_dict` has it before the first step); the
    sum has the parameter's memory layout. One fused in-place kernel per parameter per step.

    Args:
        params: Parameters, named parameters or parameter groups.
        lr: Learning rate.
        lr_decay: Learning-rate decay per step.
        weight_decay: L2 penalty (added to the gradient).
        initial_accumulator_value: Starting value of the sums of squared gradients (the constructor's
            value is used for every group, as in PyTorch).
        eps: Added to the denominator.
        maximize: Maximize the objective.
    """

    _hyper_checks = (
        ("lr", "learning rate"),
        ("lr_decay", "lr_decay value"),
        ("weight_decay", "weight_decay value"),
        ("eps", "epsilon value"),
    )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        nonneg("initial_accumulator_value value", initial_accumulator_value)
        defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "eps": eps,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "maximize": maximize,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, self.state.setdefault(p, {}))

    def _init_state(self, p: Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        s = state_like(p)
        with no_grad():
            s.fill_(float(self.defaults["initial_accumulator_value"]))
        state["sum"] = s

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        if not state:
            self._init_state(p, state)
        lr, lr_decay, eps, wd = group_floats(group, "lr", "lr_decay", "eps", "weight_decay")
        maximize = bool(group["maximize"])
        state["step"] += 1
        clr = lr / (1 + (state["step"] - 1) * lr_decay)

        def kernel(pa: np.ndarray, gr: np.ndarray, s: np.ndarray) -> None:
            d = -gr if maximize else gr
            if wd != 0.0:
                d = d + wd * pa
            s += d * d
            std = np.sqrt(s)
            std += eps
            pa += ((-clr) * d) / std

        fused_update(p, kernel, g, state["sum"])
