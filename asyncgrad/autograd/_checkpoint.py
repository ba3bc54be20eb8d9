"""Activation checkpointing: keep only the inputs in forward, recompute in backward.

`checkpoint(fn, *args)` runs ``fn`` without recording a graph. Its backward recomputes ``fn`` under
`enable_grad` and runs a nested (reentrant) pass through the recomputed graph: gradients for the inputs
come back to the outer pass, and gradients for leaves used inside ``fn`` (parameters) are staged into the
outer pass, so they reach `.grad` only if the whole outer pass succeeds.

With ``preserve_rng_state=True`` (the default, as in PyTorch) the forward snapshots the default generator
it draws from, and the recompute runs from that snapshot (so dropout inside draws the same masks) and then
puts the generator back: backward does not advance the caller's random stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..runtime._factories import default_generator, fork_default_generator
from ..runtime._grad_mode import enable_grad, is_grad_enabled
from ..runtime._runtime import current_runtime
from ..runtime._tensor import Tensor
from ._api import nested_grad
from ._function import Function, FunctionCtx


class _Checkpoint(Function):
    @staticmethod
    def forward(ctx: FunctionCtx, fn: Callable[..., Any], preserve: bool, *args: Any) -> Any:
        ctx.fn = fn  # type: ignore[attr-defined]
        ctx.args = args  # type: ignore[attr-defined]
        ctx.save_for_backward(*[a for a in args if isinstance(a, Tensor)])
        if preserve:
            # the generator object itself: the recompute may run where another one is this thread's default
            gen = default_generator()
            ctx.rng = (gen, gen.bit_generator.state)  # type: ignore[attr-defined]
        else:
            ctx.rng = None  # type: ignore[attr-defined]
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
        rng = ctx.rng  # type: ignore[attr-defined]
        with enable_grad():
            if rng is None:
                out = ctx.fn(*inputs)  # type: ignore[attr-defined]
            else:
                with fork_default_generator(*rng):  # fn is plain code: no other task runs meanwhile
                    out = ctx.fn(*inputs)  # type: ignore[attr-defined]
        outs = list(out) if isinstance(out, tuple) else [out]
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, Tensor) and o._rg and g is not None]
        if not pairs:
            return (None, None, *[None] * len(inputs))
        got = await nested_grad([o for o, _ in pairs], [g for _, g in pairs], needs)
        by_input = dict(zip(map(id, needs), got))
        return (None, None, *[by_input.get(id(d)) if isinstance(d, Tensor) else None for d in inputs])


def checkpoint(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    """Call ``fn(*args)`` saving only its inputs; recompute it during backward (reentrant, nestable).

    Args:
        fn: The function to run; it runs once more in backward, so it must compute the same values again
            from the same inputs and random numbers.
        preserve_rng_state: Snapshot the default generator (`default_generator`, what dropout/randn/rand
            draw from when given no generator) in forward, and recompute from that snapshot, so that random
            ops inside draw the same numbers as in forward; afterwards the generator is put back, so
            backward does not advance the caller's stream (PyTorch's semantics). With False, the recompute
            draws fresh numbers from the generator's current state and advances it: use it only when ``fn``
            draws no random numbers (it saves the snapshot). Like PyTorch, only the default generator is
            preserved: a ``generator=`` passed explicitly to an op inside ``fn`` is not.
    """
    if not callable(fn):
        raise TypeError(f"checkpoint: fn must be callable, got {type(fn).__name__}")
    # no backward will run when grad mode is off: nothing to snapshot
    preserve = bool(preserve_rng_state) and is_grad_enabled()
    if is_grad_enabled() and not any(isinstance(a, Tensor) and a._rg for a in args):
        # fn may use parameters even when no input requires grad: a dummy input that does makes the
        # node exist, so those parameters still get their gradients
        dev = next((a._dev for a in args if isinstance(a, Tensor)), None)
        dummy = Tensor._wrap(np.zeros((), np.float32), dev or current_runtime("checkpoint").cpu)
        dummy._rg = True
        return _Checkpoint.apply(lambda _d, *a: fn(*a), preserve, dummy, *args)
    return _Checkpoint.apply(fn, preserve, *args)
