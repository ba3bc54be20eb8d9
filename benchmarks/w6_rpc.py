"""W6 rpc: two processes on loopback. A small call (4 float32) round trip, p50/p99; a 64 MiB float32 tensor
there and back, GB/s (2 x 64 MiB over the seconds of one round trip).

Contenders, each in a fresh child process, alternated so a drift of the machine hits both:
- asyncgrad: ``async with dist.open_workers(1)``, ``await w.call(echo, x)`` (TCP loopback, TCP_NODELAY);
- torch.distributed.rpc with the TensorPipe agent: 2 processes (the child and one more), ``init_method``
  tcp on 127.0.0.1, ``rpc_sync("worker1", echo, (x,))``.
Ratios asyncgrad / torch are taken within the same run. Goals: round trip <= 0.3x torch's, bandwidth >= 3x.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from _common import CHILD, fmt, have, median, percentile, run_child, say, short_error, table

BIG_SHAPE = (4096, 4096)  # float32: 64 MiB
BIG_BYTES = BIG_SHAPE[0] * BIG_SHAPE[1] * 4


def echo(x: Any) -> Any:
    """The remote function of both contenders: return the argument."""
    return x


def _summary(small: list[float], big: list[float]) -> dict[str, Any]:
    return {
        "small_p50_us": percentile(small, 50) * 1e6,
        "small_p99_us": percentile(small, 99) * 1e6,
        "small_calls": len(small),
        "big_s": big,
        "big_median_s": median(big),
        "big_best_s": min(big),
        "big_gbps": 2 * BIG_BYTES / median(big) / 1e9,
        "big_best_gbps": 2 * BIG_BYTES / min(big) / 1e9,
    }


def ag_child(small_calls: int, big_calls: int) -> dict[str, Any]:
    """(child) asyncgrad: one worker process; calls from the parent's runtime."""
    import numpy as np
    import trio

    import asyncgrad as ag
    from asyncgrad import distributed as dist

    rec: dict[str, Any] = {}

    async def main() -> None:
        async with ag.open_runtime():
            t = time.perf_counter()
            async with dist.open_workers(1) as workers:
                rec["start_s"] = time.perf_counter() - t
                w = workers[0]
                x = ag.tensor([1.0, 2.0, 3.0, 4.0])
                for _ in range(200):
                    await w.call(echo, x)
                small = []
                for _ in range(small_calls):
                    t = time.perf_counter()
                    await w.call(echo, x)
                    small.append(time.perf_counter() - t)
                big = ag.from_numpy(np.random.default_rng(0).standard_normal(BIG_SHAPE, dtype=np.float32))
                back = await w.call(echo, big)
                ok = bool(np.array_equal(back.numpy(), big.numpy()))
                times = []
                for _ in range(big_calls):
                    t = time.perf_counter()
                    back = await w.call(echo, big)
                    times.append(time.perf_counter() - t)
                    del back
                rec.update(_summary(small, times))
                rec["ok"] = ok

    trio.run(main)
    return rec


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def torch_rank(rank: int, port: int, small_calls: int, big_calls: int) -> dict[str, Any]:
    """(child) One rank of torch.distributed.rpc (TensorPipe). Rank 0 calls, rank 1 serves."""
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    rec: dict[str, Any] = {}
    if rank == 0:
        x = torch.tensor([1.0, 2.0, 3.0, 4.0])
        for _ in range(200):
            rpc.rpc_sync("worker1", echo, (x,))
        small = []
        for _ in range(small_calls):
            t = time.perf_counter()
            rpc.rpc_sync("worker1", echo, (x,))
            small.append(time.perf_counter() - t)
        big = torch.randn(*BIG_SHAPE)
        back = rpc.rpc_sync("worker1", echo, (big,))
        ok = bool(torch.equal(back, big))
        times = []
        for _ in range(big_calls):
            t = time.perf_counter()
            back = rpc.rpc_sync("worker1", echo, (big,))
            times.append(time.perf_counter() - t)
            del back
        rec.update(_summary(small, times))
        rec["ok"] = ok
    rpc.shutdown()
    return rec


