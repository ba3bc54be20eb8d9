"""The worker side of a population: `Trial`, the handle a training gets, and the call that runs it.

``run_trial`` is what the population calls on a worker (by name, like any call): it imports the training
function, hands it a `Trial` and awaits it as a task of the worker's runtime. Reports and checkpoints go
back to the parent as messages streamed from the running call (`current_call().notify`), so they arrive
as they happen; the result is the call's reply.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import trio

from .. import runtime
from ._peer import current_call, this_node

REPORT = "report"
CHECKPOINT = "checkpoint"


def _snapshot(state: Any) -> Any:
    """A copy of ``state`` that later in-place updates of the training cannot reach (tensors stay tensors)."""
    if isinstance(state, runtime.Tensor):
        return state.detach().clone()
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_snapshot(v) for v in state)
    return state


class Trial:
    """What a training function ``async def train(trial, cfg)`` gets in the worker.

    ``await trial.report(step=..., **metrics)`` streams a dict to the parent as it happens;
    ``trial.checkpoint(state)`` keeps the latest state (sent to the parent in the background: a retried run
    starts again from it); `restored` is the state of the last checkpoint of an earlier attempt (None on the
    first); `attempt` counts attempts from 0; `worker` is this worker's name.
    """

    def __init__(self, call: Any, restored: Any, attempt: int, nursery: trio.Nursery) -> None:
        self._call = call
        self._nursery = nursery
        self._latest: Any = None
        self._dirty = trio.Event()
        self._sender_started = False
        self.restored = restored
        self.attempt = attempt
        self.worker = this_node().name
        self.reports_sent = 0

    async def report(self, *, step: int | None = None, **metrics: Any) -> None:
        """Stream ``{"step": step, **metrics}`` to the parent (tensors travel as tensors)."""
        rep = dict(metrics)
        if step is not None:
            rep["step"] = step
        await self._call.notify([REPORT, rep])
        self.reports_sent += 1

    def checkpoint(self, state: Any) -> None:
        """Keep ``state`` (a snapshot: tensors are copied) as this run's latest checkpoint.

        It is sent to the parent in the background; only the latest one is kept, so checkpointing every
        step costs one copy, not one message, when the sender is behind.
        """
        self._latest = _snapshot(state)
        self._dirty.set()
        if not self._sender_started:
            self._sender_started = True
            self._nursery.start_soon(self._send_checkpoints)

    async def _send_checkpoints(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            state, self._latest = self._latest, None
            await self._call.notify([CHECKPOINT, state])

    async def _flush(self) -> None:
        """The last checkpoint reaches the parent before the result does."""
        if self._latest is not None:
            state, self._latest = self._latest, None
            await self._call.notify([CHECKPOINT, state])


async def run_trial(target: str, cfg: Any, restored: Any = None, attempt: int = 0) -> Any:
    """Run the training ``target`` (``"module:name"``) on ``cfg`` in this worker; returns its result."""
    call = current_call.get()
    if call is None:
        raise RuntimeError("run_trial runs as a call from a population, not directly")
    fn = this_node().resolve(target)
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"a population training is an `async def train(trial, cfg)`; {target} is not async")
    async with trio.open_nursery() as nursery:
        trial = Trial(call, restored, attempt, nursery)
        value = await fn(trial, cfg)
        await trial._flush()
        nursery.cancel_scope.cancel()
    return value
