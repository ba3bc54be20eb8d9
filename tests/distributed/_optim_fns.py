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


def mappings_made() -> int:
    """How many fresh mappings `untouched_zeros` made in this process so far."""
    from asyncgrad.runtime import _row_support

    return _row_support.MAPPINGS_MADE[0]
