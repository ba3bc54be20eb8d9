"""`DistributedOptimizer.zero_grad` and `step` do not wait for the workers: every later call from this
process sees the gradients reset and the parameters stepped (connection order), and their outcome (an
error, a dead worker) is raised by a later `step` or `zero_grad`. Checked over real worker processes
against the same training in one process."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist

from . import _dag_fns as F
from . import _optim_fns as O
from .conftest import TIMEOUT


async def test_zero_grad_and_step_are_ordered_before_every_later_call(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as ws:
            la = await ws[0].remote(F.Layer, 3, 2, 1)
            A = F.Layer(3, 2, 1)
            opt = dist.DistributedOptimizer(ag.optim.SGD, [la], lr=0.1)
            lopt = ag.optim.SGD(A.parameters(), lr=0.1)
            rng = np.random.default_rng(0)
            for i in range(12):
                x = ag.tensor(rng.standard_normal((4, 3)))
                await opt.zero_grad()
                lopt.zero_grad()
                # the very next call (no wait in between; a method of the object or a function given it)
                # sees the reset
                if i % 2:
                    assert await ws[0].call(O.grad_is_none, la)
                else:
                    assert await la.call("grads") == [None, None]
                # and a distributed backward right after it accumulates into fresh gradients
                await (await la.call("forward", x)).sum().backward()
                await A.forward(x).sum().backward()
                for got, want in zip(await la.call("grads"), A.grads()):
                    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-10)
                await opt.step()
                lopt.step()
                if i % 3 == 2:  # the very next call, sent without waiting for the step, reads it stepped
                    for got, want in zip(await la.call("params"), A.params()):
                        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-10)
            for got, want in zip(await la.call("params"), A.params()):
                np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-10)


async def _layer_and_optimizer(w: dist.Worker, optimizer_class: Any) -> tuple[Any, dist.DistributedOptimizer]:
    la = await w.remote(F.Layer, 3, 2, 1)
    return la, dist.DistributedOptimizer(optimizer_class, [la], lr=0.1)


async def test_a_failed_zero_grad_raises_at_the_next_step_or_zero_grad(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as ws:
            la, opt = await _layer_and_optimizer(ws[0], O.BadZero)
            await opt.zero_grad()  # returns: the worker's error is not in yet
            with pytest.raises(ValueError, match="zero_grad boom on the worker"):
                await opt.step()
            before = await la.call("params")
            await opt.step()  # raised once: the optimizer goes on
            await opt.zero_grad()
            with pytest.raises(ValueError, match="zero_grad boom on the worker"):
                await opt.zero_grad()  # the previous one's error, raised before sending another
            await opt.step()  # so nothing is outstanding
            # no gradients: steps change nothing, and the error did not stop the calls after it
            for got, want in zip(await la.call("params"), before):
                np.testing.assert_array_equal(got.numpy(), want.numpy())


async def test_a_worker_dying_after_zero_grad_raises_worker_died_at_the_next_step(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as ws:
            la = await ws[0].remote(F.Layer, 3, 2, 1)
            lb = await ws[1].remote(F.Layer, 3, 2, 2)
            opt = dist.DistributedOptimizer(ag.optim.SGD, [la, lb], lr=0.1)
            await opt.step()
            await opt.zero_grad()
            os.kill(ws[0].pid, signal.SIGKILL)
            with pytest.raises(dist.WorkerDied) as ei:
                while True:  # the reply to zero_grad may have come before the kill: then step itself fails
                    await opt.step()
                    await opt.zero_grad()
            assert ei.value.worker == "worker0"
            assert await lb.call("grads") == [None, None]  # the other worker carried on


async def test_a_failed_step_raises_at_the_next_step(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as ws:
            la, opt = await _layer_and_optimizer(ws[0], O.BadStep)
            await opt.step()  # returns: the worker's error is not read yet
            with pytest.raises(ValueError, match="step boom on the worker") as ei:
                await opt.step()
            assert any("DistributedOptimizer.step()" in n for n in getattr(ei.value, "__notes__", []))
            # raised before sending another: nothing is outstanding now
            await opt.zero_grad()
            await opt.step()
            assert await la.call("grads") == [None, None]  # served after the step, whose reply came first
            with pytest.raises(ValueError, match="step boom on the worker"):
                await opt.zero_grad()  # that reply is in: read here, not left for the next step
            await opt.zero_grad()  # raised once
