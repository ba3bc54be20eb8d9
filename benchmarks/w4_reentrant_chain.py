"""W4 reentrant-chain: a custom Function whose backward runs a reentrant backward on a fresh graph that holds
the same Function one level shallower; depth D means D nested backward passes, O(D) work in all.

Figures: ok/failure, seconds, time per level, OS threads alive after the pass, peak RSS. Each run is
alone in a fresh child process (threads and RSS are per process; torch needs a huge recursion limit and
spawns a thread per 60 levels). asyncgrad runs with the default recursion limit, as a user would.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from _common import fmt, have, os_threads, peak_rss_mb, ru_maxrss_mb, run_child, say, table

TORCH_DEPTH = 10_000


def ag_child(depth: int) -> dict[str, Any]:
    """(child) asyncgrad: an ``async def backward`` awaits the backward of a one-level-shallower chain."""
    import numpy as np
    import trio

    import asyncgrad as ag

    class Reent(ag.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, d: int) -> Any:
            ctx.d = d
            return x * 1.0

        @staticmethod
        async def backward(ctx: Any, g: Any) -> Any:
            if ctx.d > 0:
                with ag.enable_grad():
                    leaf = ag.ones(4, requires_grad=True)
                    await Reent.apply(leaf, ctx.d - 1).sum().backward()
            return g * 2.0, None

    threads_before = os_threads()
    rec: dict[str, Any] = {"depth": depth, "recursion_limit": sys.getrecursionlimit(),
                           "threads_before_runtime": threads_before}

    async def main() -> None:
        async with ag.open_runtime() as rt:
            rec["runtime_threads"] = len(rt.threads())
            x = ag.ones(4, requires_grad=True)
            t = time.perf_counter()
            try:
                await Reent.apply(x, depth).sum().backward()
                g = x.grad.numpy()
                rec["ok"] = bool(np.allclose(g, 2.0))
                if not rec["ok"]:
                    rec["error"] = f"wrong gradient {g.tolist()} (expected all 2.0)"
            except BaseException as e:  # RecursionError, a crash of the engine, ...
                from _common import short_error

                rec["ok"] = False
                rec["error"] = short_error(e, 300)
            rec["seconds"] = time.perf_counter() - t
            rec["threads_after"] = os_threads()

    try:
        trio.run(main)
    except BaseException as e:
        from _common import short_error

        rec.setdefault("ok", False)
        rec.setdefault("error", short_error(e, 300))
    rec["threads_after_runtime_closed"] = os_threads()
    rec["peak_rss_mb"] = peak_rss_mb()
    rec["ru_maxrss_mb"] = ru_maxrss_mb()
    return rec


def torch_child(depth: int) -> dict[str, Any]:
    """(child) The PyTorch anchor: reentrant ``.backward()`` inside ``backward`` (high recursion limit)."""
    import torch

    class Reent(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, d: int) -> Any:
            ctx.d = d
            return x * 1.0

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            if ctx.d > 0:
                with torch.enable_grad():
                    leaf = torch.ones(4, requires_grad=True)
                    Reent.apply(leaf, ctx.d - 1).sum().backward()
            return g * 2.0, None

    sys.setrecursionlimit(max(10000, 50 * depth))
    rec: dict[str, Any] = {"depth": depth, "recursion_limit": sys.getrecursionlimit(),
                           "threads_before_runtime": os_threads()}
    x = torch.ones(4, requires_grad=True)
    t = time.perf_counter()
    try:
        Reent.apply(x, depth).sum().backward()
        rec["ok"] = bool(torch.allclose(x.grad, torch.full((4,), 2.0)))
    except BaseException as e:
        from _common import short_error

        rec["ok"] = False
        rec["error"] = short_error(e, 300)
    rec["seconds"] = time.perf_counter() - t
    rec["threads_after"] = os_threads()
    rec["peak_rss_mb"] = peak_rss_mb()
    rec["ru_maxrss_mb"] = ru_maxrss_mb()
    return rec


def run(quick: bool = False, depth: int | None = None) -> dict[str, Any]:
    D = depth if depth is not None else (10_000 if quick else 100_000)
    timeout = 300 if quick else 900
    depths = sorted({TORCH_DEPTH, D})
    say(f"W4 reentrant-chain: custom Function, backward runs a reentrant backward one level shallower; "
        f"D={depths} (each run alone in a child process)")
    runs: list[tuple[str, dict[str, Any]]] = []
    for d in depths:
        say(f"  asyncgrad D={d}...")
        runs.append(("asyncgrad", run_child("w4_reentrant_chain", "ag_child", {"depth": d}, timeout=timeout)))
        runs[-1][1].setdefault("depth", d)
    if have("torch"):
        say(f"  torch D={TORCH_DEPTH}...")
        r = run_child("w4_reentrant_chain", "torch_child", {"depth": TORCH_DEPTH}, timeout=300)
        runs.append(("torch", r))
        runs[-1][1].setdefault("depth", TORCH_DEPTH)
    else:
        say("  torch: not installed, skipped (pip install torch==2.13.0)")
    rows = []
    for name, r in runs:
        ok = r.get("ok")
        status = "ok" if ok else ("FAILED " + r.get("error", "?"))
        secs = r.get("seconds")
        per = secs / r["depth"] * 1e6 if secs is not None and ok else None
        fixed = r.get("runtime_threads")
        thr = r.get("threads_after")
        thr_txt = "-" if thr is None else (f"{thr} (runtime set {fixed})" if fixed is not None else str(thr))
        rows.append([f"{name} D={r['depth']}", fmt(secs, ".3f"), fmt(per, ".1f"), thr_txt,
                     fmt(r.get("peak_rss_mb"), ".0f"), str(r.get("recursion_limit", "-")),
                     "ok" if ok else "FAILED"])
        if not ok:
            rows.append([f"  -> {status}"])
    say()
    hdr = ["run", "seconds", "us/level", "OS threads after", "peakRSS MB", "recursion limit", "status"]
    say(table(hdr, [r if len(r) > 1 else r + [""] * (len(hdr) - 1) for r in rows]))
    ag_big = next((r for n, r in runs if n == "asyncgrad" and r["depth"] == D), {})
    tr = next((r for n, r in runs if n == "torch"), {})
    if ag_big.get("ok"):
        per = ag_big["seconds"] / D * 1e6
        tper = tr["seconds"] / TORCH_DEPTH * 1e6 if tr.get("ok") else float("nan")
        extra = ag_big.get("threads_after", 0) - ag_big.get("threads_before_runtime", 0) - ag_big.get(
            "runtime_threads", 0)
        say(f"  target: D={D} ok, no OS threads beyond the runtime's fixed set, us/level <= torch's -> "
            f"ok, {extra} extra threads, {per:.1f} vs torch {tper:.1f} us/level")
    else:
        say(f"  target: D={D} ok -> FAILED ({ag_big.get('error', '?')})")
    return {"runs": [{"contender": n, **r} for n, r in runs]}
