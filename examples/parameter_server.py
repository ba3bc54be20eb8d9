"""A parameter server: an embedding table lives on one worker, an MLP on the trainer.

Each step the trainer sends a batch of token ids to the table (``await table.call("forward", ids)``),
gets the looked-up rows back as tensors that require grad, runs its MLP and ``await loss.backward()``:
the backward sends the rows' gradient back to the worker, which stages the table's gradient and commits
it only once the whole pass succeeded. ``dist.DistributedOptimizer`` then steps the table where it lives,
while the trainer steps its MLP locally.

The synthetic task: every token has a hidden class in 0..3; a sample is a pair of tokens and its label
is the sum of their classes mod 4, which the model must learn from the embeddings alone.

    python examples/parameter_server.py            # reaches >= 95% accuracy on held-out pairs
    python examples/parameter_server.py --steps 300
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import asyncgrad as ag
from asyncgrad import distributed as dist

TOKENS, DIM, CLASSES = 32, 8, 4


class Table:
    """(on the worker) The embedding table."""

    def __init__(self, n: int, d: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.weight = ag.tensor(rng.standard_normal((n, d)).astype(np.float32) * 0.5, requires_grad=True)

    def forward(self, ids: ag.Tensor) -> ag.Tensor:
        return ag.embedding(ids, self.weight)

    def parameters(self) -> list[ag.Tensor]:
        return [self.weight]


def batch(rng: np.random.Generator, classes: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(0, TOKENS, size=(n, 2))
    return ids, (classes[ids[:, 0]] + classes[ids[:, 1]]) % CLASSES


async def main(args: argparse.Namespace) -> float:
    rng = np.random.default_rng(args.seed)
    classes = rng.integers(0, CLASSES, size=TOKENS)
    ag.manual_seed(args.seed)
    mlp = ag.nn.Sequential(ag.nn.Linear(2 * DIM, 64), ag.nn.ReLU(), ag.nn.Linear(64, CLASSES))
    async with dist.open_workers(1) as workers:
        table = await workers[0].remote(Table, TOKENS, DIM, args.seed)
        remote_opt = dist.DistributedOptimizer(ag.optim.SGD, [table], lr=args.lr)
        local_opt = ag.optim.SGD(mlp.parameters(), lr=args.lr)
        t = time.perf_counter()
        for step in range(args.steps):
            ids, y = batch(rng, classes, args.batch)
            rows = await table.call("forward", ag.tensor(ids))  # (batch, 2, DIM), requires grad
            logits = mlp(rows.reshape(args.batch, 2 * DIM))
            loss = ag.cross_entropy(logits, ag.tensor(y))
            local_opt.zero_grad()
            await remote_opt.zero_grad()
            await loss.backward()
            local_opt.step()
            await remote_opt.step()
            if step % 100 == 0:
                print(f"step {step:4d}  loss {loss.item():.4f}")
        ms = (time.perf_counter() - t) / args.steps * 1e3
        with ag.no_grad():
            ids, y = batch(rng, classes, 1000)
            rows = await table.call("forward", ag.tensor(ids))
            pred = mlp(rows.reshape(1000, 2 * DIM)).argmax(1).numpy()
        acc = float((pred == y).mean())
        print(f"{args.steps} steps, {ms:.2f} ms/step; held-out accuracy {acc:.3f}")
        return acc


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    ag.run(main, a)
