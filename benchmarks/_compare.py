"""Old code against new, side by side: ``bench.py --compare-with DIR W1 W2``.

Each round runs asyncgrad's contender of W1 (steps/s of the MLP step) and W2 (us per node of the elementwise
chain) in fresh interpreters, alternating between this checkout and ``DIR`` (another checkout, e.g. a
``git worktree`` of an older commit), so that both see the same machine at nearly the same time. W1 takes the
fastest of five 60-step blocks in each interpreter. Reports
the median of the per-round ratios new/old (>1 is faster for W1's steps/s; for W2, old/new so that >1 is
faster too). The workload code is this checkout's; only the imported asyncgrad differs.
"""

from __future__ import annotations

import os
from typing import Any

from _common import HERE, median, run_child, say, table

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


def asyncgrad_version() -> str:
    import asyncgrad

    return os.path.dirname(os.path.dirname(os.path.abspath(asyncgrad.__file__)))


def run(other: str, workloads: list[str], quick: bool = False) -> dict[str, Any]:
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
    return out
