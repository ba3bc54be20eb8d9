"""Streams and events: ordered queues of kernels, the one execution model for CPU and CUDA.

A CPU stream is bound to one *lane* (a worker thread of its device). Work submitted to a stream runs in
submission order; streams on different lanes run in parallel; an `Event` recorded on one stream and waited
on by another orders work across them. Counters are plain ints written by one thread each (the loop
thread bumps `submitted`, the lane bumps `completed`), so checking readiness takes no lock.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from . import _blas, _hostmem
from ._hostmem import HostCache

if TYPE_CHECKING:
    from ._device import Device

_stream_ids = itertools.count()
PASS_MARKS = 4  # how many pass starts a stream remembers for the engine's backpressure
_tls = _hostmem._tls  # per lane thread: the lane itself and its device's host cache


class KernelError(RuntimeError):
    """A kernel failed on a stream; raised at the next point that waits on that stream."""


@attrs.frozen
class StreamStatistics:
    """Counters of one stream."""

    name: str
    lane: int
    submitted: int
    completed: int
    pending: int


class Lane:
    """A worker thread that runs the jobs of the streams bound to it, in FIFO order."""

    def __init__(
        self,
        device_name: str,
        index: int,
        blas_threads: int | None = None,
        cache: HostCache | None = None,
        nice: int = 0,
    ) -> None:
        self.index = index
        self._nice = nice
        self._blas_threads = blas_threads
        self._cache = cache
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.streams_bound = 0
        self.siblings: list[Lane] = []  # the device's other lanes, which may help with a big kernel
        self._idle = False  # waiting for work with an empty queue (read by siblings offering help)
        self.parts_run = 0  # slices of siblings' kernels this lane ran (see `run_parts`)
        self._discard = False  # set on shutdown: queued jobs are skipped, not run
        self._thread = threading.Thread(
            target=self._main, name=f"asyncgrad-{device_name}-lane{index}", daemon=True
        )
        self._thread.start()

    def _main(self) -> None:
        if self._blas_threads is not None:
            _limit_blas_in_this_thread(self._blas_threads)
            _blas.set_base(self._blas_threads)
        # only single-threaded BLAS: a multi-threaded one hands work to its own pool threads, which
        # keep normal priority and spin while they wait, starving a lowered caller (measured on W5)
        if self._nice > 0 and self._blas_threads == 1:
            _lower_priority_of_this_thread(self._nice)
        _tls.lane = self
        _tls.cache = self._cache
        q = self._queue
        get = q.get
        clock = time.monotonic
        while True:
            if q.empty():
                self._idle = True
            item = get()
            self._idle = False
            if item is None:
                return
            stream, seq, job, marker = item
            if stream is None:  # slices of a sibling's kernel (`run_parts`)
                self.parts_run += job.run_unclaimed()
                continue
            # markers only signal: they run even after a failed kernel and on shutdown, so nobody
            # waits forever on a stream whose kernels were dropped
            if marker or (stream._error is None and not self._discard):
                if clock() >= _blas._next_sample:  # other processes' load: may change the BLAS count
                    _blas.sample()
                if _blas._target != _blas._applied:  # a training started or ended beside this one
                    _blas.sync()
                try:
                    job()
                except BaseException as exc:  # kept, re-raised where the stream is waited on
                    if not marker:
                        stream._error = exc
            # let go of the job before anyone sees it done: its closure holds its tensors and arrays,
            # which would otherwise stay alive (and look shared to the steal checks) until the next job
            item = job = None
            stream.completed = seq
            if stream._waiters:
                stream._wake(seq)

    def stop(self, *, discard: bool = False) -> None:
        """Stop after the queued jobs (or, with ``discard``, after the one running now)."""
        if discard:
            self._discard = True
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def thread(self) -> threading.Thread:
        return self._thread


class _Part:
    """One slice of a kernel split across lanes: run by whichever lane claims it first."""

    __slots__ = ("_claim", "done", "exc", "fn")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn
        self._claim = threading.Lock()
        self.done = threading.Event()
        self.exc: BaseException | None = None

    def run_if_unclaimed(self) -> bool:
        if not self._claim.acquire(blocking=False):
            return False
        fn, self.fn = self.fn, None  # a stale queue entry must not keep the kernel's arrays alive
        assert fn is not None
        try:
            fn()
        except BaseException as e:  # re-raised by the lane that split the kernel
            self.exc = e
        finally:
            # drop the slice (and the arrays it holds) before the owner can go on: its next kernel may
            # check that nothing else refers to the output (to steal it as a .grad)
            fn = None
            self.done.set()
        return True


class _Share:
    """The slices of one kernel offered to a sibling lane: it runs every slice nobody claimed yet."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = parts

    def run_unclaimed(self) -> int:
        # from the far end, so the owner (going forward) and the helpers rarely race for one slice
        return sum(part.run_if_unclaimed() for part in reversed(self.parts))


