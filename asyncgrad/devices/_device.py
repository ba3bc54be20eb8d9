"""Devices: actors that own their lanes (worker threads), their streams and their apply lock.

The CPU device runs numpy kernels on `lanes` worker threads; a stream is bound to one lane. The CUDA
device (`_cuda.py`) maps the same interface onto cupy streams and events.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import attrs
import trio

from ..actors import Actor
from . import _blas
from ._hostmem import HostCache
from ._stream import Lane, Stream

# Kernels whose output has at most this many elements may run inline on the calling thread when their
# stream is idle: a hand-off to a lane costs ~10 us round trip, far more than such a kernel (measured in
# benchmarks/bench.py W2; numpy ufuncs under ~500 elements do not even release the GIL).
INLINE_MAX_ELEMENTS = 4096

# When several tasks take streams of one CPU device (many small trainings in one runtime), a kernel whose
# output and tensor inputs each have at most this many elements runs where its inputs are, on the calling
# thread, too: there every lane hand-off also waits for the GIL held by the other trainings' Python (W3
# measured ~1 core busy at any P and 0.3 s more CPU at P >= 2 than one after another). A matmul or linear
# must also stay under the multiply-adds bound (64x256 @ 256x256: ~0.1 ms on one core), as must a
# convolution or a pooling op (its window reads): each counts its own (`Op.work`); the ops in
# `runtime._dispatch`'s deny list (recurrences, attention, einsum, dropout) never do, so the loop never runs
# a heavy kernel.
SHARED_INLINE_MAX_ELEMENTS = 65536
SHARED_INLINE_MAX_MACS = 1 << 22

# Lanes run this much "nicer" than the event loop (see `open_runtime`'s ``lane_nice``).
DEFAULT_LANE_NICE = 0

# Free host buffers a CPU device keeps for reuse (see `_hostmem`); live arrays are not counted.
DEFAULT_HOST_CACHE_BYTES = 256 << 20


@attrs.frozen
class DeviceStatistics:
    """Counters of one device."""

    name: str
    lanes: int
    streams_created: int
    streams_free: int
    streams_in_use: int
    # released streams whose work is still running: handed out again only once it is done
    streams_draining: int = 0


@attrs.frozen
class Synchronize:
    """Message: reply once every stream of the device has finished its submitted work."""


@attrs.frozen
class GetStatistics:
    """Message: reply with the device's statistics."""


class StreamPool:
    """Hands out streams; a released stream is reused only once its work is done."""

    def __init__(self, device: Device) -> None:
        # weak: the device holds its pool, and a closed device is freed by refcount, not by the collector
        self._device = weakref.ref(device)
        self._free: list[Stream] = []
        self._draining: list[Stream] = []
        self._closed = False
        self.created = 0
        self.in_use = 0

    def acquire(self) -> Stream:
        if self._draining:
            still: list[Stream] = []
            for s in self._draining:
                (self._free if s.query() else still).append(s)
            self._draining = still
        dev = self._device()
        if dev is None:
            raise RuntimeError("the device of this stream pool is gone")
        self.in_use += 1
        dev._streams_in_use(self.in_use)
        if self._free:
            return self._free.pop()
        self.created += 1
        return dev._new_stream()

    def release(self, stream: Stream) -> None:
        self.in_use -= 1
        dev = self._device()
        if dev is not None:
            dev._streams_in_use(self.in_use)
        if not self._closed:  # a closed pool keeps no stream (each refers to its device)
            (self._free if stream.query() else self._draining).append(stream)

    def close(self) -> None:
        """Forget the streams (the device's work is over): the device, its streams and lanes then form no
        reference cycle."""
        self._closed = True
        self._free.clear()
        self._draining.clear()

    def all_streams(self) -> list[Stream]:
        dev = self._device()
        return [] if dev is None else list(dev._streams)


class Device(Actor):
    """Base of devices: a name, a stream pool, and the actor loop that owns the device's workers."""

    type: str = "?"

    def __init__(self, index: int = 0) -> None:
        super().__init__(f"{self.type}:{index}")
        self.index = index
        # looked up per op (streams are keyed by device): hashed once, not per lookup
        self._hash = hash((self.type, index))
        self.pool = StreamPool(self)
        self._streams: list[Stream] = []
        # held by a graph task while it runs an async (reentrant-capable) backward on this device; a
        # reentrant await releases it so the inner pass can use the device
        self.apply_lock = trio.Lock()

    def __str__(self) -> str:
        return self.type if self.index == 0 else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return _canonical(other) == (self.type, self.index)
        if isinstance(other, Device):
            return (other.type, other.index) == (self.type, self.index)
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    # a device is a live resource of its runtime, not a value: copies of tensors and modules share it
    # (copying would reach the actor's nursery and coroutines)
    def __copy__(self) -> Device:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Device:
        return self

    def _new_stream(self) -> Stream:
        raise NotImplementedError

    # above `INLINE_MAX_ELEMENTS`, the largest output (and tensor input) a kernel may have to run inline on
    # the calling thread: 0, or `SHARED_INLINE_MAX_ELEMENTS` while several tasks share a CPU device
    shared_inline_max = 0

    def _streams_in_use(self, n: int) -> None:
        """The pool now has ``n`` streams taken (a device whose kernels share a resource may act on it)."""

    async def handle(self, msg: Any) -> Any:
        if isinstance(msg, Synchronize):
            for s in list(self._streams):
                await s.synchronize()
            return None
        if isinstance(msg, GetStatistics):
            return self.device_statistics()
        raise TypeError(f"device {self} got an unknown message {msg!r}")

    def device_statistics(self) -> DeviceStatistics:
        pool = self.pool
        draining = sum(not s.query() for s in pool._draining)
        return DeviceStatistics(
            name=str(self),
            lanes=self.lane_count,
            streams_created=pool.created,
            streams_free=len(pool._free) + len(pool._draining) - draining,
            streams_in_use=pool.in_use,
            streams_draining=draining,
        )

    @property
    def lane_count(self) -> int:
        return 0

    def threads(self) -> list[Any]:
        return []


