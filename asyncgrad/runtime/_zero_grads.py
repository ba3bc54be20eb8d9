"""Resetting the ``.grad`` of many tensors: what ``Module.zero_grad`` and ``Optimizer.zero_grad`` share."""

from __future__ import annotations

from collections.abc import Iterable

from ._grad_mode import no_grad
from ._tensor import Tensor


def zero_grads(params: Iterable[Tensor], set_to_none: bool = True) -> None:
    """Reset the gradient of each of ``params`` that has one.

    Args:
        params: The tensors.
        set_to_none: Set ``.grad`` to None instead of filling it with zeros (which runs in stream order,
            after the work that produced the gradient).
    """
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            with no_grad():
                p.grad.detach_().zero_()
