"""Stream waits: `synchronize(seq)` waits for the work up to `seq` only, not for what was queued after it."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import asyncgrad as ag

TIMEOUT = 20


async def test_synchronize_to_a_seq_does_not_wait_for_later_work() -> None:
    async with ag.open_runtime(lanes=1) as rt:
        stream = rt.devices["cpu"].pool.acquire()
        gate = threading.Event()
        ran: list[str] = []
        first = stream.submit(lambda: ran.append("first"))
        stream.submit(lambda: gate.wait(TIMEOUT))
        with trio.fail_after(TIMEOUT):
            await stream.synchronize(first)
        assert ran == ["first"]
        assert not stream.query()  # the gated job is still running
        gate.set()
        with trio.fail_after(TIMEOUT):
            await stream.synchronize()
        assert stream.query()


async def test_a_cancelled_wait_leaves_no_waiter_behind() -> None:
    async with ag.open_runtime(lanes=1) as rt:
        stream = rt.devices["cpu"].pool.acquire()
        gate = threading.Event()
        seq = stream.submit(lambda: gate.wait(TIMEOUT))
        with trio.move_on_after(0.01):
            await stream.synchronize(seq)
        assert stream._waiters == []
        gate.set()
        with trio.fail_after(TIMEOUT):
            await stream.synchronize()


async def test_ready_returns_before_work_queued_after_the_tensor() -> None:
    async with ag.open_runtime(lanes=1) as rt:
        x = ag.tensor(np.arange(10_000.0))
        y = x * 2.0  # queued: more than the inline limit
        stream = y._stream
        gate = threading.Event()
        stream.submit(lambda: gate.wait(TIMEOUT))
        with trio.fail_after(TIMEOUT):
            await y.ready()
        # the value without waiting: `y.numpy()` would wait for the gate too (all the task queued so far)
        got = y.value_if_ready()
        assert got is not None and not gate.is_set()
        np.testing.assert_array_equal(got, np.arange(10_000.0) * 2)
        gate.set()
        await rt.synchronize()


async def test_a_failed_kernel_before_the_seq_is_raised_by_the_wait() -> None:
    async with ag.open_runtime(lanes=1) as rt:
        stream = rt.devices["cpu"].pool.acquire()

        def boom() -> None:
            raise ValueError("kernel failed")

        seq = stream.submit(boom)
        with trio.fail_after(TIMEOUT), pytest.raises(ag.devices.KernelError, match="kernel failed"):
            await stream.synchronize(seq)


async def test_an_op_on_a_dropped_value_reports_the_kernel_error() -> None:
    from asyncgrad.runtime._runtime import current_stream

    async with ag.open_runtime(lanes=1) as rt:
        x = ag.tensor(np.ones(10_000))
        stream = current_stream(rt.devices["cpu"])

        def boom() -> None:
            raise ValueError("kernel failed")

        stream.submit(boom)
        y = x * 2.0  # queued after the failed kernel: skipped, so y never gets a value
        with trio.fail_after(TIMEOUT):
            while not stream.query():
                await trio.sleep(0.001)  # the lane thread reaching the skipped kernel
        z = y * 3.0  # y's stream is done, but y has no array: this must not run inline on None
        with trio.fail_after(TIMEOUT), pytest.raises(ag.devices.KernelError, match="kernel failed"):
            await z.ready()
        with pytest.raises(RuntimeError, match="has no value"):
            y.numpy()


async def test_an_idle_lane_holds_no_finished_job() -> None:
    import functools
    import gc
    import weakref

    async with ag.open_runtime(lanes=1) as rt:
        stream = rt.devices["cpu"].pool.acquire()
        big = np.ones(100_000)
        ref = weakref.ref(big)
        stream.submit(functools.partial(np.sum, big))  # the job, not this frame, holds the array
        await stream.synchronize()
        del big
        gc.collect()
        assert ref() is None  # the finished job (and the array in its closure) is gone


@pytest.mark.parametrize("shared_lane", [False, True])
async def test_a_backward_lets_its_caller_run_ahead_of_the_stream(shared_lane: bool) -> None:
    """Alone on its lane a training may record `RUN_AHEAD` passes per wake-up; sharing it, none."""
    from asyncgrad.autograd import _engine
    from asyncgrad.runtime._runtime import current_stream

    async with ag.open_runtime(lanes=1) as rt:
        if shared_lane:
            rt.devices["cpu"].pool.acquire()  # another stream on the one lane (another training's)
        gate = threading.Event()
        w = ag.tensor(np.full(10_000, 2.0), requires_grad=True)
        x = ag.tensor(np.arange(10_000.0))
        grads: list[Any] = []
        streams: list[Any] = []

        async def training() -> None:
            stream = current_stream(rt.cpu)  # this task's stream
            streams.append(stream)
            stream.submit(lambda: gate.wait(TIMEOUT))  # its lane is stuck until the gate opens
            for _ in range(3):
                await (x * w).sum().backward()  # queued behind the gate: more than the inline limit
                grads.append(w.grad.numpy)
                w.grad = None

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(training)
                try:
                    await trio.testing.wait_all_tasks_blocked()
                    # alone, the first RUN_AHEAD passes wait for nothing (not even their own forwards), and
                    # the next one for what was queued before the pass before it (the gate and that step's
                    # forward); shared, pass 1 waits for its forward
                    assert len(grads) == (0 if shared_lane else min(3, _engine.RUN_AHEAD))
                    assert streams[0].completed == 0
                finally:
                    gate.set()
            assert len(grads) == 3
            for g in grads:
                np.testing.assert_array_equal(g(), np.arange(10_000.0))


async def test_use_stream_makes_a_stream_current_for_a_block() -> None:
    async with ag.open_runtime(lanes=2) as rt:
        dev = rt.devices["cpu"]
        mine = ag.current_stream()
        assert ag.current_stream("cpu") is mine and ag.current_stream(dev) is mine
        other = dev.pool.acquire()
        # above the bound for running inline while two streams are taken (`SHARED_INLINE_MAX_ELEMENTS`)
        x = ag.tensor(np.arange(100_000.0))
        with ag.use_stream(other) as s:
            assert s is other and ag.current_stream() is other
            y = x * 2.0  # queued on `other`
        assert ag.current_stream() is mine
        assert y._stream is other
        np.testing.assert_array_equal((await y.ready()).numpy(), np.arange(100_000.0) * 2)
        dev.pool.release(other)
        assert dev.device_statistics().streams_in_use == 1  # only this task's own stream


async def test_a_released_stream_counts_as_draining_until_its_work_is_done() -> None:
    async with ag.open_runtime(lanes=1) as rt:
        dev = rt.devices["cpu"]
        s = dev.pool.acquire()
        gate = threading.Event()
        s.submit(lambda: gate.wait(TIMEOUT))
        dev.pool.release(s)
        st = dev.device_statistics()
        assert st.streams_draining == 1 and st.streams_free == 0
        assert dev.pool.acquire() is not s  # busy: not handed out again
        gate.set()
        with trio.fail_after(TIMEOUT):
            await s.synchronize()
        assert dev.device_statistics().streams_draining == 0
