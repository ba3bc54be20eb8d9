"""Worker-to-worker chains (trainer -> A -> B, where code on A calls B itself): the call is recorded in
A's graph and its backward goes A -> B directly; gradients against one process (float64, 1e-10);
atomicity across the three processes (a raising end of the chain commits nothing anywhere)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist

from . import _dag2_fns as F
from .conftest import TIMEOUT, children, fds

TOL = 1e-10


def _rand(seed: int, *shape: int) -> ag.Tensor:
    return ag.tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def _leaf(t: ag.Tensor) -> ag.Tensor:
    return t.detach().requires_grad_(True)


def _close(a: ag.Tensor | None, b: ag.Tensor | None) -> None:
    assert a is not None and b is not None
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=TOL)


async def test_chain_through_a_worker_calling_another(rt) -> None:
    before, files = children(), fds()
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as ws:
            a, b = ws[0], ws[1]
            assert await dist.get_worker(b.name) is b  # in the parent: the Worker itself
            x, w = _rand(0, 3, 4), _rand(1, 4, 5)
            y = await a.call(F.relay, b.name, x, w)  # A runs tanh, then calls B itself
            loss = (y * y).sum()
            await loss.backward()
            xl, wl = _leaf(x), _leaf(w)
            hl = ag.tanh(xl @ wl)
            yl = F.f_cube_sum(hl) + hl.sum(1)
            lossl = (yl * yl).sum()
            await lossl.backward()
            assert abs(loss.item() - lossl.item()) < TOL
            _close(x.grad, xl.grad)
            _close(w.grad, wl.grad)
            assert await b.call(dist.autograd.forwards_alive) >= 1  # B's part was recorded on B

            # a layer on B made and called by code on A: B's parameters commit (and B's hooks run)
            x2 = _rand(2, 2, 3)
            out = await a.call(F.relay_rref, b.name, x2)
            await out.sum().backward()
            local = F.Hooked(11)
            x2l = _leaf(x2)
            await local.forward(x2l).sum().backward()
            got = await a.call(F.relay_log)
            _close(got["grad"], local.w.grad)
            assert got["pre"] == 1 and len(got["seen"]) == 1
            _close(x2.grad, x2l.grad)

            # atomic across the three: the end of the chain raises, nothing is committed anywhere
            snap_b = (await a.call(F.relay_log))["grad"].numpy().tobytes()
            snap_x2 = x2.grad.numpy().tobytes()
            y2 = (await a.call(F.relay_rref_again, b.name, x2)).sum()
            y3 = (await a.call(F.relay_boom, b.name, x2)).sum()
            with pytest.raises(Exception, match="boom at the end of the chain"):
                await (y2 + y3).backward()
            assert (await a.call(F.relay_log))["grad"].numpy().tobytes() == snap_b
            assert x2.grad.numpy().tobytes() == snap_x2
            assert await b.call(dist.autograd.stages_pending) >= 0
            # everything stays usable
            y4 = (await a.call(F.relay_rref_again, b.name, x2)).sum()
            await y4.backward()
            assert len((await a.call(F.relay_log))["seen"]) == 2
    assert children() <= before
    assert fds() <= files


async def test_end_of_a_chain_dying_mid_backward(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as ws:
            a, b = ws[0], ws[1]
            x = _rand(3, 2, 3)
            out = await a.call(F.relay_rref, b.name, x)
            await out.sum().backward()
            snap_b = (await a.call(F.relay_log))["grad"].numpy().tobytes()
            snap_x = x.grad.numpy().tobytes()
            # B's layer and B's dying op in one pass through A: the pass fails, naming the dead worker
            y = (await a.call(F.relay_rref_again, b.name, x)).sum() + (await a.call(F.relay_die, b.name, x)).sum()
            # (A's error reaches the trainer as a RemoteError carrying A's WorkerDied)
            with pytest.raises(Exception, match=f"WorkerDied: worker '{b.name}' died"):
                await y.backward()
            assert x.grad.numpy().tobytes() == snap_x
            with pytest.raises(Exception, match="died"):
                await a.call(F.relay_log)  # B is gone: so is the layer A made there
            # A itself stays usable, and a new pass that does not need B commits
            await (await a.call(F.f_cube_sum, x)).sum().backward()
            assert x.grad.numpy().tobytes() != snap_x
            assert snap_b  # B's .grad went with B's process; every other .grad was left as it was
