"""Old code against new, side by side: ``bench.py --compare-with DIR W1 W2``.

Each round runs asyncgrad's contender of W1 (steps/s of the MLP step) and W2 (us per node of the elementwise
chain) in fresh interpreters, alternating between this checkout and ``DIR`` (another checkout, e.g. a
``git worktree`` of an older commit), so that both see the same machine at nearly the same time. W1 takes the
fastest of five 60-step blocks in each interpreter. Reports
the median of the per-round ratios new/old (>1 is faster for W1's steps/s; for W2, old/new so that >1 is
faster too). The workload code is this checkout's; only the imported asyncgrad differs.

With ``--instructions`` it also counts the instructions each code runs (valgrind's callgrind, which counts
the same for the same work however loaded the machine is), on one lane and one BLAS thread (a BLAS team spins
while it waits, and callgrind would count the spinning); each workload at two lengths, so the difference is
the instructions of the extra W1 steps or W2 chains alone, not of starting Python and importing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from _common import CHILD, HERE, median, run_child, say, table

ROUNDS = 9
BLOCKS = 5  # W1 blocks of 60 steps per fresh interpreter


def w1_rate() -> float:
    import time

    from w1_mlp_step import ag_run

    async def go(m: Any, rt: Any) -> float:
        for _ in range(10):
            await m.step()
        # the best of several blocks in one runtime: a neighbour on this shared machine only ever slows a
        # block, so the fastest block is the steadiest estimate of what the code itself costs
        best = 0.0
        for _ in range(BLOCKS):
            t = time.perf_counter()
            for _ in range(60):
                await m.step()
            await m.sync()
            best = max(best, 60 / (time.perf_counter() - t))
        return best

    return float(ag_run(None, go))


def w2_us() -> float:
    from w2_node_overhead import N, ag_repeat

    best = min(ag_repeat(warm=1)[0] for _ in range(3))
    return best / N * 1e6


def w1_steps(n: int) -> int:
    """(callgrind child) W1's step ``n`` times after 3 warm-up steps, one lane and one BLAS thread."""
    import trio
    from w1_mlp_step import AgMLP

    import asyncgrad as ag

    async def main() -> None:
        async with ag.open_runtime(lanes=1, blas_threads=1):
            m = AgMLP()
            for _ in range(3):
                await m.step()
            for _ in range(n):
                await m.step(wait=False)
            await m.sync()

    trio.run(main)
    return n


def w2_chains(n: int) -> int:
    """(callgrind child) W2's chain, forward and backward, ``n`` times after one warm-up, one lane."""
    import trio
    from w2_node_overhead import ag_chain

    import asyncgrad as ag

    async def main() -> None:
        async with ag.open_runtime(lanes=1, blas_threads=1):
            for _ in range(n + 1):
                await ag_chain()

    trio.run(main)
    return n


def w2_replays(n: int) -> int:
    """(callgrind child) W2's chain as one `ag.compile` step, replayed ``n`` times after the eager call and
    the recording, one lane."""
    import numpy as np
    import trio
    from w2_node_overhead import compiled_chain

    import asyncgrad as ag

    async def main() -> None:
        async with ag.open_runtime(lanes=1, blas_threads=1):
            x, step = compiled_chain()
            for _ in range(n + 2):
                await step()
                g = x.grad
                assert g is not None  # the chain's backward set it
                await g.ready()
            if step.statistics().replays != n:
                raise RuntimeError(f"expected {n} replays: {step.statistics()}")
            assert g is not None
            np.asarray(g.numpy())

    trio.run(main)
    return n


def w9_gpt_replays(n: int) -> int:
    """(callgrind child) W9's char GPT training step under `ag.compile`, replayed ``n`` times after the eager
    call and the recording, one lane. Its weights are asyncgrad's own initialisation (seed 0): torch, which
    W9's runner takes the weights from, would cost minutes to import under callgrind, and a count does not
    depend on the values."""
    import trio
    import w9_real_models as w9

    import asyncgrad as ag
    from asyncgrad import nn

    async def main() -> None:
        async with ag.open_runtime(lanes=1, blas_threads=1):
            ag.manual_seed(0)
            model = w9._models(nn, nn.functional)["gpt"]()
            s = w9.AgStep("gpt", {k: v.numpy().copy() for k, v in model.state_dict().items()})
            step = ag.compile(s.step)
            for _ in range(n + 2):
                await step()
            await s.sync()
            if step.statistics().replays != n:
                raise RuntimeError(f"expected {n} replays: {step.statistics()}")

    trio.run(main)
    return n


