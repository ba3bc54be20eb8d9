"""Trainings the population tests run on workers (module level: sent by name, imported there)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import trio

import asyncgrad as ag

D, H, C, B = 8, 16, 3, 32


def data(seed: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    r = np.random.default_rng(seed)
    x = r.standard_normal((B, D))
    t = r.standard_normal((B, C))
    params = [r.standard_normal(s) * 0.3 for s in [(D, H), (H,), (H, C), (C,)]]
    return x, t, params


async def mlp(trial: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """A small float64 MLP regression: reports the loss each step, checkpoints its parameters.

    cfg: seed, steps, lr, and optionally delay (seconds per step, to make room for faults), fail_at
    (raise at that step), the step to start from comes from ``trial.restored``.
    """
    x_np, t_np, p_np = data(cfg["seed"])
    x, t = ag.tensor(x_np), ag.tensor(t_np)
    start = 0
    if trial.restored is not None:
        start = trial.restored["step"]
        params = [p.detach().requires_grad_() for p in trial.restored["params"]]
    else:
        params = [ag.tensor(p, requires_grad=True) for p in p_np]
    losses = []
    for step in range(start, cfg["steps"]):
        if cfg.get("fail_at") == step:
            raise ValueError(f"training {cfg['seed']} failed at step {step} on purpose")
        w1, b1, w2, b2 = params
        z = ag.relu(x @ w1 + b1) @ w2 + b2
        loss = ((z - t) ** 2).mean()
        await loss.backward()
        with ag.no_grad():
            for p in params:
                p -= cfg["lr"] * p.grad
                p.grad = None
        await loss.ready()
        lv = float(loss.item())
        losses.append(lv)
        await trial.report(step=step, loss=lv, pid=os.getpid())
        trial.checkpoint({"step": step + 1, "params": params})
        if cfg.get("delay"):
            await trio.sleep(cfg["delay"])
    return {"params": params, "start": start, "attempt": trial.attempt, "losses": losses}


async def sleepy(trial: Any, cfg: dict[str, Any]) -> str:
    """Reports, then sleeps for a long time; writes a marker file when it sees trio.Cancelled."""
    await trial.report(step=0, pid=os.getpid())
    try:
        await trio.sleep(cfg.get("sleep", 60))
    except trio.Cancelled:
        if cfg.get("marker"):
            with open(cfg["marker"], "w") as f:
                f.write("cancelled")
        raise
    return "woke"


async def paced(trial: Any, cfg: dict[str, Any]) -> int:
    """Reports n times, spaced by delay seconds (for timing reports against the training's progress)."""
    for i in range(cfg["n"]):
        await trial.report(step=i, at=trio.current_time())
        await trio.sleep(cfg["delay"])
    return cfg["n"]


def not_async(trial: Any, cfg: Any) -> None:
    return None


class FakeTrial:
    """A trial for running the same training in this process (the sequential reference)."""

    restored = None
    attempt = 0

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    async def report(self, *, step: int | None = None, **metrics: Any) -> None:
        self.reports.append({"step": step, **metrics})

    def checkpoint(self, state: Any) -> None:
        pass


async def mixed(trial: Any, cfg: dict[str, Any]) -> Any:
    """`sleepy` for a config with "sleep", else `mlp`."""
    if "sleep" in cfg:
        return await sleepy(trial, cfg)
    return await mlp(trial, cfg)


async def affinity(trial: Any, cfg: Any) -> dict[str, Any]:
    """The CPUs each thread of this worker may run on (its loop, its lanes, OpenBLAS's pool)."""
    masks = []
    for tid in os.listdir("/proc/self/task"):
        try:
            masks.append(sorted(os.sched_getaffinity(int(tid))))
        except OSError:  # a thread that just ended
            pass
    return {"worker": trial.worker, "masks": masks}


async def marks_start(trial: Any, cfg: dict[str, Any]) -> int:
    """Writes cfg["marker"] as it starts, reports, sleeps cfg["sleep"] seconds; returns the worker's pid."""
    with open(cfg["marker"], "w") as f:
        f.write("started")
    await trial.report(step=0, pid=os.getpid())
    await trio.sleep(cfg.get("sleep", 0))
    return os.getpid()
