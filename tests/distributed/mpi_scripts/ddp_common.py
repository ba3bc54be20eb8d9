"""Models, data and the training loop shared by the 2-rank DDP scripts and the tests' 1-process references.

Everything is float64 and built from seeded numpy arrays, so 2 ranks on halves of each batch and 1 process
on whole batches start from the same parameters and see the same samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import asyncgrad as ag
from asyncgrad import nn

STEPS = 20
BATCH = 16  # whole batch; each of 2 ranks takes one half


def channels_last(a: np.ndarray) -> np.ndarray:
    """The same values as ``a`` (N, C, H, W), stored as N, H, W, C."""
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def build(kind: str) -> nn.Module:
    """A deterministic float64 model: ``mlp`` (2 buckets at bucket_cap_mb=0.25) or ``cnn`` (channels-last)."""
    rng = np.random.default_rng(7)
    if kind == "mlp":
        m: nn.Module = nn.Sequential(
            nn.Linear(64, 512, dtype=ag.float64), nn.ReLU(), nn.Linear(512, 256, dtype=ag.float64), nn.ReLU(),
            nn.Linear(256, 10, dtype=ag.float64),
        )
    else:
        m = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, dtype=ag.float64), nn.ReLU(), nn.Conv2d(8, 8, 3, dtype=ag.float64),
            nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10, dtype=ag.float64),
        )
    for name, p in m.named_parameters():
        arr = rng.standard_normal(p.shape) * (1.0 / np.sqrt(max(1, p.numel() // p.shape[0])))
        if arr.ndim == 4:
            arr = channels_last(arr)  # the layout contract must carry this into .grad and the bucket views
        target = m.get_submodule(name.rsplit(".", 1)[0])
        setattr(target, name.rsplit(".", 1)[1], nn.Parameter(ag.from_numpy(arr)))
    return m


def data(kind: str) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    out = []
    for _ in range(STEPS):
        if kind == "mlp":
            x = rng.standard_normal((BATCH, 64))
        else:
            x = channels_last(rng.standard_normal((BATCH, 3, 8, 8)))
        out.append((x, rng.integers(0, 10, BATCH)))
    return out


def optimizer(name: str, params: Any) -> Any:
    if name == "sgd":
        return ag.optim.SGD(params, lr=0.05, momentum=0.9)
    return ag.optim.Adam(params, lr=1e-3)


async def train(model: Any, opt: Any, batches: list[tuple[np.ndarray, np.ndarray]], part: slice) -> list[Any]:
    """Run the steps on ``part`` of each batch; returns the .grad strides seen after each backward."""
    strides = []
    for x, y in batches:
        opt.zero_grad()
        xb = ag.from_numpy(np.ascontiguousarray(x[part]) if x.ndim == 2 else channels_last(x[part]))
        loss = ag.nn.functional.cross_entropy(model(xb), ag.tensor(y[part]))
        await loss.backward()
        strides.append([(tuple(p.strides), tuple(p.grad.strides)) for p in model.parameters()])
        opt.step()
    return strides


def params_of(model: Any) -> dict[str, np.ndarray]:
    return {n: np.array(p.numpy()) for n, p in model.named_parameters()}