# workload -> (child function, the two lengths, unit of one extra length, units in one length); W2 counts
# its eager chain and its captured replay ("W2 captured"); W9 is counted only (its replayed char GPT step),
# not timed here (`bench.py W9` times it beside torch)
COUNTED = {
    "W1": ("w1_steps", (3, 13), "step", 1),
    "W2": ("w2_chains", (1, 3), "node", 5000),
    "W2 captured": ("w2_replays", (1, 5), "node", 5000),
    "W9 gpt captured": ("w9_gpt_replays", (2, 12), "step", 1),
}


def _callgrind(root: str, func: str, n: int, out: str) -> subprocess.Popen[str]:
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, CHILD, "_compare", func,
           f'{{"n": {n}}}']
    env = dict(os.environ, ASYNCGRAD_BENCH_ROOT=root, OPENBLAS_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _totals(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    raise RuntimeError(f"no instruction total in {path}")


def instructions(new: str, other: str, workloads: list[str]) -> dict[str, Any]:
    """Instructions per W1 step and per W2 node of both checkouts (see the module docstring)."""
    if shutil.which("valgrind") is None:
        say("  --instructions: valgrind is not installed here; skipped")
        return {}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in [c for w in workloads for c in COUNTED if c.split()[0] == w]:
            func, lengths, unit, per = COUNTED[w]
            jobs = [(name, root, n) for name, root in (("new", new), ("old", other)) for n in lengths]
            say(f"{w}: counting instructions under callgrind ({len(jobs)} runs, a few minutes)...")
            files, procs = {}, []
            for name, root, n in jobs:  # all at once: a count does not depend on the load
                files[name, n] = os.path.join(tmp, f"{w}.{name}.{n}.out")
                procs.append(_callgrind(root, func, n, files[name, n]))
            for p in procs:
                _, err = p.communicate()
                if p.returncode != 0:
                    raise RuntimeError(f"{w}: callgrind run failed (rc={p.returncode}): {err.strip()[-300:]}")
            per_unit = {}
            for name in ("new", "old"):
                lo, hi = (_totals(files[name, n]) for n in lengths)
                per_unit[name] = (hi - lo) / ((lengths[1] - lengths[0]) * per)
            ratio = per_unit["old"] / per_unit["new"]
            rows = [[name, f"{v:,.0f}"] for name, v in per_unit.items()]
            say(table(["code", f"instructions per {unit}"], rows))
            say(f"  new/old speed by instructions: {ratio:.3f} (> 1: the new code runs fewer)")
            out[w] = {"per_" + unit: per_unit, "ratio": ratio}
    return out


def asyncgrad_version() -> str:
    import asyncgrad

    return os.path.dirname(os.path.dirname(os.path.abspath(asyncgrad.__file__)))


def run(other: str, workloads: list[str], quick: bool = False, count: bool = False) -> dict[str, Any]:
    new = os.path.dirname(HERE)
    other = os.path.abspath(other)
    for root in (new, other):
        seen = run_child("_compare", "asyncgrad_version", {}, timeout=120, root=root)
        say(f"  {root}: imports asyncgrad from {seen}")
        if seen != root:
            raise RuntimeError(f"the child for {root} imported asyncgrad from {seen}")
    rounds = 3 if quick else ROUNDS
    funcs = {"W1": ("w1_rate", "steps/s", True), "W2": ("w2_us", "us/node", False)}
    out: dict[str, Any] = {}
    for w in workloads:
        if w not in funcs:
            continue  # counted only (`COUNTED`)
        func, unit, higher_better = funcs[w]
        vals: dict[str, list[float]] = {"new": [], "old": []}
        for r in range(rounds):
            order = [("new", new), ("old", other)] if r % 2 == 0 else [("old", other), ("new", new)]
            for name, root in order:
                res = run_child("_compare", func, {}, timeout=600, root=root)
                if isinstance(res, dict) and "error" in res:
                    raise RuntimeError(f"{w} {name}: {res['error']}")
                vals[name].append(float(res))  # type: ignore[arg-type]
        ratios = [
            (n / o if higher_better else o / n) for n, o in zip(vals["new"], vals["old"])
        ]
        rows = [[name, f"{median(v):.2f}", f"{min(v):.2f}", f"{max(v):.2f}"] for name, v in vals.items()]
        say(f"{w}: asyncgrad new ({new}) vs old ({other}), {rounds} alternating rounds, {unit}")
        say(table(["code", f"median {unit}", "min", "max"], rows))
        say(f"  new/old speed: median of per-round ratios {median(ratios):.3f} "
            f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}; > 1 is faster)")
        out[w] = {"new": vals["new"], "old": vals["old"], "ratios": ratios, "median_ratio": median(ratios)}
    if count:
        out["instructions"] = instructions(new, other, workloads)
    return out
