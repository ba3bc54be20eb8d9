"""Lending idle cores to one BLAS call: switch a pthreads OpenBLAS to more threads for a single kernel.

Lanes run with one BLAS thread each so that concurrent trainings never oversubscribe the cores. A single
training then leaves the other lanes idle; for a big product the kernel asks OpenBLAS for one thread
per idle lane for that call only. OpenBLAS's own pool threads spin briefly and need no GIL, which
measured clearly faster on W1 than handing row blocks to the sibling lanes (`run_parts`).

OpenBLAS (pthreads) keeps one process-wide thread count, read when a call starts. A boost therefore
always ends by setting the *base* count (the runtime's per-lane setting) back, never "the previous
value": two lanes boosting at once (a race on who is idle) both end at the base, and a call already
running keeps the count it started with. Nothing here takes a lock.

While exactly one stream is in use in the whole process (one training, alone), the count stays at
every lane's threads for all its kernels (`set_demand`): the lone training then runs as a plain numpy
program with the default BLAS threads would, small products included, and pays no switch per call
(measured on W1: ~5% of a step against per-call boosts). The pools report their streams in use; the
lanes apply a changed count before their next kernel (`sync`), so a count set by a lane's start-up never
overwrites it. No lock: a pool reports from a finalizer too (a task's streams go back when it dies), which
the garbage collector may run inside any of these functions; a lane that read a target about to change
sees the difference before its next kernel and sets it again.

Neither happens while other processes keep the cores busy (`spare_cores`): a multi-threaded BLAS call
is a barrier across its threads, so with one of them waiting for a core every call waits for the
slowest (measured under load ~13 on 2 cores: a 64x256x256 product took 7.7 ms on 2 threads against
0.53 ms on 1, and W3's lone training ran 20x slower than two beside each other).

Threads of this process that are not the runtime's (a torch training in a thread, a user's worker
thread) count as other processes do: only the lanes, the loops that run devices and OpenBLAS's own
pool (the threads found when this module loads) are this runtime's (`own_threads`). Counted as ours,
one busy torch thread beside a lone training made it take both cores' BLAS threads and stall with
every call (LOAD's torch-thread rows).

Only OpenBLAS with its own pthreads pool is boosted: with an OpenMP or MKL BLAS the count is per thread
or managed elsewhere, and `boost_available()` is False (kernels then split across lanes instead).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

import numpy  # noqa: F401  (loads OpenBLAS, which starts its pool threads: see `_POOL`)

from .._openblas_env import SPIN_EXPONENT, SPIN_VAR

_NAMES = tuple(
    f"{prefix}openblas_set_num_threads{suffix}" for prefix in ("", "scipy_") for suffix in ("", "64_", "_64")
)

_setter: Any = None  # the C setter, once found; False when there is none to use
_base: int | None = None  # the per-lane count the lanes set (restored after every boost); None: unknown
_target: int | None = None  # the count lanes should run at: the base, or a lone stream's full count
_applied: int | None = None  # the count last set here (None: unknown, set by someone else)
_demand: dict[int, tuple[int, int]] = {}  # id(pool) -> (its streams in use, what a lone stream of it gets)
# taken only to change the count (a stream taken or returned, a boost ended), never on a kernel's path: the
# C call and the record of what it set must not interleave with another thread's pair, or the record says
# one count while OpenBLAS runs another until the next change (W3's runtimes in threads kept every product on
# two BLAS threads while the record said one: 2.5-2.8 s against 1.1 s, the pool spinning)
_count_lock = threading.Lock()
_CORES = os.cpu_count() or 1  # read once: every stream taken or returned asks (a file read each time otherwise)

# ---- how many cores other processes leave us -------------------------------------------------------

SAMPLE_S = 0.25  # how often a lane re-reads the machine's load (two counters, ~20 us)
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_spare: float = float(_CORES)  # cores not busy with other processes, as last sampled
_next_sample = 0.0  # when a lane should sample again (time.monotonic); inf: no /proc/stat here
_sample_lock = threading.Lock()  # one lane samples at a time (taken without blocking)
_last: tuple[float, float, float] | None = None  # (monotonic, machine busy s, this process's cpu s)
_pinned = False  # `pin_spare_cores` set the estimate: no sampling
_own: dict[int, int] = {}  # native thread id -> how many devices count it as theirs (lanes, loops)
_foreign_seen: dict[int, int] = {}  # another thread of this process -> its CPU ns at the last sample
_foreign_total = 0.0  # CPU seconds those threads used while sampled, summed


def _threads_now() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


# OpenBLAS starts its pool when numpy loads it (imported above): those threads run the lanes'
# multi-threaded calls, so their CPU is this runtime's
_POOL = _threads_now() - {threading.get_native_id()}


def own_threads(tids: list[int], add: bool) -> None:
    """(loop thread) A device's lanes and its loop thread start (``add``) or stop counting as its own.

    When the last device stops, the sampling window closes: the next runtime's first lane opens a new one
    (`set_base`). A window spanning the time no runtime ran would count this process's other work then (a
    torch step between two runtimes, its OpenMP threads are not the runtime's) as load the next runtime
    meets; the estimate it keeps is the last one taken while a runtime ran.
    """
    global _last
    for t in tids:
        n = _own.get(t, 0) + (1 if add else -1)
        if n > 0:
            _own[t] = n
        else:
            _own.pop(t, None)
    if not _own:
        _last = None


def _pthreads_openblas() -> list[Any]:
    """threadpoolctl's controllers of the pthreads OpenBLAS libraries loaded in this process (none without
    threadpoolctl)."""
    try:
        from threadpoolctl import ThreadpoolController

        return [
            lib
            for lib in ThreadpoolController().lib_controllers
            if (info := lib.info()).get("internal_api") == "openblas" and info.get("threading_layer") == "pthreads"
        ]
    except Exception:  # no threadpoolctl, or an unusual build
        return []


# OpenBLAS's pool threads spin for 2**28 TSC cycles (about 0.1 s) after each multi-threaded call before
# they sleep. A lone training alternates products on every lane's BLAS threads with kernels split across
# the lanes (`ops._slices`), and a pool thread spinning meanwhile holds the core a sibling lane's slice
# needs: W9's MNIST CNN in a default runtime took 92 ms per step and 179 ms of CPU, one lane alone 98 ms;
# with a 2**18-cycle spin, 59 ms and 102 ms. A spin that short lets the pool fall asleep between W1's
# products, and waking it costs more than the spin saves (W1 against the default spin, 9 alternating
# rounds: 2**18 0.66-0.85x, 2**20 0.78x, 2**22 0.86-0.97x); 2**22 cycles (~1.6 ms at 2.6 GHz) keeps most
# of the CNN's gain. OpenBLAS reads the spin once, from OPENBLAS_THREAD_TIMEOUT, when it starts its pool,
# so `import asyncgrad` sets it while it loads numpy (`asyncgrad._openblas_env`); with numpy loaded before,
# the first device to start restarts the pool with this spin (before any lane exists, and only while no
# other Python thread runs: a restart joins the pool's threads under a product in flight). A user's own
# OPENBLAS_THREAD_TIMEOUT is kept (28 gives OpenBLAS's default back).
POOL_SPIN_EXPONENT = SPIN_EXPONENT  # set in `asyncgrad._openblas_env`, which numpy loads under
_spin_lock = threading.Lock()
_spin_checked = False


def shorten_pool_spin() -> bool:
    """(loop thread, before a device starts its lanes) Restart a pthreads OpenBLAS pool so that its
    threads spin `POOL_SPIN_EXPONENT` (log2 cycles) before they sleep; once per process.

    Returns True when this call restarted the pool. Nothing happens with another BLAS, when the pool has a
    spin set already (the user's OPENBLAS_THREAD_TIMEOUT, or asyncgrad's when its import loaded numpy), or
    after the first call. The restart joins the pool's threads, so it is skipped while another Python
    thread runs (it might be inside a product); a process's first runtime has no lanes yet.
    """
    global _spin_checked, _POOL
    with _spin_lock:
        if _spin_checked:
            return False
        _spin_checked = True
        if SPIN_VAR in os.environ or threading.active_count() > 1:
            return False
        restarted = False
        for lib in _pthreads_openblas():
            dl = lib.dynlib
            names = ("openblas_thread_timeout", "openblas_read_env", "blas_thread_shutdown_", "blas_thread_init")
            if not all(hasattr(dl, n) for n in names) or dl.openblas_thread_timeout() > 0:
                continue
            # openblas_read_env re-reads every OPENBLAS_* setting; only the timeout differs from the ones read
            # at load (the others matter only then), and the process's environment is left as it was
            os.environ[SPIN_VAR] = str(POOL_SPIN_EXPONENT)
            try:
                dl.openblas_read_env()
            finally:
                del os.environ[SPIN_VAR]
            before = _threads_now()
            dl.blas_thread_shutdown_()
            gone = before - _threads_now()
            dl.blas_thread_init()
            started = _threads_now() - (before - gone)  # (a tid of `gone` the kernel gave a new thread counts)
            gone |= _vanished(before, (_POOL & before) - gone)
            _POOL = (_POOL - gone) | started  # the new pool threads are this runtime's, as the old ones were
            restarted = True
        return restarted


def _vanished(before: set[int], left: set[int], wait_s: float = 0.005) -> set[int]:
    """The threads of ``before`` no longer listed, looking again for up to ``wait_s`` while some of ``left``
    (old pool threads not yet seen gone) are: a thread `blas_thread_shutdown_` joined can still be listed in
    /proc/self/task for a moment while the kernel tears it down, and kept in `_POOL` it would stay counted
    as ours (a foreign thread listed since import keeps the wait at its bound, once per process)."""
    deadline = time.monotonic() + wait_s
    while True:
        gone = before - _threads_now()
        if not (left - gone) or time.monotonic() >= deadline:
            return gone
        time.sleep(0.0002)


def _foreign_cpu_s() -> float:
    """CPU seconds this process's other threads (not lanes, loops or the BLAS pool) used since the last
    call (Linux schedstat; 0 elsewhere). A thread seen for the first time counts from then on."""
    if not _own:
        return 0.0
    used = 0
    seen: dict[int, int] = {}
    for t in _threads_now():
        if t in _own or t in _POOL:
            continue
        try:
            with open(f"/proc/self/task/{t}/schedstat", "rb") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        used += ns - _foreign_seen.get(t, ns)
        seen[t] = ns
    _foreign_seen.clear()
    _foreign_seen.update(seen)
    return used * 1e-9


def _machine_busy_s() -> float | None:
    """CPU seconds all processes have used since boot (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    vals = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(vals) - vals[3] - vals[4]) / _HZ


