"""W9's per-kernel profile: where a training step of each W9 model spends its kernel time, op by op.

    python benchmarks/w9_profile.py [gpt cnn lstm] [--steps N] [--threads T] [--cprofile]

Wraps every registered op's forward kernel and backward rule with a timer, trains ``--steps`` steps in a
runtime with one lane and one BLAS thread (so kernels run one at a time and their times add up to the
step's kernel time), and prints ms per step per op (forward, backward) beside the step's wall time.
``--cprofile`` also prints the top functions of the whole process (recording, dispatch and kernels).
Point ``ASYNCGRAD_BENCH_ROOT`` at another checkout to profile its kernels (before/after a change).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import sys
import threading
import time
import warnings
from typing import Any

from _common import say, steady_malloc, table


def _instrument() -> dict[str, list[float]]:
    from asyncgrad.runtime._op import OPS

    spent: dict[str, list[float]] = collections.defaultdict(list)
    lock = threading.Lock()

    def timed(label: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                d = time.perf_counter() - t
                with lock:
                    spent[label].append(d)

        return wrapper

    for name, op in OPS.items():
        op.kernel = timed(name, op.kernel)
        if op.rule is not None:
            op.rule = timed(name + " (backward)", op.rule)
    return spent


def profile(model: str, steps: int, use_cprofile: bool, threads: int = 1) -> None:
    import trio
    import w9_real_models as w9

    import asyncgrad as ag

    warnings.filterwarnings("ignore", message=".*blocked the trio event loop.*")
    weights = w9.init_weights(model)
    spent = _instrument()
    prof = cProfile.Profile() if use_cprofile else None

    async def main() -> float:
        async with ag.open_runtime(lanes=1, blas_threads=threads):
            s = w9.AgStep(model, weights)
            for _ in range(2):
                await s.step()
            await s.sync()
            spent.clear()
            if prof:
                prof.enable()
            t = time.perf_counter()
            for _ in range(steps):
                await s.step()
            await s.sync()
            wall = time.perf_counter() - t
            if prof:
                prof.disable()
            return wall

    wall = trio.run(main)
    # on a loaded machine a kernel's sum is swamped by the times its thread was descheduled; the median
    # call times the calls per step is robust to that, so it is the figure to compare before/after
    rows = []
    tot_sum = tot_med = 0.0
    for k, ds in sorted(spent.items(), key=lambda kv: -statistics.median(kv[1]) * len(kv[1])):
        med = statistics.median(ds) * len(ds) / steps
        tot_sum += sum(ds) / steps
        tot_med += med
        rows.append([k, str(len(ds) // steps), f"{med * 1e3:.3f}", f"{sum(ds) * 1e3 / steps:.3f}"])
    say(f"{model}: {wall * 1e3 / steps:.2f} ms/step wall; kernels+rules {tot_med * 1e3:.2f} ms/step by median "
        f"call, {tot_sum * 1e3:.2f} summed (lanes=1, {threads} BLAS thread(s), {steps} steps)")
    say(table(["op", "calls/step", "ms/step (median call x calls)", "ms/step (sum)"], rows))
    if prof:
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["gpt", "cnn", "lstm"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads of the one lane (default 1)")
    args = ap.parse_args()
    say(steady_malloc())  # as the W9 runner does: no fresh pages per big temporary
    for m in args.models:
        profile(m, args.steps, args.cprofile, args.threads)


if __name__ == "__main__":
    main()
