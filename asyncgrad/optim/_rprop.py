"""Rprop (``torch.optim.Rprop``, its exact single-tensor update)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor
from ._optimizer import Optimizer, count_step, fused_update
from ._port_common import nonneg, torch_only_flags

__all__ = ["Rprop"]


class Rprop(Optimizer):
    """Resilient backpropagation: per-element step sizes grown or shrunk by the sign of ``g * g_prev``.

    At each step, as PyTorch computes it::

        s = sign(g * prev) -> etaplus where > 0, etaminus where < 0, 1 where 0
        step_size = clamp(step_size * s, *step_sizes);  g = 0 where s == etaminus
        p = p - sign(g) * step_size;  prev = g

    Args:
        params: Parameters or parameter groups.
        lr: Initial step size (default 1e-2).
        etas: ``(etaminus, etaplus)``, with ``0 < etaminus < 1 < etaplus``.
        step_sizes: ``(min, max)`` step sizes.
        foreach, capturable, differentiable: PyTorch's kernel flags: ``foreach`` is accepted (one fused
            kernel per parameter either way), the other two must be False.
        maximize: Maximize the objective.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-2, etas: tuple[float, float] = (0.5, 1.2),
        step_sizes: tuple[float, float] = (1e-6, 50), *, capturable: bool = False,
        foreach: bool | None = None, maximize: bool = False, differentiable: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "etas": tuple(etas), "step_sizes": tuple(step_sizes), "maximize": maximize,
                                  **torch_only_flags("Rprop", foreach, capturable, differentiable)})

    def _check_group(self, group: dict[str, Any]) -> None:
        nonneg("learning rate", group["lr"])
        em, ep = group["etas"]
        if not 0.0 < em < 1.0 < ep:
            raise ValueError(f"Invalid eta values: {em}, {ep}")

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr, maximize = float(group["lr"]), bool(group["maximize"])
        etaminus, etaplus = (float(e) for e in group["etas"])
        smin, smax = (float(s) for s in group["step_sizes"])
        first = count_step(p, state, "prev", "step_size")

        def kernel(pa: np.ndarray, ga: np.ndarray, prev: np.ndarray, ss: np.ndarray) -> None:
            if first:
                prev.fill(0)
                ss.fill(lr)
            d = -ga if maximize else np.array(ga, copy=True)
            sign = np.sign(d * prev)
            sign[sign > 0] = etaplus
            sign[sign < 0] = etaminus
            sign[sign == 0] = 1
            ss *= sign
            np.clip(ss, smin, smax, out=ss)
            d[sign == etaminus] = 0
            pa -= np.sign(d) * ss
            np.copyto(prev, d)

        fused_update(p, kernel, g, state["prev"], state["step_size"])
