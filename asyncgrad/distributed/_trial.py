"""The worker side of a population: `Trial`, the handle a training gets, and the call that runs it.

``run_trial`` is what the population calls on a worker (by name, like any call): it imports the training
function, hands it a `Trial` and awaits it as a task of the worker's runtime. Reports and checkpoints go
back to the parent as messages streamed from the running call (`current_call().notify`), so they arrive
as they happen; the result is the call's reply.

The population sends a worker one training more than its limit lets run at once: that one waits here
(`_Slots`) and starts the moment a running one returns, while the finished one's result travels to the
parent, instead of a result, a decision and a call later. A ``STARTED`` message tells the parent when a
training begins (one that never began on a worker that died is placed again).
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import numpy as np
import trio

from .. import runtime
from ._peer import current_call, this_node

REPORT = "report"
CHECKPOINT = "checkpoint"
STARTED = "started"


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


class _Slots:
    """The cores' worth of trainings this worker runs at once (the population's per-worker limit); the
    ones sent beyond it wait here in arrival order. Loop thread only: no lock."""

    def __init__(self) -> None:
        self.used = 0
        self.limit = 0
        self._queue: collections.deque[list[Any]] = collections.deque()  # [cores, event, granted]

    async def acquire(self, cores: int, limit: int) -> None:
        self.limit = limit
        if not self._queue and self.used + cores <= limit:
            self.used += cores
            return
        entry: list[Any] = [cores, trio.Event(), False]
        self._queue.append(entry)
        try:
            await entry[1].wait()
        except BaseException:  # cancelled while waiting: it never runs
            if entry[2]:
                self.release(cores)
            else:
                self._queue.remove(entry)
                self._grant()  # the ones behind it may fit now
            raise

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def release(self, cores: int) -> None:
        self.used -= cores
        self._grant()

    def _grant(self) -> None:
        while self._queue and self.used + self._queue[0][0] <= self.limit:
            entry = self._queue.popleft()
            self.used += entry[0]
            entry[2] = True
            entry[1].set()


_SLOTS: trio.lowlevel.RunVar[_Slots] = trio.lowlevel.RunVar("asyncgrad_trial_slots")


def _slots() -> _Slots:
    try:
        return _SLOTS.get()
    except LookupError:
        slots = _Slots()
        _SLOTS.set(slots)
        return slots


async def run_trial(
    target: str, cfg: Any, restored: Any = None, attempt: int = 0, limit: int = 0, cores: int = 1
) -> Any:
    """Run the training ``target`` (``"module:name"``) on ``cfg`` in this worker; returns its result.

    ``limit``: the cores' worth of trainings this worker runs at once (0: no limit); a training beyond it
    waits for one to return, then tells the parent it started.
    """
    call = current_call.get()
    if call is None:
        raise RuntimeError("run_trial runs as a call from a population, not directly")
    fn = this_node().resolve(target)
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"a population training is an `async def train(trial, cfg)`; {target} is not async")
    slots = _slots() if limit > 0 else None
    if slots is None:
        return await _run(call, fn, cfg, restored, attempt, None)
    if slots.used + cores > limit or slots.waiting:
        # it waits for a running one to return: meanwhile it is no training sharing the device (a stream
        # taken counts as one, and more than one moves the runtime to its shared-device mode)
        call.drop_stream()
    await slots.acquire(cores, limit)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            slots.release(cores)

    try:
        with call.fresh_stream():
            await call.notify([STARTED, None])
            return await _run(call, fn, cfg, restored, attempt, release)
    finally:
        release()


async def _run(call: Any, fn: Any, cfg: Any, restored: Any, attempt: int, release: Any) -> Any:
    async with trio.open_nursery() as nursery:
        trial = Trial(call, restored, attempt, nursery)
        try:
            value = await fn(trial, cfg)
        finally:
            # the next training waiting here starts now, while this one's result goes to the parent
            if release is not None:
                release()
        await trial._flush()
        nursery.cancel_scope.cancel()
    return value
