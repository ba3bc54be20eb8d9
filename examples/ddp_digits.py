#!/usr/bin/env python3
"""Data-parallel training of a channels-last CNN on the handwritten digits, over 2 MPI ranks.

Each rank trains on its half of every batch; `DistributedDataParallel` averages the gradients while the
backward runs, so both ranks keep identical parameters. At the end rank 0 trains the same model from the
same start in one process on the whole batches and prints both test accuracies: data parallel reaches the
single-process accuracy (the parameters agree to float32 rounding).

Usage::

    python3 -m asyncgrad.distributed.launch -n 2 examples/ddp_digits.py            # 2 ranks
    python3 -m asyncgrad.distributed.launch -n 2 examples/ddp_digits.py --epochs 3

Needs the ``mpi`` and ``examples`` extras: ``pip install -e '.[mpi,examples]'``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist
from asyncgrad import nn
from asyncgrad.nn import functional as F
from asyncgrad.nn.parallel import DistributedDataParallel

BATCH = 64  # whole batch; each rank takes BATCH // world


def channels_last(a: np.ndarray) -> np.ndarray:
    """The same (N, C, H, W) values, stored as N, H, W, C."""
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def load() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    n = int(0.8 * len(y))
    return x[:n], y[:n], x[n:], y[n:]


def build() -> nn.Module:
    rng = np.random.default_rng(42)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )
    for name, p in model.named_parameters():
        fan_in = int(np.prod(p.shape[1:])) if p.ndim > 1 else p.shape[0]
        arr = (rng.standard_normal(p.shape) / np.sqrt(fan_in)).astype(np.float32)
        if arr.ndim == 4:
            arr = channels_last(arr)  # the gradients and DDP's bucket views keep this layout
        mod, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(mod), attr, nn.Parameter(ag.from_numpy(arr)))
    return model


async def train(model: nn.Module, xs: np.ndarray, ys: np.ndarray, epochs: int, part: slice) -> float:
    opt = ag.optim.Adam(model.parameters(), lr=3e-3)
    loss = None
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(ys))
        for start in range(0, len(ys) - BATCH + 1, BATCH):
            idx = order[start : start + BATCH][part]
            opt.zero_grad()
            loss = F.cross_entropy(model(ag.from_numpy(channels_last(xs[idx]))), ag.tensor(ys[idx]))
            await loss.backward()
            opt.step()
    return (await loss.ready()).item() if loss is not None else float("nan")


def accuracy(model: nn.Module, xs: np.ndarray, ys: np.ndarray) -> float:
    with ag.no_grad():
        pred = model(ag.from_numpy(channels_last(xs))).numpy().argmax(1)
    return float((pred == ys).mean())


async def main(epochs: int) -> None:
    group = dist.init_process_group("mpi", timeout=120)
    rank, world = group.rank, group.size
    xtr, ytr, xte, yte = load()
    per = BATCH // world
    model = build()
    async with DistributedDataParallel(model) as ddp:
        t0 = time.perf_counter()
        with trio.fail_after(600):
            last = await train(ddp, xtr, ytr, epochs, slice(rank * per, (rank + 1) * per))
        wall = time.perf_counter() - t0
    acc = accuracy(model, xte, yte)
    mine = np.concatenate([p.numpy().ravel() for p in model.parameters()])
    every = [ag.zeros(mine.size) for _ in range(world)]
    await dist.all_gather(every, ag.from_numpy(mine))
    same = all(np.array_equal(e.numpy(), mine) for e in every)
    if rank == 0:
        print(f"{world} ranks: test accuracy {acc:.4f}, last loss {last:.4f}, {wall:.1f} s; "
              f"parameters identical on every rank: {same}")
        single = build()
        t0 = time.perf_counter()
        await train(single, xtr, ytr, epochs, slice(None))
        sacc = accuracy(single, xte, yte)
        diff = max(float(np.abs(a.numpy() - b.numpy()).max()) for a, b in zip(model.parameters(), single.parameters()))
        print(f"1 process: test accuracy {sacc:.4f}, {time.perf_counter() - t0:.1f} s; "
              f"max |parameter difference| {diff:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=8)
    args = ap.parse_args()
    ag.run(main, args.epochs, lanes=1, blas_threads=1)
