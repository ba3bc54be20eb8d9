"""Stochastic gradient descent with momentum, dampening, Nesterov momentum and weight decay."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..devices import add_scaled
from ..kernels import sgd_momentum_update
from ..runtime import Tensor, noted_rows, rows_bound
from ._optimizer import Optimizer, fused_update, required, state_like
from ._port_common import grad_term

__all__ = ["SGD"]


class SGD(Optimizer):
    """SGD with PyTorch's exact update (``torch.optim.SGD``).

    For each parameter ``p`` with gradient ``g``::

        g = -g if maximize
        g = g + weight_decay * p                      if weight_decay != 0
        b = g (first step) | momentum * b + (1 - dampening) * g    if momentum != 0
        g = g + momentum * b if nesterov else b       if momentum != 0
        p = p - lr * g

    Each parameter is updated by one fused in-place kernel on the calling task's stream.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default 1e-3, as in PyTorch 2).
        momentum: Momentum factor.
        dampening: Dampening of the momentum.
        weight_decay: L2 penalty.
        nesterov: Use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        maximize: Maximize the objective instead of minimizing it.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        if group["lr"] < 0.0:
            raise ValueError(f"Invalid learning rate: {group['lr']}")
        if group["momentum"] < 0.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']}")
        if group["weight_decay"] < 0.0:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _capture_replay_key(self) -> Any:
        # besides what the guard checks (parameters, .grad None or not, the state's keys and tensors), the
        # kernels depend on the groups' hyperparameters only; a subclass with its own update or step keeps
        # the re-run
        cls = type(self)
        if cls._update is not SGD._update or cls._step is not Optimizer._step or cls.step is not Optimizer.step:
            return None
        return tuple(
            (float(g["lr"]), float(g["momentum"]), float(g["dampening"]), float(g["weight_decay"]),
             bool(g["nesterov"]), bool(g["maximize"]))
            for g in self.param_groups
        )

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr = float(group["lr"])
        momentum = float(group["momentum"])
        dampening = float(group["dampening"])
        wd = float(group["weight_decay"])
        nesterov = bool(group["nesterov"])
        maximize = bool(group["maximize"])
        if momentum == 0.0:
            if wd == 0.0 and not maximize and rows_bound(g):
                # a row-sparse gradient kept dense (an embedding's): step the rows it wrote only; the
                # others would get ``p - lr * 0 == p`` exactly
                def rows_only(pa: np.ndarray, ga: np.ndarray) -> None:
                    rows = noted_rows(ga)
                    if rows is None or pa.ndim == 0:
                        add_scaled(pa, -lr, ga)
                        return
                    # numpy, not BLAS axpy: a few rows are too small for BLAS's threads to pay off
                    part = ga[rows]
                    part *= -lr
                    part += pa[rows]
                    pa[rows] = part

                fused_update(p, rows_only, g)
                return

            if wd == 0.0 and not maximize:
                # (the common case, without grad_term's call: a compiled step replays one such kernel a parameter)
                def plain_sgd(pa: np.ndarray, ga: np.ndarray, alpha: float = -lr) -> None:
                    add_scaled(pa, alpha, ga)

                fused_update(p, plain_sgd, g)
                return

            def plain(pa: np.ndarray, ga: np.ndarray) -> None:
                d = grad_term(pa, ga, maximize, wd)
                add_scaled(pa, -lr, d)  # one pass over memory where BLAS can

            fused_update(p, plain, g)
            return
        buf = state.get("momentum_buffer")
        first = buf is None
        if first:
            buf = state["momentum_buffer"] = state_like(p)

        def with_momentum(pa: np.ndarray, ga: np.ndarray, ba: np.ndarray) -> None:
            sgd_momentum_update(pa, ga, ba, first, maximize, nesterov, lr, momentum, dampening, wd)

        fused_update(p, with_momentum, g, buf)