def sample() -> None:
    """(lane, between kernels) Re-estimate the cores other processes leave us, every `SAMPLE_S` at most.

    The machine's busy time less this process's own, over the interval since the last sample: what
    other processes used (and this process's threads that are not the runtime's). A changed estimate
    re-targets the lanes' BLAS count.
    """
    global _next_sample, _last, _spare, _foreign_total
    if _pinned or not _sample_lock.acquire(blocking=False):
        return
    try:
        now = time.monotonic()
        busy = _machine_busy_s()
        if busy is None:
            _next_sample = float("inf")
            return
        _foreign_total += _foreign_cpu_s()
        t = os.times()
        own = t.user + t.system - _foreign_total  # this runtime's threads only (see `own_threads`)
        last, _last = _last, (now, busy, own)
        _next_sample = now + SAMPLE_S
        if last is None or now - last[0] < SAMPLE_S / 2:
            return
        others = max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])
        before = spare_cores()
        _spare = max(0.0, _CORES - others)
        if spare_cores() != before:
            _retarget()
    finally:
        _sample_lock.release()


def pin_spare_cores(cores: int | None) -> None:
    """Take ``cores`` as the cores other processes leave, without sampling (None: sample again).

    For a machine known to be this process's alone, and for tests of the lone-training count that must
    not depend on what else the machine runs.
    """
    global _spare, _next_sample, _last, _pinned
    _pinned = cores is not None
    if cores is None:
        _spare, _next_sample, _last = float(_CORES), 0.0, None
    else:
        _spare, _next_sample = float(cores), float("inf")
    _retarget()