def _canonical(name: str) -> tuple[str, int]:
    kind, _, idx = name.partition(":")
    return kind, int(idx) if idx else 0


class CPUDevice(Device):
    """The numpy device: kernels run on `lanes` worker threads, one FIFO per lane."""

    type = "cpu"

    def __init__(
        self,
        index: int = 0,
        *,
        lanes: int | None = None,
        blas_threads: int | None = None,
        host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
        lane_nice: int = 0,
    ) -> None:
        super().__init__(index)
        self._blas_threads = blas_threads
        self._lane_nice = lane_nice
        self.host_cache = HostCache(host_cache_bytes)
        n = lanes if lanes is not None else (os.cpu_count() or 1)
        if n < 1:
            raise ValueError(f"a CPU device needs at least one lane, got lanes={n}")
        self._lane_count = n
        self._lanes: list[Lane] = []
        self._next_lane = 0

    @property
    def lane_count(self) -> int:
        return self._lane_count

    def threads(self) -> list[Any]:
        return [lane.thread for lane in self._lanes]

    def _streams_in_use(self, n: int) -> None:
        # a training alone in the process runs its kernels with every lane's BLAS threads (see `_blas`)
        _blas.set_demand(id(self), n if self._lanes else 0, self._lane_count * (self._blas_threads or 1))
        _share_inline()

    def _new_stream(self) -> Stream:
        if not self._lanes:
            raise RuntimeError(f"device {self} is not running: open a runtime with ag.open_runtime()")
        # the lane with the fewest streams bound gets the new one, so concurrent trainings spread out
        lane = min(self._lanes, key=lambda ln: ln.streams_bound)
        lane.streams_bound += 1
        s = Stream(self, lane)
        self._streams.append(s)
        return s

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        _blas.shorten_pool_spin()  # before any lane runs a kernel (see `_blas.POOL_SPIN_EXPONENT`)
        self._lanes = [
            Lane(str(self), i, self._blas_threads, self.host_cache, self._lane_nice)
            for i in range(self._lane_count)
        ]
        for lane in self._lanes:
            lane.siblings = [other for other in self._lanes if other is not lane]
        own = [threading.get_native_id(), *(lane.thread.native_id or 0 for lane in self._lanes)]
        _blas.own_threads(own, True)  # their CPU is this runtime's, not load beside it
        cancelled = True
        try:
            await super().run(task_status=task_status)
            cancelled = False
        finally:
            # a normal close finishes queued kernels; a cancelled runtime drops them (only the kernel
            # running now delays the join)
            for lane in self._lanes:
                lane.stop(discard=cancelled)
            # joining waits for kernels in flight; they are bounded work, so this is prompt
            for lane in self._lanes:
                lane.join()
                lane.siblings = []  # lanes referred to each other
            self._lanes = []
            _blas.own_threads(own, False)
            # streams refer to their device: a closed device drops them, so refcount frees it
            self.pool.close()
            self._streams.clear()
            _blas.set_demand(id(self), 0, 0)
            _share_inline()
            self.host_cache.close()


def _share_inline() -> None:
    """Medium kernels run inline on every CPU device (`SHARED_INLINE_MAX_ELEMENTS`, one class attribute) while
    the process has more than one stream in use, over all its runtimes: runtimes of their own threads take
    the one GIL as tasks of one runtime do, so their lane hand-offs cost the same (W3's "asyncgrad threads",
    P runtimes in threads: 6.3 s at P=4 against 1.4 s at P=1 while each runtime handed every kernel to its
    lanes). The count is `_blas`'s demand, which every CPU device keeps current as streams come and go."""
    shared = _blas.streams_in_use() > 1
    CPUDevice.shared_inline_max = SHARED_INLINE_MAX_ELEMENTS if shared else 0
    if shared:
        # kernels now also run inline on this thread, which no lane `sync` covers: a lone training's
        # full BLAS count left in place made them wake (and, under load, wait for) every pool thread
        _blas.sync()
