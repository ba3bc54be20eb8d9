"""Distributed autograd over real worker processes: tensors nested in arguments and results, hooks of
remote parameters at commit, and the row-sparse table gradient (W8's path) against one process."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist

from . import _dag2_fns as F
from .conftest import TIMEOUT

TOL = 1e-10


def _rand(seed: int, *shape: int) -> ag.Tensor:
    return ag.tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def _leaf(t: ag.Tensor) -> ag.Tensor:
    return t.detach().requires_grad_(True)


def _close(a: ag.Tensor | None, b: ag.Tensor | None) -> None:
    assert a is not None and b is not None
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=TOL)


async def test_nested_arguments_and_results(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as ws:
            x, w, x2 = _rand(0, 3, 4), _rand(1, 4, 2), _rand(2, 5)
            out = await ws[0].call(F.f_nested, {"a": [x, (w, 2.0)], "b": {"c": x2}}, k=0.5)
            assert set(out) == {"y", "z", "n", "keep"} and out["n"] == 5 and out["z"][1] == "tag"
            assert isinstance(out["y"], list) and isinstance(out["z"], tuple)
            assert out["y"][0].requires_grad and out["z"][0].requires_grad and not out["keep"].requires_grad
            await ((out["y"][0] ** 2).sum() + out["z"][0].sum() * 3).backward()
            xl, wl, x2l = _leaf(x), _leaf(w), _leaf(x2)
            ol = F.f_nested({"a": [xl, (wl, 2.0)], "b": {"c": x2l}}, k=0.5)
            await ((ol["y"][0] ** 2).sum() + ol["z"][0].sum() * 3).backward()
            for got, want in ((x, xl), (w, wl), (x2, x2l)):
                _close(got.grad, want.grad)
            # only a nested tensor requires grad: still recorded
            x3, w3 = _rand(3, 3, 4), ag.ones((4, 2), dtype=np.float64)
            out3 = await ws[0].call(F.f_nested, {"a": [x3, (w3, 1.0)], "b": {"c": ag.ones(1)}})
            await out3["y"][0].sum().backward()
            x3l = _leaf(x3)
            await F.f_nested({"a": [x3l, (w3, 1.0)], "b": {"c": ag.ones(1)}})["y"][0].sum().backward()
            _close(x3.grad, x3l.grad)


async def test_hooks_of_remote_parameters_run_at_commit(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as ws:
            lay = await ws[0].remote(F.Hooked, 5)
            x = _rand(6, 2, 3)
            await (await lay.call("forward", x)).sum().backward()
            local = F.Hooked(5)
            xl = _leaf(x)
            await local.forward(xl).sum().backward()
            got = await lay.call("log")
            assert got["pre"] == 1 == local.pre
            _close(got["grad"], local.w.grad)  # the tensor hook doubled it, as locally
            assert got["seen"] == pytest.approx(local.seen, abs=TOL) and len(got["seen"]) == 1
            _close(x.grad, xl.grad)


async def test_post_hook_failure_and_failed_pass(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as ws:
            lay = await ws[0].remote(F.Hooked, 5)
            x = _rand(7, 2, 3)
            await (await lay.call("forward", x)).sum().backward()
            before = await lay.call("log")
            # the same pass through a remote backward that raises: nothing is committed, no post hook
            y = (await lay.call("forward", x)).sum() + (await ws[1].call(F.f_boom, x)).sum()
            with pytest.raises(Exception, match="boom at the end of the chain"):
                await y.backward()
            after = await lay.call("log")
            assert after["seen"] == before["seen"]
            assert after["grad"].numpy().tobytes() == before["grad"].numpy().tobytes()
            # a post-accumulate hook that raises at commit: that worker's .grad put back, the next call says so
            bad = await ws[1].remote(F.Hooked, 8, True)
            await (await bad.call("forward", x)).sum().backward()
            assert (await bad.call("log"))["grad"] is None
            with pytest.raises(RuntimeError, match=r"could not commit.*post hook refuses"):
                await bad.call("forward", x)
            # and the worker stays usable
            assert (await lay.call("forward", x)).shape == (2, 3)


@pytest.mark.parametrize("recycled", [False, True])
async def test_row_sparse_table_steps_as_one_process(rt, recycled: bool) -> None:
    # recycled: nothing reads the worker's gradient raw, so each step's mapping is cleared and reused for
    # the next one (`rows_bound` reads it through `.numpy()`, which lets its mapping go)
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as ws:
            tab = await ws[0].remote(F.BigTable, 3)
            opt = dist.optim.DistributedOptimizer(ag.optim.SGD, [tab], lr=0.5)
            local = F.BigTable(3)
            lopt = ag.optim.SGD(local.parameters(), lr=0.5)
            rng = np.random.default_rng(4)
            for _ in range(6 if recycled else 3):
                ids = ag.tensor(rng.integers(0, F.ROWS, size=(32, 2)))
                target = ag.tensor(rng.standard_normal((32, 2, F.DIM)))
                await opt.zero_grad()
                await (((await tab.call("forward", ids)) - target) ** 2).sum().backward()
                if not recycled:
                    assert await tab.call("rows_bound")  # the optimizer steps the written rows only
                lopt.zero_grad()
                await ((local.forward(ids) - target) ** 2).sum().backward()
                if recycled:  # all of it: zero outside this step's rows
                    _close(await tab.call("grad"), local.weight.grad)
                await opt.step()
                lopt.step()
            if recycled:
                await opt.zero_grad()
                assert await ws[0].call(F.pooled_bytes) >= F.ROWS * F.DIM * 8  # the last gradient was kept
            await rt.synchronize()
            _close(await tab.call("value"), local.value())
