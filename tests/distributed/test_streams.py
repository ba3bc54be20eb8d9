"""The TensorPipe stream discipline on CPU streams: one test per guarantee.

A send's copy-out runs on a pool stream that waits on an event recorded where the tensors are produced;
the callee runs on a pool stream of its own without synchronising and responds from it; streams go back
to the pool only when their work is done; a future's wait makes the caller's stream wait on its event.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist

from . import _fns
from .conftest import TIMEOUT


def _values(t: ag.Tensor) -> np.ndarray:
    """A copy of the value only (``numpy()`` would also wait for the caller's queued kernels)."""
    return np.array(t.tolist(), dtype=t.dtype)


async def test_a_send_waits_only_for_the_event_not_for_work_queued_after_it() -> None:
    async with ag.open_runtime(lanes=2):
        with trio.fail_after(TIMEOUT):
            async with dist.open_workers(1) as workers:
                w = workers[0]
                mine = ag.current_stream()
                x = ag.full((256, 256), 3.0) * 2.0  # queued on the caller's stream
                fut = w.call_nowait(_fns.identity, x)  # the event is recorded here
                gate = threading.Event()
                mine.submit(lambda: gate.wait(TIMEOUT))  # later work blocks the caller's stream
                try:
                    y = await fut
                    assert not mine.query()  # the caller's stream is still held by the gate
                    np.testing.assert_array_equal(_values(y), np.full((256, 256), 6.0, np.float32))
                    z = await w.call(_fns.double, x)  # the same for a call awaited at once
                    np.testing.assert_array_equal(_values(z), np.full((256, 256), 12.0, np.float32))
                    assert not mine.query()
                finally:
                    gate.set()


async def test_a_send_sees_the_final_value_of_a_tensor_still_queued_at_call_time() -> None:
    async with ag.open_runtime(lanes=2):
        with trio.fail_after(TIMEOUT):
            async with dist.open_workers(1) as workers:
                w = workers[0]
                mine = ag.current_stream()
                gate = threading.Event()
                mine.submit(lambda: gate.wait(TIMEOUT))  # nothing below runs until the gate opens
                a = ag.ones(256, 256)
                x = a * 5.0
                with ag.no_grad():
                    x.add_(1.0)  # queued before the call too: part of the value sent
                fut = w.call_nowait(_fns.identity, x)
                await trio.sleep(0.2)
                assert not fut.done()  # the copy-out waits for x's kernels
                gate.set()
                y = await fut
                np.testing.assert_array_equal(_values(y), np.full((256, 256), 6.0, np.float32))


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_later_ops_on_the_callers_stream_are_not_blocked_by_a_slow_transfer(transport) -> None:
    async with ag.open_runtime(lanes=2):
        with trio.fail_after(TIMEOUT):
            async with dist.open_workers(1, transport=transport) as workers:
                w = workers[0]
                w.call_nowait(_fns.sleep_sync, 3.0)  # the worker's loop stops reading for 3 s
                await trio.sleep(0.1)
                big = ag.ones(4096, 4096)  # 64 MiB: over TCP more than the socket buffers take
                fut = w.call_nowait(_fns.shape_of, big)
                await trio.sleep(0.3)  # copied out by now; the socket is full (or the frame waits)
                start = trio.current_time()
                for _ in range(5):
                    z = ag.ones(512, 512) @ ag.ones(512, 512)  # on the caller's stream
                    await z.ready()
                elapsed = trio.current_time() - start
                assert not fut.done()  # the transfer is still going on
                assert elapsed < 2.0  # (the worker reads again 3 s after the sleep began, ~0.4 s before start)
                np.testing.assert_array_equal(_values(z), np.full((512, 512), 512.0, np.float32))
                assert await fut == [4096, 4096]


async def test_the_callee_runs_on_pool_streams_without_a_sync() -> None:
    async with ag.open_runtime(lanes=2):
        with trio.fail_after(TIMEOUT):
            async with dist.open_workers(1, lanes=2) as workers:
                w = workers[0]
                # above the bound for running inline while several streams are taken (two calls at once)
                x = ag.arange(131072.0).reshape(512, 256)
                f1 = w.call_nowait(_fns.on_the_call_stream, x)
                f2 = w.call_nowait(_fns.on_the_call_stream, x)
                (y1, r1), (y2, r2) = await f1, await f2
                # the function returned with its kernels still queued (no synchronisation) ...
                assert r1["pending"] >= 2 and r2["pending"] >= 2
                # ... each call on a pool stream of its own, taken by the RPC layer ...
                assert r1["stream"] != r2["stream"] and r1["rpc_in_use"] >= 1 and r1["in_use"] >= 1
                # ... and the response, staged from that same stream, follows those kernels
                np.testing.assert_array_equal(_values(y1), np.arange(131072.0).reshape(512, 256) * 2)
                np.testing.assert_array_equal(_values(y2), _values(y1))


async def test_a_stream_returns_to_the_pool_only_when_its_work_is_done() -> None:
    async with ag.open_runtime(lanes=2):
        with trio.fail_after(TIMEOUT):
            async with dist.open_workers(1, lanes=2) as workers:
                w = workers[0]
                busy = await w.call(_fns.leave_slow_work, 1.0)  # returns; its stream is still busy
                report = await w.call(_fns.stream_report)
                assert report["stream"] != busy  # not handed out while its work runs
                assert report["draining"] == 1
                stats = await w.statistics()
                assert stats.pool is not None and stats.pool.streams_draining == 1
                await trio.sleep(1.3)
                names = set()
                for _ in range(4):
                    report = await w.call(_fns.stream_report)
                    names.add(report["stream"])
                    assert report["draining"] == 0
                assert busy in names  # back in the pool once done, and handed out again


async def test_awaiting_a_future_makes_the_current_stream_wait_without_synchronising() -> None:
    async with ag.open_runtime(lanes=2):
        with trio.fail_after(TIMEOUT):
            async with dist.open_workers(1) as workers:
                w = workers[0]
                mine = ag.current_stream()
                gate = threading.Event()
                seen: dict[str, str] = {}

                def triple(f: dist.Future) -> ag.Tensor:
                    s = ag.current_stream()
                    seen["stream"] = s.name
                    s.submit(lambda: gate.wait(TIMEOUT))  # the callback's kernels are still running ...
                    return f.value() * 3.0

                fut = w.call_nowait(_fns.identity, ag.ones(256, 256)).then(triple)
                y = await fut  # ... when it returns: done() before the values are ready
                try:
                    assert fut.done() and seen["stream"] != mine.name  # the callback ran on a pool stream
                    assert mine.statistics().pending >= 1  # the caller's stream waits on the future's event
                    z = y + 1.0  # queued after that wait
                    await trio.sleep(0.1)
                    assert not mine.query()
                finally:
                    gate.set()
                assert (await fut.wait(sync=True)) is y  # now the values are there
                np.testing.assert_array_equal(_values(z), np.full((256, 256), 4.0, np.float32))
                # an error in a callback reaches its future
                bad = w.call_nowait(_fns.add, 1, 2).then(lambda f: f.value() / 0)
                with pytest.raises(ZeroDivisionError):
                    await bad
                # async callbacks too
                async def plus(f: dist.Future) -> int:
                    await trio.sleep(0.01)
                    return f.value() + 1

                assert await w.call_nowait(_fns.add, 1, 2).then(plus) == 4


async def test_stream_statistics_are_visible() -> None:
    async with ag.open_runtime(lanes=2):
        with trio.fail_after(TIMEOUT):
            async with dist.open_workers(1) as workers:
                await workers[0].call(_fns.double, ag.ones(300, 300))
                local = dist.statistics()
                assert isinstance(local, dist.RPCStatistics) and local.pool is not None
                assert local.rpc_streams_taken >= 1 and local.rpc_streams_in_use == 0
                assert local.calls_sent >= 1 and local.bytes_sent > 300 * 300 * 4
                remote = await workers[0].statistics()
                assert remote.name == "worker0" and remote.calls_served >= 1
                assert remote.pool is not None and remote.pool.streams_created >= 1
                assert remote.bytes_received > 300 * 300 * 4
