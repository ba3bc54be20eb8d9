"""A caching allocator for large kernel outputs on the CPU device (PyTorch's CUDA caching allocator, on host).

Why: glibc hands large freed blocks back to the OS, so the next array of that size page-faults on
first touch. In a training step the same shapes come back every step, and those faults cost more
than the kernels (measured on W1: `0.01 * grad` of a 784x512 float32 grad took 0.9-1.2 ms on a fresh
allocation and 0.09 ms into a reused buffer).

How: a kernel on a lane asks `lane_empty(shape, dtype)` for its output. Arrays of at least
`MIN_BYTES` are views over a pooled byte buffer; a weak reference on the view returns the buffer to
its free list when the view dies, but only if nothing else still refers to the buffer (no other view
of it is alive). Nothing is ever handed out twice: a buffer with a live view is simply let go.

Ownership: each CPU device owns one `HostCache`; free lists are changed under the cache's own lock,
held for a few list operations on allocations of `MIN_BYTES` or more (never per op or per node of
small graphs). Weak-reference callbacks may run on any thread.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from typing import Any

import attrs
import numpy as np

from ..actors import read_record

MIN_BYTES = 128 << 10  # below glibc's smallest mmap threshold such blocks are reused anyway
_PAGE = 4096

# buffer id -> (weak ref on the view handed out, buffer); read by `private_base`
_LIVE: dict[int, tuple[Any, np.ndarray]] = {}

_tls = threading.local()


@attrs.frozen
class HostCacheStatistics:
    """Counters of a device's host cache."""

    hits: int
    misses: int
    recycled: int
    released: int
    cached_bytes: int
    max_cached_bytes: int


class _Ref(weakref.ref):  # type: ignore[type-arg]
    __slots__ = ("key", "size")
    key: int
    size: int


class HostCache:
    """Free lists of large host buffers, by size (rounded up to whole pages)."""

    def __init__(self, max_cached_bytes: int) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._cached = 0
        self._hits = self._misses = self._recycled = self._released = 0
        self._closed = False
        self._on_dead = self._recycle  # one bound method shared by every weak ref

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array, from a cached buffer when one of its size is free."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or self._closed or not _CALIBRATED:
            return np.empty(shape, dtype)
        size = -(-nbytes // _PAGE) * _PAGE
        buf = None
        with self._lock:
            lst = self._free.get(size)
            if lst:
                buf = lst.pop()
                self._cached -= size
                self._hits += 1
            else:
                self._misses += 1
        if buf is None:
            buf = np.empty(size, np.uint8)
        arr = np.ndarray(shape, dtype, buf)
        ref = _Ref(arr, self._on_dead)
        ref.key = id(buf)
        ref.size = size
        _LIVE[ref.key] = (ref, buf)
        return arr

    def _recycle(self, ref: _Ref) -> None:
        if _LIVE is None:  # type: ignore[comparison-overlap]  # module torn down at interpreter exit
            return
        entry = _LIVE.pop(ref.key, None)
        if entry is None:
            return
        buf = entry[1]
        del entry
        # refs left: `buf`, getrefcount's argument and the dying view's base; more means another view
        # of this memory is still alive, and the buffer is let go with it instead of being reused
        if sys.getrefcount(buf) != _DEAD_VIEW_REFS or self._closed:
            self._released += 1
            return
        size = ref.size
        with self._lock:
            if self._cached + size <= self.max_cached_bytes:
                self._free.setdefault(size, []).append(buf)
                self._cached += size
                self._recycled += 1
            else:
                self._released += 1
        del buf  # a buffer not kept is freed here, outside the lock

    def empty_cache(self) -> None:
        """Free every cached buffer (like ``torch.cuda.empty_cache``); live arrays are untouched."""
        with self._lock:
            free, self._free = self._free, {}
            self._cached = 0
        free.clear()

    def close(self) -> None:
        self._closed = True
        self.empty_cache()
        # the bound method referred back to the cache (a cycle); a closed cache hands out no new buffers,
        # and the weak refs of live ones hold their own reference to it
        self.__dict__.pop("_on_dead", None)

    def statistics(self) -> HostCacheStatistics:
        return read_record(HostCacheStatistics, self, cached_bytes=self._cached)


def private_base(arr: np.ndarray) -> bool:
    """True when nothing but ``arr`` refers to the memory under it (so ``arr`` may be taken over whole)."""
    base = arr.base
    if base is None:
        return True
    if not isinstance(base, np.ndarray) and hasattr(base, "__array_interface__"):
        return False  # `as_strided`'s wrapper (an unfold view): the array it holds may be shared
    # refs: arr.base, `base`, getrefcount's argument, and the cache's record while it is a pooled buffer
    return sys.getrefcount(base) == (4 if id(base) in _LIVE else 3)


def lane_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An output array for a kernel: from the running lane's cache, or plain `np.empty` elsewhere."""
    cache = getattr(_tls, "cache", None)
    if cache is None:
        return np.empty(shape, dtype)
    return cache.empty(shape, dtype)


def _calibrate() -> tuple[bool, int]:
    """Measure how many references a buffer has inside the callback of its dying only view.

    It depends on the order numpy's array dealloc clears weak refs and drops the base; measuring it
    keeps the cache correct on any numpy, and turns it off if the answer is not the expected one.
    """
    seen: list[int] = []

    def cb(ref: Any) -> None:
        buf = holder.pop()
        seen.append(sys.getrefcount(buf))

    buf = np.empty(_PAGE, np.uint8)
    holder = [buf]
    view = np.ndarray((16,), np.float64, buf)
    ref = weakref.ref(view, cb)
    del buf, view
    ok = len(seen) == 1 and seen[0] in (2, 3)
    del ref
    return ok, (seen[0] if ok else -1)


_CALIBRATED, _DEAD_VIEW_REFS = _calibrate()
