"""`open_population`: many trainings scheduled over worker processes (each an asyncgrad runtime).

CPython's GIL serialises the Python of every training in one process, so many small trainings do not
scale with threads; worker processes do. The population places each training on the least-loaded worker
(at most ``max_concurrent`` trainings per worker core at once), streams its reports back as they happen,
keeps its latest checkpoint in the parent, and, when a worker dies, fails only that worker's runs (or
restarts them from their checkpoints when ``max_retries`` allows) and starts a replacement worker.

A full worker also takes one training more, which waits in the worker (`_trial`) and starts there as
soon as a running one returns: the worker's core does not sit idle while a result travels to the parent
and the next call comes back (~1.3 ms per training on W3, measured between one training's end and the
next one's start on a worker). A run that waited on a worker that died never ran: it is placed again
without using an attempt.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ..actors import read_record
from ..runtime import NoRuntimeError, current_runtime
from ._errors import WorkerDied, WorkersClosed
from ._peer import target_of
from ._ray import ray_session
from ._trial import CHECKPOINT, REPORT, STARTED
from ._workers import LocalLauncher, Worker, Workers, open_workers

# Trainings per worker core at once. Measured on W3's 32 trainings through 2 workers on 2 cores (seconds,
# 3 interleaved rounds, a loaded machine): max_concurrent 1: 2.65 1.28 1.64; 2: 2.04 1.40 2.73;
# 4: 1.54 1.62 2.08; 8: 1.74 2.05 2.01. One per core is as fast as any and the least noisy, and it is
# what the cause predicts: a second training in a worker only adds GIL hand-offs between the loop and
# the lanes, while the gap it would hide (a reply and the next call, ~1 ms) is <2% of a small training.
DEFAULT_MAX_CONCURRENT = 1

_RUN_TRIAL = "asyncgrad.distributed._trial:run_trial"
# times a run that waited on a worker that died (and never ran) is placed again before it fails
_MAX_REQUEUES = 3


class RunCancelled(RuntimeError):
    """Raised by `Run.result` for a run cancelled with `Run.cancel` (or by the population closing)."""


@attrs.frozen
class _Limits:
    """What `open_population` was asked to allow: trainings at once per worker core, restarts of a run
    whose worker died, and the seconds a worker (also a replacement) gets to start."""

    max_concurrent: int
    max_retries: int
    start_timeout: float


@attrs.frozen
class Result:
    """One finished run, as `Population.map` yields it: ``value`` or ``error`` (the other is None)."""

    index: int
    config: Any
    value: Any
    error: BaseException | None
    worker: str | None
    attempts: int


@attrs.frozen
class PopulationStatistics:
    """Counters of a population: its live workers and what its runs did."""

    workers: tuple[str, ...]
    load: dict[str, int]
    running: int
    waiting: int
    finished: int
    failed: int
    cancelled: int
    retried: int
    workers_replaced: int
    # cores' worth of runs placed on a worker and waiting there for one of its runs to return
    queued: int = 0


class Run:
    """A training started with `Population.start`.

    ``async for rep in run.reports()`` yields its reports (dicts) from the first, as they arrive: they are
    kept per run, so a run nobody reads never blocks its training. ``await run.result()`` returns the
    training's value or raises its error (`WorkerDied`, `RunCancelled`, or what the training raised).
    """

    def __init__(self, index: int, config: Any, target: str, cores: int) -> None:
        self.index = index
        self.config = config
        self.target = target
        self.cores = cores
        self.worker: str | None = None
        self.attempts = 0
        self._reports: list[dict[str, Any]] = []
        self._report_times: list[float] = []
        self._new = trio.Event()
        self._done = trio.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._checkpoint: Any = None
        self._scope: trio.CancelScope | None = None  # one per attempt (a scope is entered once)
        self._cancel_requested = False
        self._started = False  # this attempt began on its worker (it may wait there first)
        self._requeued = 0  # times it was placed again after waiting on a worker that died

    def __repr__(self) -> str:
        state = "done" if self._done.is_set() else "running"
        return f"<Run {self.index} {self.target} on {self.worker} {state}>"

    # ---- reading ----------------------------------------------------------------------------------

    async def reports(self) -> AsyncIterator[dict[str, Any]]:
        """Every report of this run, from the first, as they arrive; ends when the run ends."""
        i = 0
        while True:
            while i < len(self._reports):
                yield self._reports[i]
                i += 1
            if self._done.is_set():
                return
            await self._new.wait()

    def reports_nowait(self) -> list[dict[str, Any]]:
        """The reports received so far."""
        return list(self._reports)

    @property
    def report_times(self) -> list[float]:
        """When each report arrived in the parent (`trio.current_time()`)."""
        return list(self._report_times)

    @property
    def last_checkpoint(self) -> Any:
        """The latest checkpoint the training sent (None before the first)."""
        return self._checkpoint

    def done(self) -> bool:
        return self._done.is_set()

    async def result(self) -> Any:
        """Wait for the run to end; its value, or raises its error."""
        await self._done.wait()
        return self.result_nowait()

    def result_nowait(self) -> Any:
        """Its value, or raises its error; `trio.WouldBlock` while it runs."""
        if not self._done.is_set():
            raise trio.WouldBlock
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self) -> None:
        """Cancel this run (the training sees `trio.Cancelled` in its worker); `result` raises `RunCancelled`.
        Its worker and the other runs carry on."""
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    def _new_scope(self) -> trio.CancelScope:
        self._scope = trio.CancelScope()
        if self._cancel_requested:
            self._scope.cancel()
        return self._scope

    # ---- fed by the population -------------------------------------------------------------------

    def _on_notify(self, msg: Any) -> None:
        if not isinstance(msg, list) or len(msg) != 2:
            return
        kind, body = msg
        if kind == REPORT and isinstance(body, dict):
            self._reports.append(body)
            self._report_times.append(trio.current_time())
            self._new.set()
            self._new = trio.Event()
        elif kind == CHECKPOINT:
            self._checkpoint = body

    def _finish(self, value: Any, error: BaseException | None) -> None:
        if self._done.is_set():
            return
        self._value, self._error = value, error
        self._done.set()
        self._new.set()


class Population:
    """The scheduler `open_population` yields: `start`, `map`, `statistics`."""

    def __init__(self, workers: Workers, nursery: trio.Nursery, limits: _Limits, cores_per_worker: int) -> None:
        self._ws = workers
        self._nursery = nursery
        self._limits = limits
        self._cores = cores_per_worker
        self._live: list[Worker] = list(workers)
        self._load: dict[str, int] = {w.name: 0 for w in self._live}
        self._changed = trio.Event()
        self._replacing = trio.Lock()
        self._ids = 0
        self._waiting = 0
        self._running = 0  # cores' worth of runs started on their workers and not ended
        self._finished = self._failed = self._cancelled = self._retried = self._replaced = 0
        self._closed = False

    @property
    def workers(self) -> list[Worker]:
        """The live workers."""
        return list(self._live)

    @property
    def capacity(self) -> int:
        """Cores' worth of trainings one worker runs at once."""
        return self._limits.max_concurrent * self._cores

    def statistics(self) -> PopulationStatistics:
        workers = tuple(w.name for w in self._live)
        load = dict(self._load)
        return read_record(
            PopulationStatistics, self, workers=workers, load=load, workers_replaced=self._replaced,
            queued=max(0, sum(load.values()) - self._running),
        )

    # ---- starting runs ----------------------------------------------------------------------------

    async def start(self, train: Any, config: Any, *, cores: int | None = None) -> Run:
        """Start ``train(trial, config)`` on the least-loaded worker with room; returns its `Run`.

        ``train`` is a module-level ``async def train(trial, cfg)`` (sent by name). A worker whose runs fill
        its limit takes one more, which waits there and starts as one of them returns; `start` waits while
        every worker is full and has one waiting. ``cores`` (default 1) is how many of a worker's cores the
        training counts for.
        """
        if self._closed:
            raise WorkersClosed("the population is closed")
        target = target_of(train)
        c = self._check_cores(target, cores)
        run = Run(self._ids, config, target, c)
        self._ids += 1
        w = await self._place(c)
        self._nursery.start_soon(self._drive, run, w)
        return run

    def _check_cores(self, target: str, cores: int | None) -> int:
        c = 1 if cores is None else cores
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"cores must be a positive int, got {cores!r}")
        if c > self._cores:
            raise ValueError(
                f"a training of {target} asks for cores={c} but each worker has {self._cores} core(s); "
                f"open the population with fewer workers, or ask for fewer cores"
            )
        return c

    async def map(self, train: Any, configs: Iterable[Any], *, cores: int | None = None) -> AsyncIterator[Result]:
        """Run ``train`` on every config; yields a `Result` per run as it finishes (not in order).

        Leaving the loop early cancels the runs not finished yet.
        """
        self._check_cores(target_of(train), cores)  # bad arguments raise here, not in a background task
        cfgs = list(configs)
        send, recv = trio.open_memory_channel[Result](math.inf)
        runs: list[Run] = []
        feeder = trio.CancelScope()
        self._nursery.start_soon(self._feed, train, cfgs, cores, send, runs, feeder)
        try:
            async with recv:
                async for res in recv:
                    yield res
        finally:
            feeder.cancel()
            for r in runs:
                r.cancel()

    async def _feed(
        self, train: Any, cfgs: list[Any], cores: int | None, send: Any, runs: list[Run], scope: trio.CancelScope
    ) -> None:
        async def deliver(run: Run, i: int) -> None:
            await run._done.wait()
            err = run._error
            try:
                send.send_nowait(Result(i, run.config, run._value, err, run.worker, run.attempts))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass

        async with send:
            with scope:
                async with trio.open_nursery() as n:
                    for i, cfg in enumerate(cfgs):
                        try:
                            run = await self.start(train, cfg, cores=cores)
                        except WorkersClosed:
                            return
                        runs.append(run)
                        n.start_soon(deliver, run, i)

    # ---- placement --------------------------------------------------------------------------------

    async def _place(self, cores: int) -> Worker:
        self._waiting += 1
        try:
            while True:
                if self._closed:
                    raise WorkersClosed("the population is closed")
                best: Worker | None = None
                best_key: tuple[bool, int] | None = None
                for w in list(self._live):
                    if not w.alive:  # died while idle: replace it, place elsewhere
                        self._retire(w)
                        continue
                    load = self._load[w.name]
                    # room now first; else a full worker with nothing waiting on it yet (its backlog of one)
                    if load <= self.capacity:
                        key = (load + cores > self.capacity, load)
                        if best_key is None or key < best_key:
                            best, best_key = w, key
                if best is not None:
                    self._load[best.name] += cores
                    return best
                await self._changed.wait()
        finally:
            self._waiting -= 1

    def _release(self, w: Worker, cores: int) -> None:
        if w.name in self._load:
            self._load[w.name] -= cores
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _retire(self, w: Worker) -> None:
        """``w`` died: stop placing runs there and start a replacement."""
        if w in self._live:
            self._live.remove(w)
            self._load.pop(w.name, None)
            if not self._closed:
                self._nursery.start_soon(self._replace)

    async def _replace(self) -> None:
        async with self._replacing:
            if self._closed:
                return
            try:
                new = await self._ws.start(1, start_timeout=self._limits.start_timeout)
            except Exception:
                # no replacement (the machine is out of something): the others carry on; a later death tries again
                import logging

                logging.getLogger("asyncgrad.distributed").exception("could not start a replacement worker")
                return
            for w in new:
                if w.alive:
                    self._live.append(w)
                    self._load[w.name] = 0
                    self._replaced += 1
            self._wake()

    # ---- one run ----------------------------------------------------------------------------------

    def _on_notify(self, run: Run, msg: Any) -> None:
        if type(msg) is list and len(msg) == 2 and msg[0] == STARTED:
            if not run._started:
                run._started = True
                self._running += run.cores
            return
        run._on_notify(msg)

    async def _drive(self, run: Run, w: Worker | None) -> None:
        try:
            while True:
                if w is None:
                    with run._new_scope():
                        w = await self._place(run.cores)
                    if w is None:
                        break  # cancelled while waiting for a worker
                run.worker = w.name
                run.attempts += 1
                run._started = False
                try:
                    with run._new_scope():
                        value = await w.call_streaming(
                            _RUN_TRIAL, run.target, run.config, run._checkpoint, run.attempts - 1, self.capacity,
                            run.cores, on_notify=functools.partial(self._on_notify, run), timeout=None,
                            what=f"the training {run.target} (run {run.index})",
                        )
                        self._finished += 1
                        run._finish(value, None)
                        return
                    break  # cancelled
                except WorkerDied as e:
                    self._release(w, run.cores)
                    self._retire(w)
                    w = None
                    if not run._started and run._requeued < _MAX_REQUEUES and not run._cancel_requested:
                        # it waited on that worker and never ran: place it again, no attempt used
                        run.attempts -= 1
                        run._requeued += 1
                        continue
                    if run.attempts <= self._limits.max_retries and not run._cancel_requested:
                        self._retried += 1
                        continue
                    self._failed += 1
                    run._finish(None, e)
                    return
                except Exception as e:
                    self._failed += 1
                    run._finish(None, e)
                    return
                finally:
                    if run._started:
                        run._started = False
                        self._running -= run.cores
                    if w is not None:
                        self._release(w, run.cores)
                        w = None
            self._cancelled += 1
            run._finish(None, RunCancelled(f"run {run.index} of {run.target} was cancelled"))
        except trio.Cancelled:
            self._cancelled += 1
            run._finish(None, RunCancelled(f"run {run.index} of {run.target}: the population closed"))
            raise
        except BaseException as e:
            run._finish(None, e)
            raise