def spare_cores() -> int:
    """Whole cores other processes leave this one, as last sampled (all of them where it cannot tell).

    A quarter of a core busy elsewhere already counts as taken: a BLAS thread that has to share its core
    stalls every call of its team.
    """
    return max(1, min(_CORES, int(_spare + 0.25)))


def _find_setter() -> Any:
    for lib in _pthreads_openblas():
        for name in _NAMES:
            fn = getattr(lib.dynlib, name, None)
            if fn is not None:
                # a store of one int: called without letting go of the GIL (a ctypes call through a CDLL
                # lets go of it, and a lane getting it back beside a busy loop waits, see `axpy`)
                return _holding(fn, None, [ctypes.c_int])
    return False  # no threadpoolctl, no pthreads OpenBLAS found, or an unusual build: no boosting


def boost_available() -> bool:
    """True when this process's BLAS is a pthreads OpenBLAS whose thread count can be switched per call
    and lanes set a base count to return to."""
    global _setter
    if _base is None:
        return False
    if _setter is None:
        _setter = _find_setter()
    return _setter is not False


def set_base(threads: int) -> None:
    """Record the per-lane thread count that every boost returns to (called by a lane starting, after it
    set that count itself)."""
    global _base, _applied, _setter
    if _setter is None:
        _setter = _find_setter()
    with _count_lock:
        _base = max(1, threads)
        # the lane set the count itself, but a lane of another runtime may have set another since: unknown,
        # so the next `sync` sets the target whatever it is
        _applied = None
    if _last is None:
        sample()  # the first reading: the load is known from the next one on
    _retarget()