def run_parts(parts: list[Callable[[], None]]) -> None:
    """Run independent slices of one kernel on this lane and on any idle sibling lanes.

    Called from a kernel on a lane. Each slice is run by whichever lane claims it first: the calling
    lane goes through them in order, idle siblings from the other end, so a sibling that gets no core
    for a while (or never wakes) only means the caller runs more of them itself. The caller waits only
    for slices a sibling is running already. Off a lane, or with no idle sibling, they run here in order.
    """
    helpers = idle_siblings()
    if not helpers or len(parts) < 2:
        for fn in parts:
            fn()
        return
    shared = [_Part(fn) for fn in parts]
    share = _Share(shared)
    for helper in helpers:
        helper._queue.put((None, 0, share, False))
    try:
        for part in shared:
            part.run_if_unclaimed()
    finally:
        # also after a failed slice: no sibling may still be writing once the kernel is over
        for part in shared:
            if not part.run_if_unclaimed():
                part.done.wait()
    for part in shared:
        if part.exc is not None:
            raise part.exc


def idle_siblings() -> list[Lane]:
    """The calling lane's siblings that are waiting for work now (none off the lanes), as many as other
    processes leave cores for (a helper without a core of its own only delays the kernel it shares)."""
    lane: Lane | None = getattr(_tls, "lane", None)
    if lane is None:
        return []
    idle = [s for s in lane.siblings if s._idle]
    return idle[: _blas.spare_cores() - 1]


