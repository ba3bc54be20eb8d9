"""Large factories fill on a lane and return a pending tensor; small ones stay inline. Also the exact sum
of many concurrent backward passes into shared leaves (the short form of the soak's check)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.runtime._tensor import is_ready


def grad_of(t: ag.Tensor) -> ag.Tensor:
    g = t.grad
    assert g is not None, "no gradient"
    return g


BIG = (1024, 512)  # 2 MiB of float32: above the lane threshold (1 MiB)


async def test_big_randn_is_pending_and_reproducible(rt) -> None:
    with trio.fail_after(30):
        ag.manual_seed(7)
        a = ag.randn(*BIG)
        small = ag.randn(3)
        assert not is_ready(a) or a._stream is not None  # queued on a stream, not filled on the loop
        assert is_ready(small) and small._stream is None
        assert a.shape == BIG and a.dtype == np.float32
        va = (await a.ready()).numpy().copy()
        assert abs(va.mean()) < 0.01 and abs(va.std() - 1) < 0.01
        ag.manual_seed(7)
        b = ag.randn(*BIG)
        small2 = ag.randn(3)
        np.testing.assert_array_equal((await b.ready()).numpy(), va)
        np.testing.assert_array_equal(small2.numpy(), small.numpy())


async def test_big_factories_values(rt) -> None:
    with trio.fail_after(30):
        o = ag.ones(*BIG, requires_grad=True)
        f = ag.full(BIG, 2.5, dtype=np.float64)
        r = ag.rand(*BIG)
        n = ag.normal(3.0, 0.5, BIG)
        rl = ag.randn_like(f)
        assert o.requires_grad and o.is_leaf
        await rt.synchronize()  # numpy() below would wait for all five fills (and warn)
        np.testing.assert_array_equal((await o.ready()).numpy(), np.ones(BIG, np.float32))
        np.testing.assert_array_equal((await f.ready()).numpy(), np.full(BIG, 2.5))
        vr = (await r.ready()).numpy()
        assert vr.min() >= 0 and vr.max() < 1 and abs(vr.mean() - 0.5) < 0.01
        assert abs((await n.ready()).numpy().mean() - 3.0) < 0.01
        assert rl.dtype == np.float64 and abs((await rl.ready()).numpy().std() - 1) < 0.01
        # a leaf filled on a lane trains like any other
        await (o * f).sum().backward()
        await rt.synchronize()
        np.testing.assert_allclose(grad_of(o).numpy(), np.full(BIG, 2.5, np.float32))


async def test_tensor_of_a_big_array_copies_on_a_lane(rt) -> None:
    with trio.fail_after(30):
        src = np.arange(np.prod(BIG), dtype=np.float32).reshape(BIG)
        t = ag.tensor(src)
        if not is_ready(t):  # the copy has not run yet: the source is guarded against writes meanwhile
            with pytest.raises(ValueError, match="read-only"):
                src[0, 0] = -1.0
        await t.ready()
        assert src.flags.writeable
        src[0, 0] = 123.0  # after the copy: the tensor keeps its own values
        assert t.numpy()[0, 0] == 0.0
        np.testing.assert_array_equal(t.numpy()[1], np.arange(BIG[1], 2 * BIG[1], dtype=np.float32))
        t64 = ag.tensor(src, dtype=np.float64)
        assert t64.dtype == np.float64
        np.testing.assert_array_equal((await t64.ready()).numpy(), src.astype(np.float64))


async def test_big_randn_does_not_block_the_loop(rt) -> None:
    with trio.fail_after(30):
        ag.randn(8)  # the task's stream exists before timing
        t0 = time.perf_counter()
        a = ag.randn(4096, 1024)  # 16 MiB: ~100 ms of sampling
        called = time.perf_counter() - t0
        t0 = time.perf_counter()
        await a.ready()
        filled = time.perf_counter() - t0
        print(f"randn(4096, 1024): call {called * 1e3:.2f} ms on the loop, fill {filled * 1e3:.1f} ms on a lane")
        assert called < filled


async def test_concurrent_backward_passes_into_shared_leaves_sum_exactly(rt) -> None:
    """100 passes in as many tasks, each adding k * x (k = 1..100) into the same two leaves: exact sums."""
    with trio.fail_after(60):
        w = ag.tensor(np.zeros(64), requires_grad=True)
        b = ag.tensor(np.zeros(8), requires_grad=True)
        x = np.arange(64.0)
        xt = ag.tensor(x)
        n = 100

        async def one(k: int) -> None:
            await ((w * xt).sum() * float(k) + (b * float(k)).sum()).backward()

        async with trio.open_nursery() as nursery:
            for k in range(1, n + 1):
                nursery.start_soon(one, k)
        total = n * (n + 1) // 2  # integers times exactly representable values: exact in float64
        np.testing.assert_array_equal((await grad_of(w).ready()).numpy(), x * total)
        np.testing.assert_array_equal((await grad_of(b).ready()).numpy(), np.full(8, float(total)))