def set_demand(key: int, in_use: int, solo_threads: int) -> None:
    """A stream pool (``key``) has ``in_use`` streams taken; a lone stream of it may use ``solo_threads``.

    Called on the loop thread when a task takes or returns a stream (and with 0 when its device stops).
    The lanes pick the resulting count up before their next kernel (`sync`).
    """
    if in_use > 0:
        _demand[key] = (in_use, min(solo_threads, _CORES))
    else:
        _demand.pop(key, None)
    _retarget()


def streams_in_use() -> int:
    """Streams in use over every CPU device of the process (all runtimes), as their demands say."""
    return sum(n for n, _ in list(_demand.values()))  # a snapshot: loops of other threads may change it


def _retarget() -> None:
    global _target
    if _base is None or not _setter:
        _target = None  # no count to switch: kernels split across idle lanes instead
        return
    users = list(_demand.values())  # a snapshot: a finalizer may change the dict meanwhile
    if len(users) == 1 and users[0][0] == 1:
        _target = max(_base, min(users[0][1], spare_cores()))
    else:
        _target = _base


def solo() -> bool:
    """True while one lone stream has every lane's BLAS threads (no boost needed, none wanted)."""
    t = _target
    return t is not None and _base is not None and t > _base


def sync() -> None:
    """(lane, before a kernel) Set the count the demand asks for, when it changed; a compare otherwise."""
    global _applied
    if _target == _applied:
        return
    with _count_lock:
        t = _target
        if _setter and t is not None:
            _setter(t)
        _applied = t


def boosted(threads: int) -> None:
    """Use ``threads`` BLAS threads for calls starting from now.

    Only after `boost_available()` said True; call `unboost` right after the kernel. At most the cores
    other processes leave (`spare_cores`).
    """
    _setter(max(1, min(threads, spare_cores())))


def unboost() -> None:
    """Back to the count the lanes run at now: the base, or a lone stream's full count (`solo`).

    A lone stream's kernel that shares slices with an idle lane runs them on one BLAS thread each
    (`ops._slices`), and the rest of its lane job (the next backward rules run in the same job) must get
    its full count back here: left at the base until the next job, W9's LSTM ran its decoder's backward
    products, which follow the sliced cross-entropy in one job, on one thread.
    """
    global _applied
    if _setter and _base is not None:
        with _count_lock:
            t = _target if _target is not None else _base  # the target is the base unless a lone stream runs
            _setter(t)
            _applied = t


# ---- y += alpha * x in one pass (BLAS axpy) ----------------------------------------------------------

_axpy: dict[Any, Any] | None = None  # dtype -> (C function, the same keeping the GIL); {} when none was found
# axpys of at most this many elements keep the GIL while they run (~10 us of work at most on one core,
# less than a GIL hand-off beside a busy thread); bigger ones let go of it, as numpy's kernels do. Above
# `_AXPY_ONE_THREAD_MAX` only while the count is one BLAS thread: OpenBLAS splits a bigger axpy across its
# threads, and a call waiting for a pool thread without a core would hold the GIL (and the loop) meanwhile
AXPY_HOLD_MAX_ELEMENTS = 1 << 16
_AXPY_ONE_THREAD_MAX = 10_000  # OpenBLAS runs an axpy this small on the calling thread alone


