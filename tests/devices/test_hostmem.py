"""The CPU device's host cache (large kernel outputs reuse freed buffers) and kernels split across lanes."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.devices import HOST_CACHE_MIN_BYTES, HostCache, _blas, private_base, run_parts
from asyncgrad.ops._linalg import SPLIT_MIN_FLOPS

TIMEOUT = 30
BIG = (HOST_CACHE_MIN_BYTES // 8 + 100,)  # float64 elements just over the pooling threshold


@pytest.fixture(autouse=True)
def _all_cores_spare() -> Any:
    """These tests count BLAS switches and split slices as on a machine of our own: what other
    processes happen to run (a shared CI machine) must not change them (`_blas.spare_cores`)."""
    _blas.pin_spare_cores(os.cpu_count() or 1)
    yield
    _blas.pin_spare_cores(None)


def test_a_dead_array_gives_its_buffer_back() -> None:
    cache = HostCache(1 << 30)
    a = cache.empty(BIG, np.float64)
    addr = a.ctypes.data
    del a
    assert cache.statistics().recycled == 1
    b = cache.empty(BIG, np.float64)
    assert b.ctypes.data == addr
    assert cache.statistics().hits == 1


def test_a_buffer_with_a_live_view_is_never_handed_out_again() -> None:
    cache = HostCache(1 << 30)
    a = cache.empty(BIG, np.float64)
    a[:] = 7.0
    view = a[10:20]
    del a
    s = cache.statistics()
    assert (s.recycled, s.released) == (0, 1)
    b = cache.empty(BIG, np.float64)
    b[:] = -1.0
    assert np.all(view == 7.0)
    assert b.ctypes.data != view.ctypes.data - 80


def test_small_arrays_are_not_pooled_and_the_cap_holds() -> None:
    cache = HostCache(max_cached_bytes=0)
    small = cache.empty((4,), np.float32)
    assert small.base is None
    a = cache.empty(BIG, np.float64)
    del a
    s = cache.statistics()
    assert (s.recycled, s.released, s.cached_bytes) == (0, 1, 0)


def test_empty_cache_and_close_drop_the_free_buffers() -> None:
    cache = HostCache(1 << 30)
    arrays = [cache.empty(BIG, np.float64) for _ in range(3)]
    del arrays
    assert cache.statistics().cached_bytes >= 3 * HOST_CACHE_MIN_BYTES
    cache.empty_cache()
    assert cache.statistics().cached_bytes == 0
    cache.close()
    a = cache.empty(BIG, np.float64)
    del a
    assert cache.statistics().cached_bytes == 0


def test_private_base_sees_other_views() -> None:
    cache = HostCache(1 << 30)
    a = cache.empty(BIG, np.float64)
    assert private_base(a)
    v = a[1:]
    assert not private_base(a)
    del v
    assert private_base(a)
    plain = np.zeros(5)
    assert private_base(plain)
    assert not private_base(plain[1:])  # `plain` itself still holds the memory
    # a strided view (`as_strided`, as unfold makes) sits on a wrapper held by it alone; the memory under
    # the wrapper is `plain`'s, still held
    assert not private_base(np.lib.stride_tricks.as_strided(plain, (4, 2), (8, 8)))


async def test_values_held_by_the_user_survive_buffer_reuse() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 300))
    async with ag.open_runtime() as rt:
        t = ag.tensor(w) * 2.0
        held = t.numpy()  # the user keeps the array itself
        expect = held.copy()
        del t
        for _ in range(5):
            u = ag.tensor(w) * 3.0
            await u.ready()
            del u
        np.testing.assert_array_equal(held, expect)
        assert rt.devices["cpu"].host_cache.statistics().hits >= 3  # the other products did reuse


async def test_a_big_gradient_from_a_pooled_buffer_is_stolen_not_copied() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 384))
    w = rng.standard_normal((384, 256))
    async with ag.open_runtime() as rt:
        W = ag.tensor(w, requires_grad=True)
        before = rt.statistics()
        loss = (ag.tensor(x) @ W).sum()
        await loss.backward()
        await W.grad.ready()  # the steal-or-copy kernel runs in stream order after the pass
        after = rt.statistics()
        assert after.grads_stolen - before.grads_stolen == 1
        assert after.grads_copied == before.grads_copied
        np.testing.assert_allclose(W.grad.numpy(), x.sum(0)[:, None] * np.ones((1, 256)), rtol=1e-12)


@pytest.mark.parametrize("how", ["blas-boost", "lane-split"])
@pytest.mark.parametrize("shape", [(600, 200, 300), (64, 700, 900), (9, 3000, 1000)])
async def test_a_split_matmul_and_its_gradients_match_numpy(
    shape: tuple[int, int, int], how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, k, n = shape
    assert 2 * m * n * k >= SPLIT_MIN_FLOPS
    if how == "lane-split":
        monkeypatch.setattr(_blas, "_setter", False)  # as with a BLAS whose threads cannot be switched
    rng = np.random.default_rng(2)
    a, b, g = rng.standard_normal((m, k)), rng.standard_normal((k, n)), rng.standard_normal((m, n))
    async with ag.open_runtime(lanes=2):
        with trio.fail_after(TIMEOUT):
            A, B = ag.tensor(a, requires_grad=True), ag.tensor(b, requires_grad=True)
            out = A @ B
            await out.backward(ag.tensor(g))
            np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(A.grad.numpy(), g @ b.T, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(B.grad.numpy(), a.T @ g, rtol=1e-12, atol=1e-12)


async def test_a_lone_training_runs_with_every_lanes_blas_threads_and_shares_them_when_another_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not _blas.boost_available():
        pytest.skip("this BLAS is not a pthreads OpenBLAS: big products are split across lanes instead")
    from asyncgrad.runtime._runtime import current_stream

    calls: list[int] = []
    real = _blas._setter

    def spy(threads: int) -> None:
        calls.append(threads)
        real(threads)

    monkeypatch.setattr(_blas, "_setter", spy)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((400, 300)), rng.standard_normal((300, 500))
    small = rng.standard_normal((30, 40))
    async with ag.open_runtime(lanes=2) as rt:
        await _idle_lanes(rt)
        with trio.fail_after(TIMEOUT):
            # one task, one stream in the process: its lane switches to both lanes' threads once, for
            # every kernel (a small product too), and nothing is switched per call
            calls.clear()
            out = ag.tensor(a) @ ag.tensor(b)
            np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-12, atol=1e-12)
            assert calls == [2]
            assert _blas.solo()
            out = (ag.tensor(small) @ ag.tensor(small.T)) @ ag.tensor(small)
            np.testing.assert_allclose(out.numpy(), small @ small.T @ small, rtol=1e-12, atol=1e-12)
            assert calls == [2]

            # a second task takes a stream: back to one thread per lane; a big product borrows the idle
            # sibling's core for that call only
            started, done = trio.Event(), trio.Event()

            async def other() -> None:
                current_stream(rt.cpu)
                started.set()
                await done.wait()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(other)
                await started.wait()
                assert not _blas.solo()
                # the loop set the per-lane count itself as the second stream was taken (kernels may now
                # run inline on it, where no lane's `sync` applies it)
                assert calls[-1:] == [1] and _blas._applied == 1
                calls.clear()
                out = ag.tensor(a) @ ag.tensor(b)
                np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-12, atol=1e-12)
                assert calls == [2, 1]

                # keep the other lane busy: with no idle sibling the product runs on this lane's one
                # BLAS thread, and nothing is switched
                own = current_stream(rt.cpu)._lane
                lane = next(ln for ln in rt.devices["cpu"]._lanes if ln is not own)
                busy, release = threading.Event(), threading.Event()
                lane._queue.put((None, 0, _Blocker(busy, release), False))
                assert busy.wait(TIMEOUT)
                calls.clear()
                try:
                    out = ag.tensor(a) @ ag.tensor(b)
                    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-12, atol=1e-12)
                finally:
                    release.set()
                assert calls == []
                done.set()
    # the runtime is gone: nothing in the process asks for more than the base any more
    assert not _blas.solo()


async def test_a_training_in_another_runtime_of_the_process_counts_as_beside_this_one() -> None:
    if not _blas.boost_available():
        pytest.skip("this BLAS is not a pthreads OpenBLAS: there is no thread count to switch")
    from asyncgrad.runtime._runtime import current_stream

    holding, release = threading.Event(), threading.Event()

    def other_runtime() -> None:
        async def main() -> None:
            async with ag.open_runtime(lanes=2) as rt2:
                current_stream(rt2.cpu)
                holding.set()
                await trio.to_thread.run_sync(release.wait, TIMEOUT)

        trio.run(main)

    async with ag.open_runtime(lanes=2) as rt:
        current_stream(rt.cpu)
        assert _blas.solo()  # one stream in the whole process
        thread = threading.Thread(target=other_runtime)
        thread.start()
        try:
            assert await trio.to_thread.run_sync(holding.wait, TIMEOUT)
            assert not _blas.solo()  # two trainings in the process share the cores, one BLAS thread each
        finally:
            release.set()
            await trio.to_thread.run_sync(thread.join, TIMEOUT)
        assert _blas.solo()  # the other runtime closed: this training is alone again


class _Blocker:
    """Stands in for a sibling's lent slices: keeps a lane busy until released."""

    def __init__(self, started: threading.Event, release: threading.Event) -> None:
        self.started, self.release = started, release

    def run_unclaimed(self) -> int:
        self.started.set()
        self.release.wait(TIMEOUT)
        return 0


