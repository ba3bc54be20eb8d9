"""Fan work out to worker processes and gather tensors back.

Each worker is a process running its own asyncgrad runtime, so the shards train in parallel, past the
GIL. Functions are sent by name (never pickled): this script's own functions work too, the workers load
this file as a module (its ``if __name__ == "__main__":`` block does not run there).

    python examples/rpc_workers.py                 # 2 workers, 8 shards
    python examples/rpc_workers.py --workers 4 --shards 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import asyncgrad as ag
from asyncgrad import distributed as dist

FEATURES = 32


async def fit_shard(x: ag.Tensor, y: ag.Tensor, steps: int, lr: float) -> tuple[ag.Tensor, float]:
    """(on a worker) Least squares on one shard by gradient descent: returns the weights and the last loss."""
    w = ag.zeros(x.shape[1], 1, requires_grad=True)
    loss = None
    for _ in range(steps):
        loss = ((x @ w - y) ** 2).mean()
        await loss.backward()
        with ag.no_grad():
            w -= lr * w.grad
        w.grad = None
    assert loss is not None
    return w.detach(), loss.item()


def make_shards(n: int, rows: int, rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[ag.Tensor, ag.Tensor]]]:
    true_w = rng.standard_normal((FEATURES, 1))
    shards = []
    for _ in range(n):
        x = rng.standard_normal((rows, FEATURES))
        y = x @ true_w + 0.05 * rng.standard_normal((rows, 1))
        shards.append((ag.tensor(x), ag.tensor(y)))
    return true_w, shards


async def main(args: argparse.Namespace) -> None:
    ag.set_default_dtype(ag.float64)  # the workers start with the parent's default dtype
    rng = np.random.default_rng(args.seed)
    true_w, shards = make_shards(args.shards, args.rows, rng)
    t = time.perf_counter()
    async with dist.open_workers(args.workers) as workers:
        print(f"{len(workers)} workers up in {time.perf_counter() - t:.1f} s: "
              + ", ".join(f"{w.name} (pid {w.pid})" for w in workers))
        t = time.perf_counter()
        # fan out: one call per shard, round robin over the workers; each returns at once with a Future
        futures = [
            workers[i % len(workers)].call_nowait(fit_shard, x, y, steps=args.steps, lr=0.1)
            for i, (x, y) in enumerate(shards)
        ]
        # gather: tensors come back as tensors (their dtype, shape and strides), never pickled
        results = [await f for f in futures]
        elapsed = time.perf_counter() - t
        stats = await workers[0].statistics()
    weights = ag.stack([w for w, _ in results])  # (shards, FEATURES, 1)
    mean_w = weights.mean(0)
    err = float(np.abs(mean_w.numpy() - true_w).max())
    losses = [loss for _, loss in results]
    print(f"{len(shards)} shards x {args.steps} steps in {elapsed:.2f} s; final losses "
          f"{min(losses):.4f}..{max(losses):.4f}")
    print(f"averaged weights: max |w - true w| = {err:.4f}")
    print(f"{workers[0].name} served {stats.calls_served} calls, received {stats.bytes_received / 1e6:.1f} MB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ag.run(main, args)