def _cpus() -> list[int]:
    """The CPUs this process may run on (its affinity, e.g. under taskset or a container's cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _core_groups(cpus: list[int], k: int, per: int) -> list[list[int]] | None:
    """``per`` CPUs of their own for each of ``k`` local workers, or None when they do not fit (then the
    workers share all of them, as the scheduler places them).

    Pinned, a worker's loop and lane hand the GIL to each other on one core, and the workers never run
    on each other's cores. Measured on W3 (32 trainings over 2 workers on 2 cores, 6 interleaved rounds,
    medians, other jobs loading the machine ~3): 0.88 s against 1.22 s unpinned for all 32 at P=2, 0.79 s
    against 1.34 s at P=4, 46 ms of worker CPU per training against 50, and far less spread.
    """
    if k < 2 or k * per > len(cpus):
        return None
    return [cpus[i * per : (i + 1) * per] for i in range(k)]


@asynccontextmanager
async def open_population(
    workers: int | None = None,
    *,
    backend: str = "local",
    address: str | None = None,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    max_retries: int = 0,
    start_timeout: float = 60.0,
) -> AsyncIterator[Population]:
    """A population of trainings over ``workers`` worker processes (default: one per core).

    Args:
        workers: Worker processes. The cores are shared among them: each worker's runtime gets
            ``cores // workers`` lanes with one BLAS thread each, so the workers never oversubscribe,
            and local workers run on those cores only (their CPU affinity: worker i on the i-th group
            of this process's CPUs; a replacement on the dead worker's), when there are enough of them.
        backend: ``"local"`` (worker processes on this machine) or ``"ray"`` (each worker a Ray actor of
            ``cpus // workers`` CPUs, the cluster's CPUs shared as above; needs ``pip install
            'asyncgrad[ray]'``). Ray is used as it is when initialised, else started here (``ray.init()``,
            a local Ray, or ``ray.init(address)``) and shut down on leaving. The actors connect back to
            this process over TCP with the population's secret; the data never goes through Ray. On a
            cluster of other machines, asyncgrad and the training's module must import on its nodes
            (installed there, or shipped with the job's ``ray.init(runtime_env=...)``); a worker whose
            actor died reports ``exitcode`` None (Ray does not say how a process ended).
        address: The Ray cluster to join (``backend="ray"`` only, when Ray is not initialised yet).
        max_concurrent: Trainings at once per worker core (more wait for room).
        max_retries: How often a run whose worker died restarts (on another worker, from its last
            checkpoint: ``trial.restored``) before it fails with `WorkerDied`.
        start_timeout: Seconds a worker (also a replacement) gets to start.

    Leaving the block (normally, on error or cancelled) cancels the runs not finished (their trainings
    see `trio.Cancelled`) and shuts every worker down (a Ray backend's actors are killed).
    """
    if backend not in ("local", "ray"):
        raise ValueError(f"backend is 'local' or 'ray', got {backend!r}")
    if address is not None and backend != "ray":
        raise ValueError(f"address= names a Ray cluster: it needs backend='ray', not {backend!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
        raise ValueError(f"max_concurrent must be a positive int, got {max_concurrent!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
    try:
        current_runtime("dist.open_population")
    except NoRuntimeError:
        raise NoRuntimeError(
            "dist.open_population needs an asyncgrad runtime open in this task (results, reports and "
            "checkpoints carry tensors): wrap it in `async with asyncgrad.open_runtime():`"
        ) from None
    limits = _Limits(max_concurrent, max_retries, start_timeout)
    if backend == "local":
        mine = _cpus()
        k = len(mine) if workers is None else workers
        per = max(1, len(mine) // k)
        launcher = LocalLauncher(_core_groups(mine, k, per))
        async with open_workers(
            k, lanes=per, blas_threads=1, start_timeout=start_timeout, launcher=launcher
        ) as ws:
            async with _populate(ws, per, limits) as pop:
                yield pop
        return
    async with ray_session(address) as ray:
        cpus = ray.cpus()
        k = cpus if workers is None else workers
        if k > cpus:
            raise ValueError(
                f"{k} workers do not fit the Ray cluster's {cpus} CPU(s) (each worker is an actor of at "
                f"least one CPU): ask for workers <= {cpus}, or add nodes"
            )
        per = cpus // k
        async with open_workers(
            k, lanes=per, blas_threads=1, start_timeout=start_timeout, transport="tcp", host=ray.host,
            launcher=ray.launcher(per),
        ) as ws:
            async with _populate(ws, per, limits) as pop:
                yield pop


@asynccontextmanager
async def _populate(ws: Workers, per: int, limits: _Limits) -> AsyncIterator[Population]:
    async with trio.open_nursery() as nursery:
        pop = Population(ws, nursery, limits, per)
        try:
            yield pop
        finally:
            pop._closed = True
            pop._wake()
            nursery.cancel_scope.cancel()