def torch_child(small_calls: int, big_calls: int) -> dict[str, Any]:
    """(child) Rank 0 here; rank 1 in one more fresh process."""
    port = _free_port()
    kwargs = {"rank": 1, "port": port, "small_calls": small_calls, "big_calls": big_calls}
    other = subprocess.Popen(
        [sys.executable, CHILD, "w6_rpc", "torch_rank", json.dumps(kwargs)],
        stdout=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        return torch_rank(0, port, small_calls, big_calls)
    finally:
        try:
            other.wait(timeout=60)
        except subprocess.TimeoutExpired:
            other.kill()


def run(quick: bool = False) -> dict[str, Any]:
    small_calls = 1000 if quick else 5000
    big_calls = 3 if quick else 8
    rounds = 1 if quick else 2
    say(f"W6 rpc: 2 processes on loopback; small call (4 float32) x{small_calls}, 64 MiB float32 there and "
        f"back x{big_calls}; {rounds} round(s), each contender in a fresh child process")
    runs: dict[str, list[dict[str, Any]]] = {"asyncgrad": [], "torch": []}
    kw = {"small_calls": small_calls, "big_calls": big_calls}
    for r in range(rounds):
        say(f"  round {r + 1}: asyncgrad...")
        runs["asyncgrad"].append(run_child("w6_rpc", "ag_child", kw, timeout=600))
        if have("torch"):
            say(f"  round {r + 1}: torch rpc (TensorPipe)...")
            runs["torch"].append(run_child("w6_rpc", "torch_child", kw, timeout=600))
    if not have("torch"):
        say("  torch: not installed, skipped (pip install torch==2.13.0)")
    best: dict[str, dict[str, Any]] = {}
    rows = []
    for name, rs in runs.items():
        good = [x for x in rs if "error" not in x and x.get("ok")]
        for x in rs:
            if "error" in x or not x.get("ok"):
                rows.append([name, "FAILED " + short_error(Exception(x.get("error", "wrong values")), 200)])
        if not good:
            continue
        b = {
            "small_p50_us": min(x["small_p50_us"] for x in good),
            "small_p99_us": min(x["small_p99_us"] for x in good),
            "big_gbps": max(x["big_gbps"] for x in good),
            "big_best_gbps": max(x["big_best_gbps"] for x in good),
        }
        best[name] = b
        rows.append([name, fmt(b["small_p50_us"], ".0f"), fmt(b["small_p99_us"], ".0f"), fmt(b["big_gbps"], ".2f"),
                     fmt(b["big_best_gbps"], ".2f")])
    say()
    hdr = ["contender", "small p50 us", "small p99 us", "64 MiB GB/s (median)", "GB/s (best)"]
    say(table(hdr, [r if len(r) == len(hdr) else r + [""] * (len(hdr) - len(r)) for r in rows]))
    res: dict[str, Any] = {"runs": runs, "best": best}
    if "asyncgrad" in best and "torch" in best:
        a, t = best["asyncgrad"], best["torch"]
        res["ratio_p50"] = a["small_p50_us"] / t["small_p50_us"]
        res["ratio_p99"] = a["small_p99_us"] / t["small_p99_us"]
        res["ratio_gbps"] = a["big_gbps"] / t["big_gbps"]
        ok_rt = res["ratio_p50"] <= 0.3
        ok_bw = res["ratio_gbps"] >= 3.0
        say(f"  round trip p50: asyncgrad / torch = {res['ratio_p50']:.2f}x (goal <= 0.3x: "
            f"{'met' if ok_rt else 'NOT met'}); p99 {res['ratio_p99']:.2f}x")
        say(f"  64 MiB there and back: asyncgrad / torch = {res['ratio_gbps']:.2f}x the bandwidth (goal >= 3x: "
            f"{'met' if ok_bw else 'NOT met'})")
    return res
