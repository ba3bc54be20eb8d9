"""The event loop thread's scheduling while a runtime is open: a short EEVDF slice, and on request a
raised priority (`open_runtime`'s ``loop_slice_s`` and ``loop_nice``).

Linux's fair scheduler (EEVDF, 6.6+) gives each thread a virtual deadline of its eligible time plus its
slice; since 6.12 a thread may ask for its own slice (``sched_setattr``'s ``sched_runtime``, 0.1-100 ms,
unprivileged). A thread that sleeps often and asks for a short slice gets an early deadline when it
wakes, so it preempts a thread that is running out a long one: the loop, woken by a timer or a socket,
runs sooner beside the lanes and beside other busy processes. It changes nothing about the CPU share
(the nice weight), so the lanes keep theirs. Older kernels ignore the field; elsewhere nothing is done.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from collections.abc import Callable

# (sched_setattr, sched_getattr) syscall numbers
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("util_min", ctypes.c_uint32),
        ("util_max", ctypes.c_uint32),
    ]


def _no_restore() -> None:
    pass


def thread_slice_ns(tid: int = 0) -> int | None:
    """The slice thread ``tid`` (0: the caller) asked for, in ns (the kernel's default if none), or None
    where it cannot be read."""
    calls = _SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None
    if calls is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    a = _SchedAttr()
    if libc.syscall(calls[1], tid, ctypes.byref(a), ctypes.sizeof(a), 0):
        return None
    return int(a.sched_runtime)


def _set_slice(ns: int) -> bool:
    calls = _SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None
    if calls is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    a = _SchedAttr()
    if libc.syscall(calls[1], 0, ctypes.byref(a), ctypes.sizeof(a), 0):
        return False
    if a.sched_policy not in (os.SCHED_OTHER, os.SCHED_BATCH):  # real-time or idle: leave it alone
        return False
    a.size, a.sched_flags, a.sched_runtime = ctypes.sizeof(a), 0, ns
    return libc.syscall(calls[0], 0, ctypes.byref(a), 0) == 0


def shorten_slice(seconds: float | None) -> Callable[[], None]:
    """Ask for a ``seconds`` slice for the calling thread; returns what puts the previous one back.

    Best effort: where the kernel or platform has no such setting, nothing changes.
    """
    if seconds is None:
        return _no_restore
    if not 0 < seconds <= 0.1:
        raise ValueError(f"loop_slice_s={seconds}: a slice is between 0.0001 and 0.1 s (or None)")
    before = thread_slice_ns()
    if before is None or not _set_slice(max(100_000, int(seconds * 1e9))):
        return _no_restore
    tid = threading.get_native_id()

    def restore() -> None:
        if threading.get_native_id() == tid:
            _set_slice(before)

    return restore


def raise_priority(nice: int | None) -> Callable[[], None]:
    """Set the calling thread's nice value (Linux keeps one per thread); returns what restores it."""
    if nice is None:
        return _no_restore
    if not sys.platform.startswith("linux"):
        raise ValueError(f"loop_nice={nice}: a per-thread nice value needs Linux (here: {sys.platform})")
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError as e:
        raise PermissionError(
            f"open_runtime(loop_nice={nice}): this process may not raise its priority (nice {before} -> "
            f"{nice} needs root, CAP_SYS_NICE or an RLIMIT_NICE that allows it); leave loop_nice at None, "
            "or grant it, e.g. `setcap cap_sys_nice+ep` on the interpreter or `ulimit -e` in the shell"
        ) from e

    def restore() -> None:
        if threading.get_native_id() == tid:  # lowering back is always permitted
            os.setpriority(os.PRIO_PROCESS, tid, before)

    return restore
