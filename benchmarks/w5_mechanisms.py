"""W5M: W5's training with its loss read every step (async form) beside the 1 ms heartbeat, under each
scheduling mechanism issue 22 names, side by side. Each run is a fresh process (the settings are per
thread or per process and must not leak into the next), interleaved round after round.

Mechanisms (what each run changes; "priv" = needs root or CAP_SYS_NICE):
- default: lanes at the loop's priority (``lane_nice=0``);
- nice10: lanes 10 nicer than the loop (``lane_nice=10``);
- loopslice: the loop thread asks for a 0.1 ms EEVDF slice (``sched_setattr`` ``sched_runtime``, Linux
  6.12+, unprivileged): a thread that wakes with a short slice gets an early deadline and preempts;
- lanebatch: lanes under SCHED_BATCH (unprivileged): they never preempt on wake-up;
- switch: ``sys.setswitchinterval(0.0005)`` (the default 5 ms is how long a thread waiting for the GIL
  waits before it asks the holder to drop it);
- blastimeout: ``OPENBLAS_THREAD_TIMEOUT=4`` (OpenBLAS's pool threads sleep almost at once instead of
  spinning; read when OpenBLAS loads, so set in the child's environment);
- loopnice (priv): the loop thread at nice -10.
Figures: heartbeat lateness p50/p99/max (ms), training seconds with the heartbeat, and the load average
at the run's start.
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
MECHANISMS = ["default", "nice10", "loopslice", "lanebatch", "switch", "blastimeout", "loopnice"]


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


def child(mode: str, steps: int) -> dict[str, Any]:
    import trio
    import w5_loop_stall as w5

    import asyncgrad as ag

    opts = {"lane_nice": 10} if mode == "nice10" else {}
    if mode == "switch":
        sys.setswitchinterval(0.0005)
    X, W0 = w5.arrays()

    def once(hb: bool) -> tuple[list[float], float]:
        late: list[float] = []
        busy: list[float] = []
        rec: dict[str, float] = {}

        async def main() -> None:
            if mode == "loopslice":
                set_slice(100_000)
            if mode == "loopnice":
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
            async with ag.open_runtime(**opts) as rt:
                if mode == "lanebatch":
                    for th in rt.threads():
                        os.sched_setscheduler(th.native_id or 0, os.SCHED_BATCH, os.sched_param(0))
                model = await w5.ag_model(X, W0)
                done = trio.Event()

                async def trainer() -> None:
                    rec["t"] = await w5.ag_train(steps, model, True)
                    done.set()

                async with trio.open_nursery() as n:
                    if hb:
                        n.start_soon(w5.heartbeat, late, busy, done)
                    n.start_soon(trainer)

        trio.run(main)
        return late, rec["t"]

    once(False)  # warm-up
    load = os.getloadavg()[0]
    late, t_hb = once(True)
    ms = sorted(x * 1e3 for x in late)
    return {"mode": mode, "p50": ms[len(ms) // 2], "p99": ms[int(len(ms) * 0.99)], "max": ms[-1],
            "ticks": len(ms), "train_s": t_hb, "load": load}


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
                f"load {d['load']:.1f}")
    rows = []
    out: dict[str, Any] = {"steps": steps, "rounds": rounds, "mechanisms": res}
    for m, ds in res.items():
        if not ds:
            rows.append([m, "FAILED"])
            continue
        rows.append([m, fmt(median([d["p50"] for d in ds])), fmt(median([d["p99"] for d in ds])),
                     fmt(median([d["max"] for d in ds])), fmt(max(d["max"] for d in ds)),
                     fmt(median([d["train_s"] for d in ds])), fmt(median([d["load"] for d in ds]))])
    say(table(["mechanism", "p50 ms", "p99 ms", "max ms", "worst max", "train s", "load"], rows))
    return out


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    print(json.dumps(child(sys.argv[1], int(sys.argv[2]))))
