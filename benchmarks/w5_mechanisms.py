"""W5M: W5's training with its loss read every step (async form) beside the 1 ms heartbeat, under each
scheduling mechanism issue 22 names, side by side. Each run is a fresh process (the settings are per
thread or per process and must not leak into the next), interleaved round after round.

Mechanisms (what each run changes; "priv" = needs root or CAP_SYS_NICE). "default" is `open_runtime`'s
defaults; every other run starts from the kernel's slice for the loop (``loop_slice_s=None``) and changes
one thing:
- default: lanes at the loop's priority (``lane_nice=0``), the loop asking for a 0.3 ms slice;
- kernelslice: the default lanes, the loop on the kernel's slice (the default before the 0.3 ms one);
- nice10: lanes 10 nicer than the loop (``lane_nice=10``); nice2, nice5: 2 and 5 nicer;
- loopslice: the loop thread asks for a 0.1 ms EEVDF slice (``sched_setattr`` ``sched_runtime``, Linux
  6.12+, unprivileged): a thread that wakes with a short slice gets an early deadline and preempts;
  slice300, slice500: 0.3 and 0.5 ms; slicenice3: 0.1 ms and ``lane_nice=3``;
- slicewait: a 0.1 ms slice only while the loop sleeps in epoll (a trio instrument around each wait
  with a timeout), the kernel's while it runs;
- poolidle: OpenBLAS's pool threads (every thread but the loop and the lanes) under SCHED_IDLE, so a
  waking loop preempts them at once; slicepoolidle: that and a 0.1 ms slice; poolnice10: them at nice 10;
- lanebatch: lanes under SCHED_BATCH (unprivileged): they never preempt on wake-up;
- switch: ``sys.setswitchinterval(0.0005)`` (the default 5 ms is how long a thread waiting for the GIL
  waits before it asks the holder to drop it);
- blastimeout: ``OPENBLAS_THREAD_TIMEOUT=4`` (OpenBLAS's pool threads sleep almost at once instead of
  spinning; read when OpenBLAS loads, so set in the child's environment);
- loopnice (priv): the loop thread at nice -10.
Figures: heartbeat lateness p50/p99/max (ms), training seconds with the heartbeat, the load average
at the run's start, the cores other processes kept busy during the run, and the share of the worst 1%
of ticks the loop spent runnable without a core (W5's `RunQueueClock`).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
from typing import Any

from _common import fmt, median, say, table

HERE = os.path.dirname(os.path.abspath(__file__))
MECHANISMS = ["default", "kernelslice", "nice10", "loopslice", "lanebatch", "switch", "blastimeout", "loopnice",
              "nice2", "nice5", "slicenice3", "slicewait", "poolidle", "poolnice10", "slicepoolidle", "slice300",
              "slice500"]


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64), ("util_min", ctypes.c_uint32), ("util_max", ctypes.c_uint32)]


def set_slice(ns: int, tid: int = 0) -> None:
    """Ask for an EEVDF slice of ``ns`` for thread ``tid`` (0: the caller); x86-64 Linux syscalls."""
    libc = ctypes.CDLL(None, use_errno=True)
    a = _SchedAttr()
    if libc.syscall(315, tid, ctypes.byref(a), ctypes.sizeof(a), 0):  # sched_getattr
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    a.size, a.sched_runtime, a.sched_flags = ctypes.sizeof(a), ns, 0
    if libc.syscall(314, tid, ctypes.byref(a), 0):  # sched_setattr
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


class _SliceWhileWaiting:
    """A trio instrument: a 0.1 ms slice while the loop sleeps in epoll, the kernel's while it runs."""

    def __init__(self) -> None:
        a = _SchedAttr()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(315, 0, ctypes.byref(a), ctypes.sizeof(a), 0)
        self.base = int(a.sched_runtime)

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            set_slice(100_000)

    def after_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            set_slice(self.base)


