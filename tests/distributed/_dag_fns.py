"""Module-level functions and classes the distributed autograd tests run on workers (sent by name)."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

import asyncgrad as ag

HOLD: dict[str, Any] = {}


def f_tanh(x: Any, w: Any) -> Any:
    return ag.tanh(x @ w)


def f_square_sum(x: Any) -> Any:
    return (x * x).sum(1)


def f_two(x: Any, k: float) -> Any:
    return x * k, ag.sin(x)


class Boom(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        raise ValueError("boom in the remote backward")


def f_boom(x: Any) -> Any:
    return Boom.apply(x)


class Slow(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x * 3

    @staticmethod
    async def backward(ctx: Any, g: Any) -> Any:
        HOLD["slow_started"] = True
        await trio.sleep(30)
        return g * 3


def f_slow(x: Any) -> Any:
    return Slow.apply(x)


def slow_started() -> bool:
    return bool(HOLD.get("slow_started"))


class Die(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x * 1

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        import os

        os._exit(3)


def f_die(x: Any) -> Any:
    return Die.apply(x)


class Layer:
    """A remote module: a weight and a bias in float64, made from a seed (same values locally)."""

    def __init__(self, n_in: int, n_out: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.w = ag.tensor(rng.standard_normal((n_in, n_out)), requires_grad=True)
        self.b = ag.tensor(rng.standard_normal(n_out), requires_grad=True)

    def forward(self, x: Any) -> Any:
        return ag.tanh(x @ self.w + self.b)

    def grads(self) -> list[Any]:
        return [None if p.grad is None else p.grad.detach() for p in (self.w, self.b)]

    def params(self) -> list[Any]:
        return [self.w.detach(), self.b.detach()]

    def parameters(self) -> list[Any]:
        return [self.w, self.b]


class Table:
    """A remote embedding table."""

    def __init__(self, n: int, d: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.weight = ag.tensor(rng.standard_normal((n, d)) * 0.5, requires_grad=True)

    def forward(self, idx: Any) -> Any:
        return ag.embedding(idx, self.weight)

    def parameters(self) -> list[Any]:
        return [self.weight]

    def grads(self) -> list[Any]:
        return [None if self.weight.grad is None else self.weight.grad.detach()]

    def params(self) -> list[Any]:
        return [self.weight.detach()]
