"""Stream waits: `synchronize(seq)` waits for the work up to `seq` only, not for what was queued after it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio

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
        np.testing.assert_array_equal(y.numpy(), np.arange(10_000.0) * 2)
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
