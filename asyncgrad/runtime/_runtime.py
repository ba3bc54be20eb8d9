"""The runtime: device actors and registration servers started in one nursery, and stream lookup.

`open_runtime()` publishes the runtime in a context variable, so every task started inside it (and
every op those tasks run) finds it; P OS threads each calling `run()` get P independent runtimes.
"""

from __future__ import annotations

import contextvars
import os
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ..actors import read_record
from ..devices import DEFAULT_LANE_NICE, CPUDevice, Device, Stream, Synchronize
from ._loop_sched import _no_restore, raise_priority, shorten_slice

# the loop thread's scheduler slice while a runtime is open (see `open_runtime`'s ``loop_slice_s``):
# 0.3 ms brought W5's p99 (loss read every step) under 1 ms on an otherwise idle machine, where the
# kernel's left 2.7-3.1 ms and 0.1 ms ~0.9 ms (the loop, preempted after every 0.1 ms it runs, lost
# W3's recording 5-60% under load; 0.3 ms lets a batch of ready tasks finish in one slice)
DEFAULT_LOOP_SLICE_S: float | None = 0.0003

_current: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("asyncgrad_runtime", default=None)


class NoRuntimeError(RuntimeError):
    """A tensor operation ran outside an open runtime."""


_NO_RUNTIME = (
    "{what} needs an asyncgrad runtime, and none is open in this task: wrap your code in "
    "`async with asyncgrad.open_runtime():` or start it with `asyncgrad.run(main)`"
)


@attrs.frozen
class RuntimeStatistics:
    """Counters of a runtime (see `Runtime.statistics`)."""

    devices: tuple[str, ...]
    lanes: int
    blas_threads: int | None
    graph_tasks_started: int
    graph_tasks_finished: int
    grads_stolen: int
    grads_copied: int
    grads_accumulated: int
    worker_threads: int


class _BlasLimit:
    """Process-wide BLAS thread limit, shared by every open runtime (refcounted; set once, restored last).

    BLAS limits are process-wide, so runtimes in several OS threads must agree on one value.
    """

    _lock = threading.Lock()  # taken only when a runtime opens or closes, never per op
    _count = 0
    _limiter: Any = None
    threads: int | None = None

    @classmethod
    def acquire(cls, threads: int) -> int | None:
        with cls._lock:
            if cls._count == 0 and cls.threads != threads:
                try:
                    from threadpoolctl import threadpool_limits

                    limiter = threadpool_limits(limits=threads, user_api="blas")
                    if cls._limiter is None:
                        cls._limiter = limiter  # remembers the process's original limits
                    cls.threads = threads
                except Exception:  # threadpoolctl missing or no BLAS found: nothing to limit
                    cls.threads = None
            cls._count += 1
            return cls.threads

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._count -= 1
            # OpenBLAS ignores a limit set from a non-main thread after a restore, so runtimes closing
            # in other threads leave the limit in place for the next runtime (measured in W3)
            if (
                cls._count == 0
                and cls._limiter is not None
                and threading.current_thread() is threading.main_thread()
            ):
                cls._limiter.restore_original_limits()
                cls._limiter = None
                cls.threads = None


class _TaskStreams:
    """The streams one trio task uses, one per device; released to their pools when the task ends."""

    __slots__ = ("__weakref__", "by_device", "release", "task")

    def __init__(self, task: Any) -> None:
        # weak: the task's context holds this object, and a strong reference back made every task that ran
        # an op a cycle (task -> context -> streams -> task) that kept its runtime and devices alive until
        # the garbage collector ran
        self.task = weakref.ref(task)
        self.by_device: dict[Device, Stream] = {}
        self.release: Callable[[], Any] | None = None  # set when the streams are the task's own


_task_streams: contextvars.ContextVar[_TaskStreams | None] = contextvars.ContextVar(
    "asyncgrad_task_streams", default=None
)


def _release_streams(by_device: dict[Device, Stream]) -> None:
    for dev, s in by_device.items():
        dev.pool.release(s)


