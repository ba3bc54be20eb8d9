"""Activation checkpointing: keep only the inputs in forward, recompute in backward.

`checkpoint(fn, *args)` runs ``fn`` without recording a graph. Its backward recomputes ``fn`` under
`enable_grad` and runs a nested (reentrant) pass through the recomputed graph: gradients for the inputs
come back to the outer pass, and gradients for leaves used inside ``fn`` (parameters) are staged into the
outer pass, so they reach `.grad` only if the whole outer pass succeeds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._autograd import nested_grad
from ._function import Function, FunctionCtx
from ._grad_mode import enable_grad, is_grad_enabled
from ._runtime import current_runtime
from ._tensor import Tensor


class _Checkpoint(Function):
    @staticmethod
    def forward(ctx: FunctionCtx, fn: Callable[..., Any], *args: Any) -> Any:
        ctx.fn = fn  # type: ignore[attr-defined]
        ctx.args = args  # type: ignore[attr-defined]
        ctx.save_for_backward(*[a for a in args if isinstance(a, Tensor)])
        return fn(*args)

    @staticmethod
    async def backward(ctx: FunctionCtx, *grads: Any) -> Any:
        saved = iter(ctx.saved_tensors)
        inputs: list[Any] = []
        needs: list[Tensor] = []
        for a in ctx.args:  # type: ignore[attr-defined]
            if isinstance(a, Tensor):
                t = next(saved)
                d = t.detach()  # type: ignore[union-attr]
                if t._rg:  # type: ignore[union-attr]
                    d.requires_grad_(True)
                    needs.append(d)
                inputs.append(d)
            else:
                inputs.append(a)
        with enable_grad():
            out = ctx.fn(*inputs)  # type: ignore[attr-defined]
        outs = list(out) if isinstance(out, tuple) else [out]
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, Tensor) and o._rg and g is not None]
        if not pairs:
            return (None,) * (1 + len(inputs))
        got = await nested_grad([o for o, _ in pairs], [g for _, g in pairs], needs)
        by_input = dict(zip(map(id, needs), got))
        return (None, *[by_input.get(id(d)) if isinstance(d, Tensor) else None for d in inputs])


def checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)`` saving only its inputs; recompute it during backward (reentrant, nestable).

    ``fn`` must be deterministic (it runs once more in backward; random ops would draw again).
    """
    if not callable(fn):
        raise TypeError(f"checkpoint: fn must be callable, got {type(fn).__name__}")
    if is_grad_enabled() and not any(isinstance(a, Tensor) and a._rg for a in args):
        # fn may use parameters even when no input requires grad: a dummy input that does makes the
        # node exist, so those parameters still get their gradients
        dev = next((a._dev for a in args if isinstance(a, Tensor)), None)
        dummy = Tensor._wrap(np.zeros((), np.float32), dev or current_runtime("checkpoint").cpu)
        dummy._rg = True
        return _Checkpoint.apply(lambda _d, *a: fn(*a), dummy, *args)
    return _Checkpoint.apply(fn, *args)