async def _idle_lanes(rt: Any) -> list[Any]:
    lanes = rt.devices["cpu"]._lanes
    with trio.fail_after(TIMEOUT):
        while not all(lane._idle for lane in lanes):
            await trio.sleep(0.001)  # OS threads reaching their queue: not a trio task to wait on
    return lanes  # type: ignore[no-any-return]


async def test_an_idle_sibling_lane_runs_a_lent_part() -> None:
    async with ag.open_runtime(lanes=2) as rt:
        lanes = await _idle_lanes(rt)
        second_ran = threading.Event()
        ran_on: dict[str, str] = {}

        def first() -> None:
            # finishes only once another lane ran the second part: the owner never could, meanwhile
            assert second_ran.wait(TIMEOUT), "no sibling lane picked up the lent part"
            ran_on["first"] = threading.current_thread().name

        def second() -> None:
            ran_on["second"] = threading.current_thread().name
            second_ran.set()

        stream = rt.devices["cpu"].pool.acquire()
        stream.submit(lambda: run_parts([first, second]))
        await stream.synchronize()
        assert ran_on["first"] != ran_on["second"]
        assert sum(lane.parts_run for lane in lanes) == 1


async def test_a_failing_part_fails_its_kernel() -> None:
    async with ag.open_runtime(lanes=2) as rt:
        await _idle_lanes(rt)

        def boom() -> None:
            raise ValueError("part failed")

        stream = rt.devices["cpu"].pool.acquire()
        stream.submit(lambda: run_parts([lambda: None, boom]))
        with pytest.raises(ag.devices.KernelError, match="part failed"):
            await stream.synchronize()