def _pool_threads(mode: str, lanes: set[int | None]) -> None:
    """OpenBLAS's pool threads (every thread but the main one and the lanes) to SCHED_IDLE or nice 10."""
    me = threading.get_native_id()
    for t in os.listdir("/proc/self/task"):
        tid = int(t)
        if tid in lanes or tid == me or tid == os.getpid():
            continue
        if mode == "poolnice10":
            os.setpriority(os.PRIO_PROCESS, tid, 10)
        else:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def child(mode: str, steps: int) -> dict[str, Any]:
    import trio
    import w5_loop_stall as w5

    import asyncgrad as ag

    # every mechanism but "default" runs on the kernel's slice unless it names one (one mechanism at a time)
    opts: dict[str, Any] = {} if mode == "default" else {"loop_slice_s": None}
    lane_nice = {"nice10": 10, "nice2": 2, "nice5": 5, "slicenice3": 3}
    if mode in lane_nice:
        opts["lane_nice"] = lane_nice[mode]
    loop_slice = {"loopslice": 0.0001, "slicenice3": 0.0001, "slicepoolidle": 0.0001, "slice300": 0.0003,
                  "slice500": 0.0005}
    if mode in loop_slice:
        opts["loop_slice_s"] = loop_slice[mode]
    instruments: list[Any] = [_SliceWhileWaiting()] if mode == "slicewait" else []
    if mode == "switch":
        sys.setswitchinterval(0.0005)
    X, W0 = w5.arrays()

    def once(hb: bool) -> tuple[list[float], dict[str, float]]:
        late: list[float] = []
        busy: list[float] = []
        waits: list[float] = []
        rec: dict[str, float] = {}

        async def main() -> None:
            if mode == "loopnice":
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
            async with ag.open_runtime(**opts) as rt:
                if mode == "lanebatch":
                    for th in rt.threads():
                        os.sched_setscheduler(th.native_id or 0, os.SCHED_BATCH, os.sched_param(0))
                if mode in ("poolidle", "poolnice10", "slicepoolidle"):
                    _pool_threads(mode, {th.native_id for th in rt.threads()})
                model = await w5.ag_model(X, W0)
                done = trio.Event()

                async def trainer() -> None:
                    others = w5.OthersBusy()
                    rec["t"] = await w5.ag_train(steps, model, True)
                    rec["others"] = others.cores()
                    done.set()

                async with trio.open_nursery() as n:
                    if hb:
                        n.start_soon(w5.heartbeat, late, busy, done, waits)
                    n.start_soon(trainer)

        trio.run(main, instruments=instruments)
        rec["runq"] = w5.tail_runq_share(late, waits, w5.TICK)
        return late, rec

    once(False)  # warm-up
    load = os.getloadavg()[0]
    late, r = once(True)
    ms = sorted(x * 1e3 for x in late)
    return {"mode": mode, "p50": ms[len(ms) // 2], "p99": ms[int(len(ms) * 0.99)], "max": ms[-1],
            "ticks": len(ms), "train_s": r["t"], "load": load, "others": r["others"], "tail_runq": r["runq"]}


def run(quick: bool = False, modes: list[str] | None = None) -> dict[str, Any]:
    modes = modes or MECHANISMS
    rounds, steps = (1, 2) if quick else (2, 3)
    say(f"W5M: W5 (loss read async each step) x {steps} steps beside a 1 ms heartbeat, per mechanism; "
        f"{rounds} interleaved round(s), one process per run")
    res: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(rounds):
        k = r % len(modes)
        for m in modes[k:] + modes[:k]:
            env = dict(os.environ)
            if m == "blastimeout":
                env["OPENBLAS_THREAD_TIMEOUT"] = "4"
            p = subprocess.run([sys.executable, os.path.abspath(__file__), m, str(steps)], capture_output=True,
                               text=True, env=env, timeout=900)
            if p.returncode:
                say(f"  {m}: FAILED {p.stderr.strip().splitlines()[-1:]}")
                continue
            d = json.loads(p.stdout.strip().splitlines()[-1])
            res[m].append(d)
            say(f"  {m}: p99 {d['p99']:.2f} ms, max {d['max']:.1f} ms, train {d['train_s']:.1f} s, "
                f"load {d['load']:.1f}, other processes' cores {d['others']:.2f}, worst 1% of ticks "
                f"{d['tail_runq'] * 100:.0f}% waiting for a core")
    rows = []
    out: dict[str, Any] = {"steps": steps, "rounds": rounds, "mechanisms": res}
    for m, ds in res.items():
        if not ds:
            rows.append([m, "FAILED"])
            continue
        rows.append([m, fmt(median([d["p50"] for d in ds])), fmt(median([d["p99"] for d in ds])),
                     fmt(median([d["max"] for d in ds])), fmt(max(d["max"] for d in ds)),
                     fmt(median([d["train_s"] for d in ds])), fmt(median([d["load"] for d in ds])),
                     fmt(median([d["others"] for d in ds])), f"{median([d['tail_runq'] for d in ds]) * 100:.0f}%"])
    say(table(["mechanism", "p50 ms", "p99 ms", "max ms", "worst max", "train s", "load", "others' cores",
               "tail runq"], rows))
    return out


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    print(json.dumps(child(sys.argv[1], int(sys.argv[2]))))
