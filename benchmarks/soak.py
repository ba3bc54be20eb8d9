#!/usr/bin/env python3
"""Soak (issue 22), run by hand, not in the test suite:

1. ``hooks``: 10,000 training steps of a small MLP with a tensor hook and a module forward hook added and
   removed every step; RSS and tracemalloc sampled every 500 steps, the slope reported (KiB per 1000
   steps, least squares over the second half, after warm-up).
2. ``passes``: 1,000 concurrent backward passes (one trio task each) on one runtime into the same leaves,
   pass k adding k * x: the gradients must equal x * 500500 exactly.
3. ``service``: examples/serve_and_train.py in a child process, training all the time, under 32
   concurrent clients posting /predict for 60 s: errors (must be 0), predict latency p50/p99/max, and
   the server's RSS every 5 s (slope over the second half), and its open file descriptors (connections).

    python3 benchmarks/soak.py                  # all three
    python3 benchmarks/soak.py hooks --steps 2000
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def rss_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def open_fds(pid: int | str = "self") -> int:
    """Open file descriptors of a process (for the server: its listening socket plus one per connection)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (second half only: after warm-up and caches fill)."""
    h = len(xs) // 2
    x, y = np.array(xs[h:], float), np.array(ys[h:], float)
    if len(x) < 2:
        return float("nan")
    return float(np.polyfit(x, y, 1)[0])


def soak_hooks(steps: int) -> dict[str, Any]:
    import trio

    import asyncgrad as ag

    async def main() -> dict[str, Any]:
        async with ag.open_runtime():
            ag.manual_seed(0)
            model = ag.nn.Sequential(ag.nn.Linear(32, 64), ag.nn.ReLU(), ag.nn.Linear(64, 10))
            opt = ag.optim.SGD(model.parameters(), lr=0.01)
            x = ag.randn(16, 32)
            y = ag.randint(0, 10, (16,))
            seen = [0, 0]
            marks: list[int] = []
            rss: list[int] = []
            traced: list[int] = []
            tracemalloc.start()
            t0 = time.perf_counter()
            for i in range(steps):
                h1 = model[0].weight.register_hook(lambda g: seen.__setitem__(0, seen[0] + 1))
                h2 = model.register_forward_hook(lambda m, a, out: seen.__setitem__(1, seen[1] + 1))
                loss = ag.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                await loss.backward()
                opt.step()
                h1.remove()
                h2.remove()
                if i % 500 == 0 or i == steps - 1:
                    await (await loss.ready()).ready()
                    marks.append(i)
                    rss.append(rss_kib())
                    traced.append(tracemalloc.get_traced_memory()[0] // 1024)
            elapsed = time.perf_counter() - t0
            tracemalloc.stop()
            final_loss = (await loss.ready()).item()
        return {"steps": steps, "seconds": elapsed, "hook_calls": seen, "final_loss": final_loss,
                "rss_kib": rss, "traced_kib": traced, "marks": marks,
                "rss_slope_kib_per_1000": slope(marks, rss) * 1000,
                "traced_slope_kib_per_1000": slope(marks, traced) * 1000}

    r = trio.run(main)
    ok = r["hook_calls"] == [steps, steps]
    print(f"hooks: {steps} steps in {r['seconds']:.1f} s, hook calls {r['hook_calls']} ({'ok' if ok else 'WRONG'}), "
          f"final loss {r['final_loss']:.4f}")
    print(f"  RSS KiB at steps {r['marks']}: {r['rss_kib']}")
    print(f"  tracemalloc KiB: {r['traced_kib']}")
    print(f"  slope over the second half: RSS {r['rss_slope_kib_per_1000']:.1f} KiB/1000 steps, "
          f"tracemalloc {r['traced_slope_kib_per_1000']:.1f} KiB/1000 steps")
    return r


def soak_passes(n: int) -> dict[str, Any]:
    import trio

    import asyncgrad as ag

    async def main() -> dict[str, Any]:
        async with ag.open_runtime() as rt:
            x = np.arange(256.0)
            xt = ag.tensor(x)
            w = ag.tensor(np.zeros(256), requires_grad=True)
            b = ag.tensor(np.zeros(16), requires_grad=True)
            w2 = ag.tensor(np.zeros((64, 64)), requires_grad=True)  # big enough for lane kernels
            ones = ag.tensor(np.ones((64, 64)))

            async def one(k: int) -> None:
                loss = (w * xt).sum() * float(k) + (b * float(k)).sum() + (w2 * ones).sum() * float(k)
                await loss.backward()

            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for k in range(1, n + 1):
                    nursery.start_soon(one, k)
            await rt.synchronize()
            elapsed = time.perf_counter() - t0
            total = n * (n + 1) // 2
            gw, gb, gw2 = w.grad, b.grad, w2.grad
            assert gw is not None and gb is not None and gw2 is not None
            exact = (np.array_equal(gw.numpy(), x * total) and np.array_equal(gb.numpy(), np.full(16, total))
                     and np.array_equal(gw2.numpy(), np.full((64, 64), float(total))))
            return {"passes": n, "seconds": elapsed, "exact": bool(exact), "expected_sum": total,
                    "b_grad": float(gb.numpy()[0]), "threads_during": len(rt.threads())}

    r = trio.run(main)
    print(f"passes: {n} concurrent backward passes in {r['seconds']:.2f} s into shared leaves: "
          f"b.grad = {r['b_grad']:.0f}, expected {r['expected_sum']} -> {'EXACT' if r['exact'] else 'WRONG'}")
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def soak_service(seconds: float, clients: int) -> dict[str, Any]:
    import httpx
    import trio

    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "examples", "serve_and_train.py"), "--port", str(port),
         "--idle-steps", str(10**9)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    X = rng.integers(0, 17, (512, 64)).astype(float)
    Y = rng.integers(0, 10, 512)
    lat: list[float] = []
    errors: list[str] = []
    rss: list[tuple[float, int]] = []
    fds: list[int] = []

    async def main() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as c:
            with trio.fail_after(60):
                while True:
                    try:
                        await c.get("/stats")
                        break
                    except httpx.TransportError:
                        await trio.sleep(0.2)
            r = await c.post("/train", json={"inputs": X.tolist(), "labels": Y.tolist()})
            r.raise_for_status()
            t_end = time.perf_counter() + seconds

            async def client(i: int) -> None:
                crng = np.random.default_rng(i)
                while time.perf_counter() < t_end:
                    idx = crng.integers(0, len(X), 8)
                    t = time.perf_counter()
                    try:
                        r = await c.post("/predict", json={"inputs": X[idx].tolist()})
                        if r.status_code != 200 or len(r.json()["classes"]) != 8:
                            errors.append(f"{r.status_code}: {r.text[:100]}")
                    except Exception as e:  # counted, reported: the soak must show 0
                        errors.append(f"{type(e).__name__}: {e}")
                    lat.append(time.perf_counter() - t)

            async def sample_rss() -> None:
                t0 = time.perf_counter()
                while time.perf_counter() < t_end:
                    rss.append((time.perf_counter() - t0, rss_kib(server.pid)))
                    fds.append(open_fds(server.pid))
                    await trio.sleep(5)

            async with trio.open_nursery() as n:
                n.start_soon(sample_rss)
                for i in range(clients):
                    n.start_soon(client, i)
            stats = (await c.get("/stats")).json()
        return stats

    try:
        stats = trio.run(main)
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    ms = np.array(lat) * 1e3
    r = {"requests": len(lat), "errors": len(errors), "first_errors": errors[:3],
         "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()),
         "rss_kib": rss, "rss_slope_kib_per_min": slope([t for t, _ in rss], [v for _, v in rss]) * 60,
         "server_fds": fds, "train_steps": stats.get("train_steps", stats.get("steps"))}
    print(f"service: {clients} clients x {seconds:.0f} s: {r['requests']} predicts, {r['errors']} errors "
          f"{r['first_errors']}, latency p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms; "
          f"trainer steps {r['train_steps']}")
    print(f"  server RSS KiB every 5 s: {[v for _, v in rss]}; slope (second half) "
          f"{r['rss_slope_kib_per_min']:.0f} KiB/min")
    # The server's heap follows how many connections it holds open: a connection the client closed
    # stays open on the server until its keep-alive timer fires (hypercorn's trio worker, 5 s), so
    # client-side connection churn shows up here, and in the RSS, as connections in limbo.
    print(f"  server open fds every 5 s (sockets: ~one per connection it holds): {fds}")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", default=["hooks", "passes", "service"])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--passes", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=32)
    a = ap.parse_args()
    ok = True
    if "passes" in a.parts:
        ok &= soak_passes(a.passes)["exact"]
    if "hooks" in a.parts:
        soak_hooks(a.steps)
    if "service" in a.parts:
        ok &= soak_service(a.seconds, a.clients)["errors"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
