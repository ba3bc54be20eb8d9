"""Helpers of test_dist_optim: optimizers that fail in ``zero_grad`` or ``step`` on the worker."""

from __future__ import annotations

from typing import Any

import asyncgrad as ag


class BadZero(ag.optim.SGD):
    """SGD whose ``zero_grad`` raises."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise ValueError("zero_grad boom on the worker")


def grad_is_none(layer: Any) -> bool:
    return all(p.grad is None for p in layer.parameters())


class BadStep(ag.optim.SGD):
    """SGD whose ``step`` raises."""

    def step(self, closure: Any = None) -> Any:
        raise ValueError("step boom on the worker")
