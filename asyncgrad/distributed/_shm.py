"""Large tensors between local processes: memfd segments handed over a Unix socket (SCM_RIGHTS).

Over a Unix socket to a local process, the buffer of a large tensor is not written into the byte stream
(two kernel copies). The sender stages the value into a shared-memory segment (its one copy, the
copy-out it does anyway), passes the segment's file descriptor with the frame and closes its own: the
receiver maps the segment and it *is* the received tensor's memory. Nothing is shared afterwards: the
sender never touches a segment it gave away.

A segment whose tensor dies goes back to this process's pool, with its pages still populated, and the
next large send reuses it instead of faulting in fresh zeroed pages. The pool is small and bounded.

A segment given away keeps its mapping here (never read or written: it is the peer's now) in a small
bounded table of *lent* segments, keyed by the segment's identity (device and inode of the memfd). When
the peer sends the same segment back (its tensor died, it went to the peer's pool, it staged a later
message into it), the mapping is taken from that table instead of mapping the segment again: in steady
state (the same sizes going back and forth) no mmap, page-table fill or munmap happens per message,
only the one copy-out per direction. A lent mapping keeps the segment's memory alive until it is
reclaimed or evicted (the table holds at most `POOL_SEGMENTS` segments and `POOL_BYTES` bytes).
Linux only (memfd_create); elsewhere every buffer travels in the byte stream.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import threading
from typing import Any

import numpy as np

MIN_BYTES = 1 << 20  # buffers of at least this size go through a segment
POOL_SEGMENTS = 8  # free segments kept per process
POOL_BYTES = 512 << 20  # and their bytes at most
_PAGE = mmap.PAGESIZE

available = hasattr(os, "memfd_create") and hasattr(mmap, "MAP_POPULATE")

_libc: Any = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


class Pool:
    """Free segments of this process, still mapped (pages populated, page tables filled): reusing one
    costs nothing but the copy. Thread-safe (segments come back from finalizers, which the garbage
    collector may run in any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[int, int, int, Any]] = []  # (fd, size, address of our mapping, identity)
        # segments given to a peer whose mapping we kept: identity -> (size, address)
        self._lent: collections.OrderedDict[Any, tuple[int, int]] = collections.OrderedDict()
        self._lent_bytes = 0
        self.created = 0
        self.reused = 0
        self.mapped = 0  # received segments mapped afresh
        self.reclaimed = 0  # received segments whose mapping was kept when we gave them away

    def take(self, nbytes: int) -> Mapping:
        """A mapped segment of at least ``nbytes`` (a free one of fitting size, else a new one)."""
        size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        got = None
        with self._lock:
            for i, (_fd, sz, _addr, _key) in enumerate(self._free):
                if size <= sz <= 2 * size:
                    got = self._free.pop(i)
                    break
        if got is not None:
            self.reused += 1
            return Mapping(got[0], got[1], self, got[2], got[3])
        fd = os.memfd_create("asyncgrad-rpc", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.created += 1
        return Mapping(fd, size, self)

    def put(self, fd: int, size: int, addr: int, key: Any) -> None:
        with self._lock:
            if len(self._free) < POOL_SEGMENTS and sum(f[1] for f in self._free) + size <= POOL_BYTES:
                self._free.append((fd, size, addr, key))
                return
        _lib().munmap(addr, size)
        os.close(fd)

    def lend(self, key: Any, size: int, addr: int) -> None:
        """Keep the mapping of a segment given away (the oldest lent ones are unmapped past the limits)."""
        evicted = []
        with self._lock:
            old = self._lent.pop(key, None)
            if old is not None:  # mapped twice (it came back while we still held the old mapping)
                self._lent_bytes -= old[0]
                evicted.append(old)
            if key is not None and size <= POOL_BYTES:
                self._lent[key] = (size, addr)
                self._lent_bytes += size
            else:
                evicted.append((size, addr))
            while len(self._lent) > POOL_SEGMENTS or self._lent_bytes > POOL_BYTES:
                _, old = self._lent.popitem(last=False)
                self._lent_bytes -= old[0]
                evicted.append(old)
        for sz, ad in evicted:
            _lib().munmap(ad, sz)

    def reclaim(self, key: Any, size: int) -> int | None:
        """The address of our kept mapping of a segment that came back, if we have one of ``size`` bytes."""
        with self._lock:
            got = self._lent.pop(key, None)
            if got is None:
                return None
            self._lent_bytes -= got[0]
        if got[0] != size:
            _lib().munmap(got[1], got[0])
            return None
        self.reclaimed += 1
        return got[1]

    def clear(self) -> None:
        """Unmap and close every free and lent segment (when the workers close: nothing left behind)."""
        with self._lock:
            free, self._free = self._free, []
            lent = list(self._lent.values())
            self._lent.clear()
            self._lent_bytes = 0
        for fd, size, addr, _key in free:
            _lib().munmap(addr, size)
            os.close(fd)
        for size, addr in lent:
            _lib().munmap(addr, size)

    @property
    def lent(self) -> int:
        """Segments given away whose mapping is kept for when they come back."""
        return len(self._lent)

    def __len__(self) -> int:
        return len(self._free)


pool = Pool()


class Mapping:
    """A memfd segment mapped into this process. Numpy views of it (``array()``) keep it alive; when the
    last one dies it goes back to the pool, still mapped, unless it was given away (then its mapping is
    kept among the pool's lent segments, for when the peer sends the segment back)."""

    __slots__ = ("__array_interface__", "__weakref__", "addr", "fd", "key", "pool", "size")

    def __init__(self, fd: int, size: int, owner: Pool | None, addr: int | None = None, key: Any = None) -> None:
        if addr is None:
            addr = _lib().mmap(
                None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_POPULATE, fd, 0
            )
            if addr is None or addr == _MAP_FAILED:
                err = ctypes.get_errno()
                os.close(fd)
                raise OSError(err, f"mmap of a shared segment failed: {os.strerror(err)}")
        if key is None:
            try:
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
            except OSError:
                key = None
        self.key = key
        self.addr = addr
        self.size = size
        self.fd: int | None = fd
        self.pool = owner
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (addr, False), "version": 3}

    def array(self, nbytes: int) -> np.ndarray:
        """A flat uint8 view of the first ``nbytes`` (it keeps the mapping alive)."""
        return np.asarray(self)[:nbytes]

    def given_away(self) -> None:
        """The descriptor was passed to another process (which owns the segment now): close ours."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        fd, self.fd = self.fd, None
        try:
            if self.pool is not None:
                if fd is not None:
                    self.pool.put(fd, self.size, self.addr, self.key)
                else:  # given away: keep the mapping for when the segment comes back
                    self.pool.lend(self.key, self.size, self.addr)
                return
            _libc.munmap(self.addr, self.size)
            if fd is not None:
                os.close(fd)
        except Exception:  # interpreter shutdown
            pass


def receive(fd: int, size: int) -> Mapping:
    """Map a segment received from a peer; it returns to this process's pool when its tensor dies."""
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if st.st_size < size:
        os.close(fd)
        raise ValueError(f"a shared segment of {st.st_size} bytes where {size} were announced")
    key = (st.st_dev, st.st_ino)
    addr = pool.reclaim(key, size)
    if addr is not None:  # one we gave away earlier, its mapping kept: no mmap, no page-table fill
        return Mapping(fd, size, pool, addr, key)
    pool.mapped += 1
    return Mapping(fd, size, pool, None, key)