def _lower_priority_of_this_thread(increment: int) -> None:
    """Raise this thread's nice value (Linux keeps one per thread; elsewhere it would be per process)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError:  # not permitted in some sandboxes: lanes just keep the loop's priority
        pass


def _limit_blas_in_this_thread(n: int) -> None:
    """Set BLAS threads from the lane itself: OpenBLAS keeps a per-thread setting when one is set from a
    non-main thread, so a process-wide limit alone does not reach lanes of runtimes opened in threads."""
    try:
        from threadpoolctl import ThreadpoolController

        for lib in ThreadpoolController().lib_controllers:
            if lib.user_api == "blas":
                lib.set_num_threads(n)
    except Exception:  # no threadpoolctl or no BLAS: nothing to limit
        pass


class Stream:
    """An ordered queue of kernels on a device.

    Work submitted with `submit` runs in order on the stream's lane, never on the event loop thread.
    `query()` tells whether everything submitted so far has completed.
    """

    __slots__ = (
        "__weakref__",
        "_error",
        "_lane",
        "_waiters",
        "completed",
        "device",
        "name",
        "pass_marks",
        "submitted",
    )

    def __init__(self, device: Device, lane: Lane) -> None:
        self.device = device
        self._lane = lane
        self.submitted = 0
        self.completed = 0
        self._error: BaseException | None = None
        # (seq, wake) pairs of tasks awaiting `synchronize(seq)`; the lane calls `wake` once seq completed
        self._waiters: list[tuple[int, Callable[[], None]]] = []
        self.name = f"{device}/s{next(_stream_ids)}"
        # for the layer above: the engine keeps here where the latest backward passes on this stream began
        self.pass_marks = [0] * PASS_MARKS

    def __repr__(self) -> str:
        return f"<Stream {self.name} lane={self._lane.index} pending={self.submitted - self.completed}>"

    def submit(self, job: Callable[[], None], *, marker: bool = False) -> int:
        """Queue `job` after all work already on this stream; returns its sequence number.

        A ``marker`` job only signals (sets an event); it runs even after a failed kernel or on shutdown.
        """
        seq = self.submitted + 1
        self.submitted = seq
        self._lane._queue.put((self, seq, job, marker))
        return seq

    def lane_to_itself(self) -> bool:
        """True when no other stream of the device was ever bound to this stream's lane."""
        return self._lane.streams_bound <= 1

    def query(self) -> bool:
        """True when all submitted work has completed."""
        return self.completed >= self.submitted

    def is_done(self, seq: int) -> bool:
        return self.completed >= seq

    def check_error(self) -> None:
        """Raise (once) the error of a failed kernel on this stream."""
        exc = self._error
        if exc is not None:
            self._error = None
            raise KernelError(
                f"a kernel on stream {self.name} failed: {type(exc).__name__}: {exc}; "
                "work queued after it on this stream was skipped"
            ) from exc

    def synchronize_blocking(self, seq: int | None = None) -> None:
        """Block the calling thread until work up to `seq` (default: all) completed."""
        target = self.submitted if seq is None else seq
        if self.completed < target:
            done = threading.Event()
            self.submit(done.set, marker=True)
            done.wait()
        self.check_error()

    async def synchronize(self, seq: int | None = None) -> None:
        """Wait, without blocking the event loop, until work up to `seq` (default: all) completed.

        Only up to `seq`: work queued after it may still run (a marker job at the end of the queue would
        also wait for that).
        """
        target = self.submitted if seq is None else seq
        if self.completed < target:
            done = trio.Event()
            token = trio.lowlevel.current_trio_token()

            def wake() -> None:  # on the lane
                try:
                    token.run_sync_soon(done.set)
                except trio.RunFinishedError:  # the waiter's loop is gone: nobody to wake
                    pass

            entry = (target, wake)
            self._waiters.append(entry)
            # the lane may have passed `target` before it could see the entry
            if self.completed >= target:
                done.set()
            try:
                await done.wait()
            finally:
                try:
                    self._waiters.remove(entry)
                except ValueError:  # the lane took it out already
                    pass
        self.check_error()

    def _wake(self, seq: int) -> None:
        """(lane) Wake the waiters whose work is complete now."""
        for entry in list(self._waiters):
            if entry[0] <= seq:
                try:
                    self._waiters.remove(entry)
                except ValueError:  # the waiter left (cancelled) meanwhile
                    continue
                entry[1]()

    def record_event(self) -> Event:
        """Record an event after the work submitted so far."""
        ev = Event()
        ev.record(self)
        return ev

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait until `event` has completed (no host blocking)."""
        if event.query():
            return
        flag = event._flag

        def wait() -> None:
            flag.wait()

        self.submit(wait)

    def statistics(self) -> StreamStatistics:
        return StreamStatistics(
            name=self.name,
            lane=self._lane.index,
            submitted=self.submitted,
            completed=self.completed,
            pending=self.submitted - self.completed,
        )


class Event:
    """A marker in a stream: completes when the work recorded before it has completed."""

    __slots__ = ("_flag", "_recorded")

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._recorded = False

    def record(self, stream: Stream) -> None:
        self._recorded = True
        if stream.query():
            self._flag.set()
        else:
            stream.submit(self._flag.set, marker=True)

    def query(self) -> bool:
        """True when the recorded work has completed (an event never recorded counts as complete)."""
        return not self._recorded or self._flag.is_set()

    def synchronize(self) -> None:
        """Block the calling thread until the event completes."""
        if self._recorded:
            self._flag.wait()

    async def wait(self) -> None:
        """Wait for the event without blocking the loop (polls a worker thread)."""
        if self.query():
            return
        await trio.to_thread.run_sync(self._flag.wait, abandon_on_cancel=True)
