"""Functions and classes the nested / hooks / chain distributed-autograd tests run on workers (by name)."""

from __future__ import annotations

from typing import Any

import numpy as np

import asyncgrad as ag
from asyncgrad import distributed as dist
from asyncgrad.runtime import _row_support

ROWS, DIM = 20_000, 16  # 2.5 MB in float64: the embedding's untouched-zeros gradient


def f_nested(d: Any, k: float = 1.0) -> Any:
    """Tensors nested in dicts, lists and tuples, in and out."""
    x, (w, two) = d["a"]
    x2 = d["b"]["c"]
    return {"y": [ag.tanh(x @ w) * k], "z": (x2 * two, "tag"), "n": 5, "keep": ag.ones(2)}


class Hooked:
    """A remote layer whose weight has a tensor hook (doubles the gradient) and a post-accumulate hook."""

    def __init__(self, seed: int, fail_post: bool = False) -> None:
        rng = np.random.default_rng(seed)
        self.w = ag.tensor(rng.standard_normal((3, 3)), requires_grad=True)
        self.seen: list[float] = []
        self.pre = 0
        self.fail_post = fail_post

        def pre(g: Any) -> Any:
            self.pre += 1
            return g * 2

        def post(t: Any) -> None:
            if self.fail_post:
                raise ValueError("post hook refuses")
            self.seen.append(float(t.grad.sum().item()))

        self.w.register_hook(pre)
        self.w.register_post_accumulate_grad_hook(post)

    def forward(self, x: Any) -> Any:
        return ag.tanh(x @ self.w)

    def log(self) -> Any:
        return {"pre": self.pre, "seen": self.seen, "grad": None if self.w.grad is None else self.w.grad.detach()}


class BigTable:
    """A remote embedding table big enough for the row-sparse gradient path."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.weight = ag.tensor(rng.standard_normal((ROWS, DIM)) * 0.1, requires_grad=True)

    def forward(self, ids: Any) -> Any:
        return ag.embedding(ids, self.weight)

    def parameters(self) -> list[Any]:
        return [self.weight]

    def rows_bound(self) -> bool:
        # bound, and the gradient's array is the embedding's own (stolen at commit, not copied)
        g = self.weight.grad
        return g is not None and ag.runtime.rows_bound(g) and ag.runtime.noted_rows(g.numpy()) is not None

    def value(self) -> Any:
        return self.weight.detach()

    def grad(self) -> Any:
        return self.weight.grad.detach()  # a copy goes back (staged), nothing is handed out raw


async def pooled_bytes() -> int:
    """(on a worker) Bytes of cleared gradient mappings kept for reuse there, once the kernels queued so far
    ran (a gradient an update kernel still reads dies when that kernel is done)."""
    await ag.runtime.current_runtime().synchronize()
    return _row_support.pooled_bytes()


# ---- chains: code on one worker calling another ---------------------------------------------------------


async def relay(to: str, x: Any, w: Any) -> Any:
    """On worker A: its own op, then a call of worker ``to`` made here (recorded in A's graph)."""
    h = ag.tanh(x @ w)
    y = await dist.rpc(to, f_cube_sum, h)
    return y + h.sum(1)


def f_cube_sum(h: Any) -> Any:
    return (h * h * h).sum(1)


async def relay_rref(to: str, x: Any) -> Any:
    """On worker A: a layer made on worker ``to`` from here, called from here."""
    b = await dist.get_worker(to)
    layer = await b.remote(Hooked, 11)
    HOLD["layer"] = layer
    return await layer.call("forward", x)


async def relay_log() -> Any:
    return await HOLD["layer"].call("log")


async def relay_boom(to: str, x: Any) -> Any:
    return await dist.rpc(to, f_boom, ag.tanh(x))


HOLD: dict[str, Any] = {}


class _Boom(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        raise ValueError("boom at the end of the chain")


def f_boom(x: Any) -> Any:
    return _Boom.apply(x)


async def relay_rref_again(to: str, x: Any) -> Any:
    """On worker A: the layer on ``to`` made by `relay_rref`, called again from here."""
    return await HOLD["layer"].call("forward", x)


async def relay_die(to: str, x: Any) -> Any:
    """On worker A: a call of ``to`` whose backward kills ``to``'s process."""
    return await dist.rpc(to, f_die, ag.tanh(x))


def f_die(x: Any) -> Any:
    return _Die.apply(x)


class _Die(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x * 1

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        import os

        os._exit(3)