def test_off_a_lane_parts_run_in_order() -> None:
    order: list[int] = []
    run_parts([lambda: order.append(0), lambda: order.append(1), lambda: order.append(2)])
    assert order == [0, 1, 2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are a Linux feature")
@pytest.mark.parametrize("lane_nice", [0, 10])
async def test_lanes_run_nicer_than_the_loop(lane_nice: int) -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    async with ag.open_runtime(lanes=2, blas_threads=1, lane_nice=lane_nice) as rt:
        await _idle_lanes(rt)
        nices = [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in rt.threads()]
    assert nices == [min(19, base + lane_nice)] * 2
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the loop keeps its own


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are a Linux feature")
async def test_lanes_with_threaded_blas_keep_the_loops_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    async with ag.open_runtime(lanes=1, blas_threads=2, lane_nice=10) as rt:
        await _idle_lanes(rt)
        assert [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in rt.threads()] == [base]


async def test_a_queued_gradient_someone_else_holds_is_copied_not_stolen() -> None:
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((256, 384)), rng.standard_normal((384, 256))
    async with ag.open_runtime() as rt:
        W = ag.tensor(w, requires_grad=True)
        held: list[ag.Tensor] = []
        W.register_hook(lambda g: held.append(g))
        X = ag.tensor(x)
        await (X @ W).sum().backward()
        await W.grad.ready()
        assert rt.statistics().grads_copied == 1
        first = held[0].numpy().copy()
        await (X @ W).sum().backward()  # accumulates into W.grad in place
        await W.grad.ready()
        np.testing.assert_array_equal(held[0].numpy(), first)
        np.testing.assert_allclose(W.grad.numpy(), 2 * first, rtol=1e-12)


async def test_one_queued_array_for_two_leaves_is_not_stolen_twice() -> None:
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((300, 300)), rng.standard_normal((300, 300))
    async with ag.open_runtime():
        A, B = ag.tensor(a, requires_grad=True), ag.tensor(b, requires_grad=True)
        s = A + B  # a queued kernel; add's rule hands one array back for both inputs
        await (s * ag.tensor(a)).sum().backward()
        ga, gb = A.grad.numpy(), B.grad.numpy()
        assert not np.shares_memory(ga, gb)
        np.testing.assert_allclose(ga, a, rtol=1e-12)
        np.testing.assert_allclose(gb, a, rtol=1e-12)


async def test_a_failing_first_part_still_waits_for_the_lent_ones() -> None:
    async with ag.open_runtime(lanes=2) as rt:
        await _idle_lanes(rt)
        started, finished = threading.Event(), threading.Event()

        def first() -> None:
            assert started.wait(TIMEOUT)
            raise ValueError("first part failed")

        def second() -> None:
            started.set()
            time.sleep(0.05)  # still writing when the first part fails
            finished.set()

        stream = rt.devices["cpu"].pool.acquire()
        stream.submit(lambda: run_parts([first, second]))
        with pytest.raises(ag.devices.KernelError, match="first part failed"):
            await stream.synchronize()
        assert finished.is_set()
