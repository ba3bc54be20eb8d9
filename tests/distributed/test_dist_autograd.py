"""Distributed autograd over real worker processes: gradients vs the same model in one process (float64,
1e-10), atomicity of remote `.grad` under failure, cancellation and a dying worker, DistributedOptimizer."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist

from . import _dag_fns as F
from .conftest import TIMEOUT, children, fds, threads

TOL = 1e-10


def _rand(seed: int, *shape: int, rg: bool = True) -> ag.Tensor:
    return ag.tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=rg)


def _leaf(t: ag.Tensor) -> ag.Tensor:
    return t.detach().requires_grad_(True)


def _close(a: ag.Tensor | None, b: ag.Tensor | None) -> None:
    assert a is not None and b is not None
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=TOL)


def _snap(gs: list[ag.Tensor | None]) -> list[bytes | None]:
    return [None if g is None else g.numpy().tobytes() for g in gs]


async def test_chain_fanout_repeat_and_rref_params(rt) -> None:
    before, files, ths = children(), fds(), threads()
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as ws:
            a, b = ws[0], ws[1]
            x, w = _rand(0, 3, 4), _rand(1, 4, 5)
            # chain trainer -> a -> b, fan-out to both, the same worker called twice
            h = await a.call(F.f_tanh, x, w)
            z = await b.call(F.f_square_sum, h)
            y1, s1 = await a.call(F.f_two, h, 0.5)
            y2 = await a.call(F.f_square_sum, y1)
            loss = z.sum() + y2.sum() + s1.sum()
            await loss.backward()
            xl, wl = _leaf(x), _leaf(w)
            hl = F.f_tanh(xl, wl)
            y1l, s1l = F.f_two(hl, 0.5)
            lossl = F.f_square_sum(hl).sum() + F.f_square_sum(y1l).sum() + s1l.sum()
            await lossl.backward()
            _close(x.grad, xl.grad)
            _close(w.grad, wl.grad)
            assert abs(loss.item() - lossl.item()) < TOL

            # remote parameters through RRefs, on two workers, the layer called twice
            la = await a.remote(F.Layer, 4, 4, 7)
            lb = await b.remote(F.Layer, 4, 2, 8)
            x2 = _rand(2, 5, 4)
            out = await lb.call("forward", await la.call("forward", await la.call("forward", x2)))
            await (out * out).sum().backward()
            A, B = F.Layer(4, 4, 7), F.Layer(4, 2, 8)
            x2l = _leaf(x2)
            outl = B.forward(A.forward(A.forward(x2l)))
            await (outl * outl).sum().backward()
            _close(x2.grad, x2l.grad)
            for got, want in zip([*await la.call("grads"), *await lb.call("grads")], [*A.grads(), *B.grads()]):
                _close(got, want)

            # retain_graph as locally: twice with it sums, a third time without it raises
            x3 = _rand(3, 2, 4)
            y3 = (await a.call(F.f_square_sum, x3)).sum()
            await y3.backward(retain_graph=True)
            await y3.backward()
            _close(x3.grad, 4 * x3.detach())
            with pytest.raises(RuntimeError, match="second time"):
                await y3.backward()

            # create_graph=True: a clear error
            x4 = _rand(4, 2, 4)
            y4 = (await a.call(F.f_square_sum, x4)).sum()
            with pytest.raises(RuntimeError, match="create_graph=True"):
                await ag.grad(y4, x4, create_graph=True)

            # an integer-index call on a remote table (no input requires grad): the table still learns
            tab = await a.remote(F.Table, 10, 3, 9)
            idx = ag.tensor(np.array([1, 3, 3, 7]))
            e = await tab.call("forward", idx)
            assert e.requires_grad
            await (e * e).sum().backward()
            T = F.Table(10, 3, 9)
            await (T.forward(idx) ** 2).sum().backward()
            _close((await tab.call("grads"))[0], T.weight.grad)
            del h, z, y1, s1, y2, loss, out, y3, y4, e
            import gc

            gc.collect()
            await trio.sleep(0.2)
            assert await a.call(dist.autograd.forwards_alive) <= 1  # (x4's graph may still be referenced)
    assert children() <= before
    assert fds() <= files and threads() <= ths


async def test_atomic_failure_cancel_and_death(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(3) as ws:
            a, b, c = ws[0], ws[1], ws[2]
            la = await a.remote(F.Layer, 3, 3, 1)
            lb = await b.remote(F.Layer, 3, 3, 2)
            wl = _rand(5, 3, 3)  # a local parameter too
            # give everything a .grad first, so "as it was" is a value, not None
            x = _rand(6, 4, 3)
            await ((await lb.call("forward", await la.call("forward", x))) @ wl).sum().backward()

            async def snapshot() -> list[bytes | None]:
                return _snap([*await la.call("grads"), *await lb.call("grads"), wl.grad, x.grad])

            before = await snapshot()

            # 1. a remote backward that raises (on c, after a and b have staged theirs)
            # c's node is created first, so it runs last: a and b have staged theirs by then
            bad = await c.call(F.f_boom, x)
            h = await lb.call("forward", await la.call("forward", x))
            loss = (bad @ wl).sum() + (h * h).sum()
            with pytest.raises(ValueError, match="boom in the remote backward"):
                await loss.backward()
            # a and b had staged theirs (prepared), and the pass committed none of it
            assert await a.call(dist.autograd.stages_pending) >= 1
            assert await b.call(dist.autograd.stages_pending) >= 1
            assert await snapshot() == before

            # 2. cancelled half-way (c's backward sleeps)
            # c's node is created first, so it runs last: a and b have staged theirs by then
            slow = await c.call(F.f_slow, x)
            h = await lb.call("forward", await la.call("forward", x))
            loss = (slow @ wl).sum() + (h * h).sum()
            with trio.move_on_after(30) as scope:
                async with trio.open_nursery() as n:
                    n.start_soon(loss.backward)
                    while not await c.call(F.slow_started):
                        await trio.sleep(0.05)
                    n.cancel_scope.cancel()
            assert not scope.cancelled_caught
            # a and b had staged theirs (prepared), and the pass committed none of it
            assert await a.call(dist.autograd.stages_pending) >= 1
            assert await b.call(dist.autograd.stages_pending) >= 1
            assert await snapshot() == before

            # still usable: a good pass commits everywhere
            h = await lb.call("forward", await la.call("forward", x))
            await ((h @ wl).sum()).backward()
            assert await snapshot() != before
            before = await snapshot()

            # 3. a worker dying mid-backward fails the pass with WorkerDied, nothing committed anywhere
            # c's node is created first, so it runs last: a and b have staged theirs by then
            d = await c.call(F.f_die, x)
            h = await lb.call("forward", await la.call("forward", x))
            loss = (d @ wl).sum() + (h * h).sum()
            with pytest.raises(dist.WorkerDied):
                await loss.backward()
            # a and b had staged theirs (prepared), and the pass committed none of it
            assert await a.call(dist.autograd.stages_pending) >= 1
            assert await b.call(dist.autograd.stages_pending) >= 1
            assert await snapshot() == before


async def test_concurrent_passes_sum_and_distributed_optimizer(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as ws:
            la = await ws[0].remote(F.Layer, 3, 3, 1)
            lb = await ws[1].remote(F.Layer, 3, 1, 2)
            xs = [_rand(10 + i, 4, 3, rg=False) for i in range(3)]

            async def one(x: ag.Tensor) -> None:
                out = await lb.call("forward", await la.call("forward", x))
                await out.sum().backward()

            async with trio.open_nursery() as n:
                for x in xs:
                    n.start_soon(one, x)
            A, B = F.Layer(3, 3, 1), F.Layer(3, 1, 2)
            for x in xs:
                await B.forward(A.forward(x)).sum().backward()
            for got, want in zip([*await la.call("grads"), *await lb.call("grads")], [*A.grads(), *B.grads()]):
                _close(got, want)

            opt = dist.DistributedOptimizer(ag.optim.SGD, [la, lb], lr=0.1)
            lopt = ag.optim.SGD([*A.parameters(), *B.parameters()], lr=0.1)
            await opt.step()
            lopt.step()
            for got, want in zip([*await la.call("params"), *await lb.call("params")], [*A.params(), *B.params()]):
                _close(got, want)
            await opt.zero_grad()
            assert await la.call("grads") == [None, None]
            with pytest.raises(TypeError, match="RRefs"):
                dist.DistributedOptimizer(ag.optim.SGD, [A.w], lr=0.1)
