"""Structured concurrency and faults: cancellation reaches the remote task, timeouts, dead workers,
backpressure, and fuzzed frames that leave the worker serving."""

from __future__ import annotations

import os
import random
import signal
import struct

import msgpack
import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist
from asyncgrad.distributed import _connection, _peer, _wire

from . import _fns
from .conftest import TIMEOUT, children


async def test_cancelling_the_caller_cancels_the_remote_task(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            w = workers[0]
            with trio.move_on_after(0.5) as cs:
                await w.call(_fns.wait_to_be_cancelled, "call")
            assert cs.cancelled_caught
            # observed on the remote side: the task there saw trio.Cancelled
            assert await w.call(_fns.wait_seen, "call", "cancelled") == "cancelled"

            fut = w.call_nowait(_fns.wait_to_be_cancelled, "future")
            assert await w.call(_fns.wait_seen, "future", "started") == "started"
            fut.cancel()
            with pytest.raises(dist.CallCancelled):
                await fut
            assert await w.call(_fns.wait_seen, "future", "cancelled") == "cancelled"
            stats = await w.statistics()
            assert stats.calls_serving == 1  # only this statistics call is running there


async def test_timeouts_raise_timeout_error_and_cancel_the_remote_task(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            w = workers[0]
            with pytest.raises(TimeoutError, match=r"within 0\.3 s"):
                await w.call(_fns.wait_to_be_cancelled, "t1", timeout=0.3)
            assert await w.call(_fns.wait_seen, "t1", "cancelled") == "cancelled"
            with pytest.raises(TimeoutError):
                await w.call_nowait(_fns.wait_to_be_cancelled, "t2", timeout=0.3)
            assert await w.call(_fns.wait_seen, "t2", "cancelled") == "cancelled"
            assert await w.call(_fns.sleep, 0.01, "in time", timeout=5) == "in time"
            with pytest.raises(ValueError, match="positive"):
                await w.call(_fns.add, 1, timeout=-1)
        async with dist.open_workers(1, timeout=0.3) as workers:  # a default for every call
            with pytest.raises(TimeoutError):
                await workers[0].call(_fns.wait_to_be_cancelled, "t3")
            assert await workers[0].call(_fns.sleep, 1.0, "no limit", timeout=None) == "no limit"


async def test_a_killed_worker_fails_its_calls_within_2_s_and_the_others_carry_on(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as workers:
            doomed, other = workers
            pending = [doomed.call_nowait(_fns.sleep, 30) for _ in range(3)]
            pending.append(doomed.call_nowait(_fns.hold, 30, ag.randn(256, 256)))
            await doomed.call(_fns.add, 1, 1)  # the calls above are in flight
            elsewhere = other.call_nowait(_fns.sleep, 1.0, "fine")
            errors: list[BaseException] = []

            async def blocked_call() -> None:
                try:
                    await doomed.call(_fns.sleep, 30)
                except dist.WorkerDied as e:
                    errors.append(e)

            async with trio.open_nursery() as n:
                n.start_soon(blocked_call)
                await trio.sleep(0.1)
                start = trio.current_time()
                os.kill(doomed.pid, signal.SIGKILL)
                for fut in pending:
                    with pytest.raises(dist.WorkerDied) as ei:
                        await fut
                    assert ei.value.worker == "worker0" and ei.value.exitcode == -signal.SIGKILL
                    assert "worker0" in str(ei.value) and "signal 9" in str(ei.value)
            assert trio.current_time() - start < 2.0
            assert len(errors) == 1 and not isinstance(errors[0], BaseExceptionGroup)
            with pytest.raises(dist.WorkerDied):  # later calls fail at once
                await doomed.call(_fns.add, 1, 2)
            assert doomed.exitcode == -signal.SIGKILL and not doomed.alive
            assert await elsewhere == "fine"
            assert await other.call(_fns.add, 20, 22) == 42
    assert doomed.pid not in children() and other.pid not in children()


async def test_backpressure_bounds_the_bytes_in_flight(rt) -> None:
    limit = 1 << 20
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1, max_inflight_bytes=limit) as workers:
            w = workers[0]
            x = ag.zeros(64, 1024)  # 256 KiB: three fit under the limit, a fourth waits
            futs = [w.call_nowait(_fns.hold, 0.1, x) for _ in range(12)]
            seen = [await f for f in futs]
            assert max(seen) <= 3
            # this connection's own high-water mark: the process-wide one keeps earlier tests' peaks
            assert w.peer is not None and w.peer.budget.max_used <= limit
            assert dist.statistics().max_bytes_in_flight >= w.peer.budget.max_used > 0
            # a single call larger than the limit still goes (alone)
            big = ag.ones(512, 1024)  # 2 MiB
            np.testing.assert_array_equal((await w.call(_fns.double, big)).numpy(), 2 * np.ones((512, 1024)))


def _frame(msg: object, table: bytes = b"", payload: bytes = b"") -> bytes:
    meta = msgpack.packb(msg, use_bin_type=True)
    return struct.pack("<IIQ", len(meta), len(table), len(payload)) + meta + table + payload


def _fuzz_frames(rng: random.Random) -> list[bytes]:
    """500 frames: random bytes, truncated frames, oversized headers, wrong types and bad tables."""
    good = _wire.encode([_peer.CALL, 1, f"{_fns.__name__}:add", [1, 2], {}])
    good_bytes = b"".join(bytes(p) for p in good.frame()[0])
    arr_ext = msgpack.ExtType(_wire.EXT_TENSOR, msgpack.packb([0, False]))
    frames: list[bytes] = []
    for i in range(500):
        kind = i % 5
        if kind == 0:  # random bytes
            frames.append(rng.randbytes(rng.randint(1, 300)))
        elif kind == 1:  # a good frame cut short
            frames.append(good_bytes[: rng.randint(1, len(good_bytes) - 1)])
        elif kind == 2:  # oversized: the header alone says too much
            frames.append(
                struct.pack("<IIQ", rng.choice([1 << 30, 1 << 31, (1 << 32) - 1]), 0, 0)
                if i % 2
                else struct.pack("<IIQ", 10, 10, 1 << rng.randint(33, 62))
            )
        elif kind == 3:  # well-formed msgpack, wrong types
            msg = rng.choice(
                [
                    {"not": "a list"}, [], ["CALL", 1], [99, 1], [_peer.CALL, "one", "m:f", [], {}],
                    [_peer.CALL, 1, 42, [], {}], [_peer.CALL, 1, "m:f", "args", {}], [_peer.CALL, 1, "m:f", [], {1: 2}],
                    [_peer.RESULT], [_peer.CANCEL, "x"], [_peer.DELETE], [_peer.RCALL, 1, 2], 12345, None,
                    [_peer.JOIN, {}], [_peer.HELLO, {}],
                ]
            )
            frames.append(_frame(msg))
        else:  # bad buffer tables: unknown dtypes, wrong sizes, strides out of bounds, object arrays
            entry = rng.choice(
                [
                    ["O", [2], [8], 16], ["<f8", [2, 2], [8, 8], 32], ["<f8", [4], [800], 32], ["<f8", [4], [8], 31],
                    ["V8", [1], [8], 8], ["nonsense", [1], [1], 1], ["<f8", [-1], [8], 8], ["<f8", [2], [-8], 16],
                    "not a list", [1, 2, 3, 4],
                    ["<f8", [4], [8], 32, 4096], ["<f8", [4], [8], 32, 8],  # a shared segment that never came
                ]
            )
            table = msgpack.packb([entry], use_bin_type=True)
            n = entry[3] if isinstance(entry, list) and isinstance(entry[3], int) and 0 <= entry[3] < 100 else 8
            n = 0 if isinstance(entry, list) and len(entry) == 5 else n
            frames.append(_frame([_peer.CALL, 1, f"{_fns.__name__}:identity", [arr_ext], {}], table, bytes(n)))
    return frames


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_500_fuzzed_frames_leave_the_worker_serving(rt, transport) -> None:
    rng = random.Random(20261201)
    frames = _fuzz_frames(rng)
    assert len(frames) == 500
    with trio.fail_after(TIMEOUT * 3):
        async with dist.open_workers(1, transport=transport) as workers:
            w = workers[0]
            before = (await w.statistics()).frames_rejected

            async def send_one(i: int, data: bytes) -> None:
                sock = await _connection.connect(w.address)
                conn = _connection.Connection(sock, "fuzz", max_meta_bytes=1 << 20, max_frame_bytes=1 << 20)
                try:
                    if i % 25 == 0:  # now and then before the handshake: refused
                        await conn.send_all(data)
                    else:
                        await _connection.client_handshake(conn, workers._secret)
                        if i % 7:
                            _peer.send_message(conn, [_peer.PEER, {"name": f"fuzz{i}"}])
                        await conn.send_all(data)
                    with trio.move_on_after(0.25):  # the worker closes on a bad frame; a cut one waits for us
                        while True:
                            await conn.recv_exact(1)
                except _connection.ConnectionClosed:
                    pass
                except dist.AuthenticationError:
                    pass
                finally:
                    conn.close()

            limiter = trio.CapacityLimiter(48)

            async def limited(i: int, data: bytes) -> None:
                async with limiter:
                    await send_one(i, data)

            async with trio.open_nursery() as n:
                for i, data in enumerate(frames):
                    n.start_soon(limited, i, data)
                    if i % 50 == 0:  # the parent's calls go on meanwhile
                        assert await w.call(_fns.add, i, 1) == i + 1
            stats = await w.statistics()
            assert stats.frames_rejected - before >= 250
            assert stats.connections_refused >= 10
            assert await w.call(_fns.add, 2, 3) == 5
            x = ag.randn(100, 100)
            np.testing.assert_array_equal((await w.call(_fns.double, x)).numpy(), x.numpy() * 2)