class Runtime:
    """An open asyncgrad runtime: its devices and counters. Get it from `open_runtime()`."""

    def __init__(
        self, *, lanes: int | None, cpu_devices: int, blas_threads: int | None, lane_nice: int = 0
    ) -> None:
        cores = os.cpu_count() or 1
        self.lanes = lanes if lanes is not None else cores
        if self.lanes < 1:
            raise ValueError(f"a CPU device needs at least one lane, got lanes={self.lanes}")
        # one BLAS thread per lane keeps lanes * blas_threads <= cores: no oversubscription
        self._blas_request = blas_threads if blas_threads is not None else max(1, cores // self.lanes)
        self.devices: dict[str, Device] = {}
        for i in range(cpu_devices):
            d = CPUDevice(i, lanes=self.lanes, blas_threads=self._blas_request, lane_nice=lane_nice)
            self.devices[f"cpu:{i}"] = d
        self.devices["cpu"] = self.devices["cpu:0"]
        self.cpu: Device = self.devices["cpu"]
        self.blas_threads: int | None = None
        self.graph_tasks_started = self.graph_tasks_finished = 0
        self.grads_stolen = self.grads_copied = self.grads_accumulated = 0
        self.closed = False
        self.nursery: trio.Nursery = None  # type: ignore[assignment]  # set by open_runtime
        self.owners: dict[Any, Any] = {}  # stream -> LeafOwner (see autograd._leaf_owner)

    def device(self, spec: Any) -> Device:
        """Resolve a device name ("cpu", "cpu:1", "cuda") or object to this runtime's device."""
        if isinstance(spec, Device):
            spec = str(spec)
        key = str(spec)
        dev = self.devices.get(key)
        if dev is None:
            if key.startswith("cuda"):
                dev = self._open_cuda(key)
            else:
                known = ", ".join(sorted(self.devices))
                raise ValueError(f"unknown device {key!r}: this runtime has {known}")
        return dev

    def _open_cuda(self, key: str) -> Device:
        raise RuntimeError(
            f"device {key!r} is not available: the CUDA device needs cupy and a GPU "
            "(pip install 'asyncgrad[cuda]'); use device='cpu'"
        )

    def threads(self) -> list[threading.Thread]:
        """The worker threads this runtime owns (its fixed set)."""
        out: list[threading.Thread] = []
        for name, d in self.devices.items():
            if name != "cpu":
                out.extend(d.threads())
        return out

    def statistics(self) -> RuntimeStatistics:
        devices = tuple(k for k in self.devices if k != "cpu")
        return read_record(RuntimeStatistics, self, devices=devices, worker_threads=len(self.threads()))

    async def synchronize(self) -> None:
        """Wait until every stream of every device has finished its work."""
        for name, d in self.devices.items():
            if name != "cpu":
                await d.call(Synchronize())


@asynccontextmanager
async def open_runtime(
    *,
    lanes: int | None = None,
    cpu_devices: int = 1,
    blas_threads: int | None = None,
    lane_nice: int = DEFAULT_LANE_NICE,
    loop_nice: int | None = None,
    loop_slice_s: float | None = DEFAULT_LOOP_SLICE_S,
) -> AsyncIterator[Runtime]:
    """Open a runtime: start the device actors (and their worker lanes) in a nursery.

    Args:
        lanes: Worker threads per CPU device (default: the machine's cores).
        cpu_devices: How many independent CPU devices ("cpu:0", "cpu:1", ...) to run.
        blas_threads: BLAS threads per kernel; default ``cores // lanes`` so lanes never oversubscribe.
            A training alone in the process (one stream in use, all runtimes together) runs with every
            lane's: ``lanes * blas_threads``, at most the cores (with a pthreads OpenBLAS), and at most
            the cores other processes leave free (sampled by the lanes every 0.25 s from /proc/stat): a
            multi-threaded BLAS call waits for its slowest thread, so beside busy processes it runs on
            one (under load ~13 on 2 cores a 64x256x256 product took 7.7-12.6 ms on 2 threads, 0.5-0.7 ms
            on 1). Where the load cannot be read (not Linux) the count is as if the machine were free.
        lane_nice: How much lower than the event loop's the lanes' scheduling priority is (Linux nice
            increment, per lane thread). Default 0: lanes keep the loop's priority, so they keep their
            share of the CPU beside other busy processes and beside other threads of this process
            (torch's OpenMP/MKL threads). Measured with ``benchmarks/bench.py LOAD``: with one outside
            busy process a W1 step ran at 0.94-1.00x of plain numpy under the same load with 0
            against 2.8-4.6x with 10, a small CNN step 0.80-1.16x against 3.6-4.4x; beside torch
            training in a thread W1 1.18-1.77x against 5.0-5.5x, the CNN 0.48-0.94x against 2.6-4.4x.
            The limit: while kernels keep every core busy, a waking loop waits for its turn; the
            default ``loop_slice_s`` keeps that wait under a millisecond on an otherwise idle machine
            (W5's p99 2.7-3.1 ms with lane_nice=0 alone), not beside other busy processes. Pass 10 for
            a service whose latency matters more than its training's throughput, on a machine it has
            to itself. Applied only with one BLAS thread per lane (the default when lanes ==
            cores): a multi-threaded BLAS's own pool threads keep normal priority and would starve
            the lane.
        loop_nice: A nice value for the event loop's thread while the runtime is open (e.g. -10), set
            after the lanes started (they keep theirs) and restored on leaving. Default None: left as
            it is. The one mechanism measured to keep the loop responsive beside busy processes
            (``benchmarks/bench.py W5M`` at load ~20 on 2 cores: heartbeat p50 3.0-3.6 -> 0.25 ms,
            p99 43-48 -> 20 ms, and the training, whose ops the loop records, 2.9 s against 11-13 s)
            but a negative value needs privileges (root, CAP_SYS_NICE or an RLIMIT_NICE allowing it):
            without them this raises PermissionError. Linux only (elsewhere nice is per process).
            Threads and processes the loop thread starts while it is raised inherit the value.
        loop_slice_s: A scheduler slice for the loop's thread while the runtime is open, in seconds
            (0.0001 to 0.1; restored on leaving; None: the kernel's, 1.4 ms here). Default 0.0003. A
            thread that wakes with a short slice gets an early deadline and preempts one running out a
            long slice (Linux 6.12+ EEVDF; older kernels and other systems ignore it), so the loop,
            woken by a timer or a socket while lanes and BLAS threads fill every core, runs within
            about a slice, with no privilege and no change to anyone's share of the CPU (the lanes keep
            theirs beside busy processes and torch's threads, issue 22 item 1). Measured side by side
            (``benchmarks/bench.py W5M``, W5 reading its loss every step through the async form, 2
            cores, machine otherwise idle): heartbeat p99 0.74-0.76 ms with 0.0003 against 2.7-3.1 ms
            with the kernel's slice and 0.89-0.93 ms with 0.0001 (max 2.3-4.1 ms against 6.4-6.8); with
            one other process busy on the machine, 6 runs each: p99 0.69-3.4 ms (median 1.1) against
            0.76-3.8 ms (median 2.9), so 1 ms is met on an idle machine, not reliably beside it. A
            shorter slice also means the loop is preempted sooner once it runs: 0.0001 cost W3's tasks
            in one runtime 5-60% under load, as the loop records every op; 0.0003 lets a batch of ready
            tasks finish in one slice (W3 tasks at P=8 under load 5-8, 6 alternating rounds: median
            3.34 s against 4.14 s with the kernel's slice, within the noise). The limits: it buys
            latency only against threads of equal weight; beside other busy processes (load above the
            cores) the loop still waits for a core and p99 is several ms (load 4-7 on 2 cores: 3-7 ms
            whatever the slice), which only ``loop_nice`` (privileged) or ``lane_nice`` (which costs
            the lanes their share) improve.
    Leaving the block waits for queued kernels, stops and joins every worker thread.
    """
    if _current.get() is not None and not _current.get().closed:  # type: ignore[union-attr]
        raise RuntimeError("a runtime is already open in this task; nested runtimes are not supported")
    rt = Runtime(lanes=lanes, cpu_devices=cpu_devices, blas_threads=blas_threads, lane_nice=lane_nice)
    restore_nice: Callable[[], None] = _no_restore
    restore_slice: Callable[[], None] = _no_restore
    rt.blas_threads = _BlasLimit.acquire(rt._blas_request)
    token = _current.set(rt)
    streams_token = _task_streams.set(None)
    body_error: list[BaseException] = []
    try:
        async with trio.open_nursery() as nursery:
            for name, dev in rt.devices.items():
                if name != "cpu":
                    await nursery.start(dev.run)
            # after the lanes started: they keep their own priority (a thread inherits its creator's)
            try:
                restore_nice = raise_priority(loop_nice)
                restore_slice = shorten_slice(loop_slice_s)
            except BaseException as e:  # comes out as itself, as the block's own errors do
                body_error.append(e)
                raise
            # graph tasks and leaf owners run here; the devices outlive them (opened in the outer one)
            async with trio.open_nursery() as tasks:
                rt.nursery = tasks
                try:
                    yield rt
                except BaseException as e:
                    body_error.append(e)
                    raise
                finally:
                    for owner in rt.owners.values():
                        owner.close()
                    rt.owners.clear()  # each refers to the runtime
            for name, dev in rt.devices.items():
                if name != "cpu":
                    dev.close()
    except BaseExceptionGroup as eg:
        # an error from the user's block comes out as itself, not wrapped by our internal nurseries
        leaf = _sole_exception(eg)
        if body_error and leaf is body_error[0]:
            raise leaf from None
        raise
    finally:
        rt.closed = True
        # the opening task's streams go back now, not when the task dies: they refer to the devices
        ts = _task_streams.get()
        if ts is not None and ts.release is not None:
            ts.release()
        _task_streams.reset(streams_token)
        _current.reset(token)
        _BlasLimit.release()
        restore_slice()
        restore_nice()


def _sole_exception(eg: BaseException) -> BaseException:
    while isinstance(eg, BaseExceptionGroup) and len(eg.exceptions) == 1:
        eg = eg.exceptions[0]
    return eg


def run(main: Callable[..., Awaitable[Any]], *args: Any, **runtime_options: Any) -> Any:
    """Run ``main(*args)`` under `trio.run` inside an open runtime; returns its result.

    Keyword arguments are passed to `open_runtime`.
    """

    async def _main() -> Any:
        async with open_runtime(**runtime_options):
            return await main(*args)

    return trio.run(_main)


def current_runtime(what: str = "this operation") -> Runtime:
    """The runtime open in this task, or a clear error saying how to open one."""
    rt = _current.get()
    if rt is None or rt.closed:
        raise NoRuntimeError(_NO_RUNTIME.format(what=what))
    return rt


def current_stream(device: Device | str | None = None) -> Stream:
    """The calling task's stream on ``device`` (default: the runtime's CPU device).

    Each trio task gets its own stream per device, taken from the device's pool on first use (like a CUDA
    current stream); `use_stream` makes another stream current for a block.
    """
    ts = _task_streams.get()
    try:
        task = trio.lowlevel.current_task()
    except RuntimeError:
        raise NoRuntimeError(_NO_RUNTIME.format(what="this operation")) from None
    if ts is None or ts.task() is not task:
        ts = _new_task_streams(task)
    s = ts.by_device.get(device)  # type: ignore[arg-type]
    if s is None:
        if not isinstance(device, Device):  # a name or None: resolved off the per-op path
            device = current_runtime("current_stream").device("cpu" if device is None else device)
            s = ts.by_device.get(device)
            if s is not None:
                return s
        s = ts.by_device[device] = device.pool.acquire()
    return s


def _new_task_streams(task: Any) -> _TaskStreams:
    ts = _TaskStreams(task)
    _task_streams.set(ts)
    # the task's streams go back to their pools when the task object dies (or its runtime closes)
    ts.release = weakref.finalize(task, _release_streams, ts.by_device)
    return ts


class use_stream:
    """Make ``stream`` the calling task's current stream on its device for the block (ops queue there).

    The stream stays the caller's: it is not returned to any pool when the block ends; the task's own
    stream on that device is current again afterwards.
    """

    __slots__ = ("_by_device", "_prev", "_stream")

    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    def __enter__(self) -> Stream:
        try:
            task = trio.lowlevel.current_task()
        except RuntimeError:
            raise NoRuntimeError(_NO_RUNTIME.format(what="use_stream")) from None
        ts = _task_streams.get()
        if ts is None or ts.task() is not task:
            ts = _new_task_streams(task)
        stream = self._stream
        by_device = self._by_device = ts.by_device
        self._prev = by_device.get(stream.device)
        by_device[stream.device] = stream
        return stream

    def __exit__(self, *exc: object) -> None:
        dev = self._stream.device
        if self._prev is None:
            self._by_device.pop(dev, None)
        else:
            self._by_device[dev] = self._prev
        self._by_device = self._prev = None  # type: ignore[assignment]
