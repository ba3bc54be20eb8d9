"""asyncgrad from asyncio: trio in guest mode on the asyncio loop, behind `open_asyncio_portal`.

These tests are plain (sync) functions that call `asyncio.run`: the asyncio program is the host, and the
trio run lives inside it as a guest, the way an asyncio web service would use asyncgrad.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.hosting import AsyncioPortal, PortalClosedError, open_asyncio_portal


def _asyncgrad_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("asyncgrad-")}


def _run_asyncio(main, *args):
    """Run an asyncio program and check it leaves no asyncgrad thread behind."""
    before = _asyncgrad_threads()
    result = asyncio.run(main(*args))
    assert _asyncgrad_threads() <= before, "an asyncgrad worker thread outlived the portal"
    return result


# ---- trio functions run through the portal ----------------------------------------------------------


def _mlp_loss(params, x, onehot):
    h = ag.tanh(x @ params["W1"] + params["b1"])
    logp = ag.log_softmax(h @ params["W2"] + params["b2"], dim=-1)
    return -(logp * onehot).sum() * (1.0 / x.shape[0])


def _np_mlp_loss(p, x, onehot):
    h = np.tanh(x @ p["W1"] + p["b1"])
    z = h @ p["W2"] + p["b2"]
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -(logp * onehot).sum() / x.shape[0]


async def _gradients(p0, x, onehot):
    """Gradients of the MLP loss w.r.t. every parameter (float64), as numpy arrays."""
    params = {k: ag.tensor(v, requires_grad=True) for k, v in p0.items()}
    loss = _mlp_loss(params, ag.tensor(x), ag.tensor(onehot))
    await loss.backward()
    out = {}
    for k, p in params.items():
        await p.grad.ready()  # never block the (shared) asyncio loop on a pending value
        out[k] = p.grad.numpy().copy()
    await loss.ready()
    return loss.item(), out


async def _train(p0, x, onehot, steps, lr):
    params = {k: ag.tensor(v, requires_grad=True) for k, v in p0.items()}
    xs, ys = ag.tensor(x), ag.tensor(onehot)
    losses = []
    for _ in range(steps):
        loss = _mlp_loss(params, xs, ys)
        await loss.backward()
        with ag.no_grad():
            for p in params.values():
                p -= lr * p.grad
                p.grad = None
        await loss.ready()
        losses.append(loss.item())
    return losses


async def _train_until_cancelled(state, width=192):
    """A long training whose kernels are big enough to run on the lanes; records how it ended."""
    rng = np.random.default_rng(0)
    W = ag.tensor(rng.standard_normal((width, width)) * 0.05, requires_grad=True)
    x = ag.tensor(rng.standard_normal((width, width)))
    state["steps"] = 0
    try:
        while True:
            loss = (ag.tanh(x @ W) ** 2).mean()
            await loss.backward()
            with ag.no_grad():
                W -= 0.1 * W.grad
                W.grad = None
            state["steps"] += 1
    except trio.Cancelled:
        state["cancelled_at"] = time.perf_counter()
        raise


def _problem(seed=0, n=24, d=8, hidden=6, k=4):
    rng = np.random.default_rng(seed)
    p0 = {
        "W1": rng.standard_normal((d, hidden)) * 0.5,
        "b1": rng.standard_normal(hidden) * 0.1,
        "W2": rng.standard_normal((hidden, k)) * 0.5,
        "b2": rng.standard_normal(k) * 0.1,
    }
    x = rng.standard_normal((n, d))
    onehot = np.eye(k)[rng.integers(0, k, n)]
    return p0, x, onehot


# ---- tests ----------------------------------------------------------------------------------------------


def test_portal_trains_with_correct_gradients():
    p0, x, onehot = _problem()

    async def main():
        async with open_asyncio_portal(lanes=2) as portal:
            assert isinstance(portal, AsyncioPortal)
            assert len(portal.runtime.threads()) == 2
            assert all(t.is_alive() for t in portal.runtime.threads())
            loss, grads = await portal.run(_gradients, p0, x, onehot)
            losses = await portal.run(_train, p0, x, onehot, 60, 0.5)
            threads = portal.runtime.threads()
        return loss, grads, losses, threads

    loss, grads, losses, threads = _run_asyncio(main)
    assert not any(t.is_alive() for t in threads)
    assert loss == pytest.approx(_np_mlp_loss(p0, x, onehot), rel=1e-10)
    # central finite differences of the numpy loss, float64
    eps = 1e-6
    for name, g in grads.items():
        fd = np.zeros_like(p0[name])
        for idx in np.ndindex(fd.shape):
            hi = {k: v.copy() for k, v in p0.items()}
            lo = {k: v.copy() for k, v in p0.items()}
            hi[name][idx] += eps
            lo[name][idx] -= eps
            fd[idx] = (_np_mlp_loss(hi, x, onehot) - _np_mlp_loss(lo, x, onehot)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-8, err_msg=f"d loss / d {name}")
    assert losses[-1] < 0.5 * losses[0], (
        f"training through the portal did not learn: {losses[0]} -> {losses[-1]}"
    )


def test_cancel_from_asyncio_cancels_the_trio_task():
    async def main():
        async with open_asyncio_portal(lanes=2) as portal:
            # 1. asyncio.wait_for timeout
            s1: dict = {}
            t0 = time.perf_counter()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(portal.run(_train_until_cancelled, s1), timeout=0.3)
            waited = time.perf_counter() - t0
            # 2. task.cancel()
            s2: dict = {}
            task = asyncio.create_task(portal.run(_train_until_cancelled, s2))
            while s2.get("steps", 0) < 3:
                await asyncio.sleep(0.01)
            cancel_time = time.perf_counter()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            returned = time.perf_counter()
            steps_at_return = s2["steps"]
            await asyncio.sleep(0.1)
            # 3. the portal still serves calls afterwards
            loss, _ = await portal.run(_gradients, *_problem())
            stats = portal.statistics()
        return s1, waited, s2, cancel_time, returned, steps_at_return, loss, stats

    s1, waited, s2, cancel_time, returned, steps_at_return, loss, stats = _run_asyncio(main)
    assert s1["steps"] > 0 and "cancelled_at" in s1, "the trio task did not see the asyncio timeout"
    assert waited < 2.0
    assert s2["steps"] >= 3 and "cancelled_at" in s2
    # the CancelledError arrives only after the trio task has stopped, and promptly
    assert s2["cancelled_at"] <= returned
    assert returned - cancel_time < 1.0, f"cancellation took {returned - cancel_time:.3f}s"
    assert s2["steps"] == steps_at_return, "the trio training kept running after the asyncio side returned"
    assert np.isfinite(loss)
    assert stats == {"calls_started": 3, "calls_active": 0}


def test_errors_and_trio_side_cancellation_reach_asyncio():
    async def boom(msg):
        await trio.sleep(0)
        raise ValueError(msg)

    async def cancelled_in_trio():
        # a trio-side cancellation that ends the task: the portal shutting down does the same
        with trio.CancelScope() as cs:
            cs.cancel()
            await trio.sleep(10)
        await trio.lowlevel.checkpoint()
        return "caught by its own scope"

    async def main():
        async with open_asyncio_portal(lanes=1) as portal:
            with pytest.raises(ValueError, match="from trio"):
                await portal.run(boom, "from trio")
            assert await portal.run(cancelled_in_trio) == "caught by its own scope"

            async def stop_iteration():
                raise StopIteration  # asyncio futures refuse it: it arrives wrapped

            with pytest.raises(RuntimeError, match="StopIteration"):
                await portal.run(stop_iteration)
            s: dict = {}
            pending = asyncio.create_task(portal.run(_train_until_cancelled, s))
            while s.get("steps", 0) < 1:
                await asyncio.sleep(0.01)
            with pytest.raises(RuntimeError, match="already hosts"):
                async with open_asyncio_portal():
                    pass
        # leaving the portal cancelled the outstanding call on the trio side
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert "cancelled_at" in s
        assert portal.closed
        with pytest.raises(PortalClosedError):
            await portal.run(boom, "after close")
        # a new portal can be opened on the same loop once the first one closed
        async with open_asyncio_portal(lanes=1) as portal2:
            loss, _ = await portal2.run(_gradients, *_problem(seed=3))
        return loss

    assert np.isfinite(_run_asyncio(main))


def test_many_concurrent_calls():
    problems = [_problem(seed=s) for s in range(12)]

    async def main():
        async with open_asyncio_portal(lanes=2) as portal:
            return await asyncio.gather(*(portal.run(_gradients, *p) for p in problems))

    for (p0, x, onehot), (loss, grads) in zip(problems, _run_asyncio(main)):
        assert loss == pytest.approx(_np_mlp_loss(p0, x, onehot), rel=1e-10)
        assert set(grads) == set(p0)


def test_startup_failure_is_raised_and_cleaned_up():
    async def main():
        with pytest.raises(ValueError, match="lane"):
            async with open_asyncio_portal(lanes=0):
                pass
        async with open_asyncio_portal(lanes=1) as portal:
            return await portal.run(_gradients, *_problem(seed=1))

    loss, _ = _run_asyncio(main)
    assert np.isfinite(loss)


def test_asyncio_loop_stays_responsive_while_training_through_the_portal():
    async def main():
        lateness: list[float] = []
        stop = asyncio.Event()

        async def heartbeat():
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.002)
                lateness.append(time.perf_counter() - t - 0.002)

        async with open_asyncio_portal(lanes=2) as portal:
            hb = asyncio.create_task(heartbeat())
            s: dict = {}
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(portal.run(_train_until_cancelled, s, 256), timeout=1.0)
            stop.set()
            await hb
        return lateness, s["steps"]

    lateness, steps = _run_asyncio(main)
    assert steps > 5
    worst = max(lateness)
    print(
        f"asyncio heartbeat while training via the portal: {len(lateness)} beats, "
        f"p99 {np.percentile(lateness, 99) * 1e3:.1f} ms, max {worst * 1e3:.1f} ms, {steps} steps"
    )
    assert worst < 0.25, f"the asyncio loop stalled {worst * 1e3:.0f} ms"