def _holding(fn: Any, restype: Any, argtypes: list[Any]) -> Any:
    """The C function ``fn`` called without letting go of the GIL (ctypes' Python calling convention)."""
    address = ctypes.cast(fn, ctypes.c_void_p).value
    assert address is not None
    return ctypes.PYFUNCTYPE(restype, *argtypes)(address)


def _find_axpy() -> dict[Any, Any]:
    import numpy as np

    found: dict[Any, Any] = {}
    try:
        from threadpoolctl import ThreadpoolController

        for lib in ThreadpoolController().lib_controllers:
            if lib.info().get("internal_api") != "openblas":
                continue
            for letter, dtype, ctype in (("s", np.float32, ctypes.c_float), ("d", np.float64, ctypes.c_double)):
                for prefix in ("", "scipy_"):
                    for suffix, itype in (("", ctypes.c_int), ("64_", ctypes.c_int64)):
                        fn = getattr(lib.dynlib, f"{prefix}cblas_{letter}axpy{suffix}", None)
                        if fn is not None and np.dtype(dtype) not in found:
                            argtypes = [itype, ctype, ctypes.c_void_p, itype, ctypes.c_void_p, itype]
                            fn.argtypes = argtypes
                            fn.restype = None
                            found[np.dtype(dtype)] = (fn, _holding(fn, None, argtypes))
            break
    except Exception:  # no threadpoolctl or an unusual build: numpy's two-pass form instead
        return {}
    return found


def axpy(alpha: float, x: Any, y: Any) -> bool:
    """``y += alpha * x`` in place, in one pass over memory with OpenBLAS's axpy (no temporary ``alpha * x``).

    Only for equal-shaped, C-contiguous float32/float64 arrays of one dtype that do not overlap, with
    y writeable; returns False (and does nothing) otherwise or without an OpenBLAS, and the caller then
    uses numpy. A big call lets go of the GIL while it runs, as numpy's kernels do; a small one keeps it.
    """
    global _axpy
    if _axpy is None:
        _axpy = _find_axpy()
    fns = _axpy.get(x.dtype)
    if (
        fns is None
        or y.dtype != x.dtype
        or y.shape != x.shape
        or not (x.flags.c_contiguous and y.flags.c_contiguous and y.flags.writeable)
    ):
        return False
    n = y.size
    if not n:
        return True
    # both contiguous and of one size: they overlap exactly when their byte ranges do (a compare here, where
    # np.may_share_memory would let go of the GIL, see below)
    xa, ya, nbytes = x.ctypes.data, y.ctypes.data, y.nbytes
    if xa < ya + nbytes and ya < xa + nbytes:
        return False
    # a small one keeps the GIL: letting go of it for a few microseconds of work costs a hand-off whenever
    # another thread wants it meanwhile (the loop recording, another lane), and getting it back then waits
    # for that thread to let go (measured beside a busy Python thread: 27.5 us per 256-element call letting
    # go, 5.6 us keeping it; 7.3 us alone either way)
    hold = n <= _AXPY_ONE_THREAD_MAX or (n <= AXPY_HOLD_MAX_ELEMENTS and _applied == 1)
    (fns[1] if hold else fns[0])(n, alpha, xa, 1, ya, 1)
    return True


# below this many elements `add_scaled` takes numpy's two passes: they keep the GIL as the axpy would (numpy
# lets go of it only for loops over 500 elements) and cost ~1 us against the axpy's ~3.5 (mostly getting its
# two pointers through `.ctypes`); a char GPT has 20 such parameters of its 29 (biases, norms)
_AXPY_MIN_ELEMENTS = 501


def add_scaled(a: Any, alpha: Any, o: Any) -> None:
    """``a += alpha * o`` in place: one BLAS pass when the arrays allow it (no temporary), else numpy."""
    import numpy as np

    if not (isinstance(o, np.ndarray) and o.size >= _AXPY_MIN_ELEMENTS and axpy(alpha, o, a)):
        np.add(a, alpha * o, out=a, casting="unsafe")
