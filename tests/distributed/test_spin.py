"""The poll before the loop sleeps (`_spin.Spinner`): when it spins, for how long, and when it does not."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import trio

import asyncgrad as ag
from asyncgrad.distributed import _connection, _spin

from ._fns import identity

# timing bounds: run alone, not beside another xdist worker (README's serial phase)
pytestmark = pytest.mark.serial


def _traffic() -> None:
    _connection.ACTIVITY[0] += 1


def test_spins_only_after_traffic_and_stops_at_a_frame() -> None:
    a, b = socket.socketpair()
    try:
        s = _spin.Spinner()
        s.watch(b.fileno(), None)
        s.before_io_wait(1.0)  # the first chance after (any) traffic so far: nothing arrives, a miss
        assert (s.spins, s.hits) == (1, 0)
        s.before_io_wait(1.0)  # no traffic since: the loop sleeps at once
        assert s.spins == 1
        _traffic()
        s.before_io_wait(0.0)  # the loop does not sleep: nothing to do
        assert s.spins == 1
        a.send(b"x")
        t = time.perf_counter()
        s.before_io_wait(1.0)
        assert time.perf_counter() - t < 0.05  # found the byte at once (well before the 1 s deadline)
        assert (s.spins, s.hits) == (2, 1)
        b.recv(1)
        _traffic()
        t = time.perf_counter()
        s.before_io_wait(1e-5)  # never past the loop's next deadline
        assert (s.spins, s.hits) == (3, 1)
        assert time.perf_counter() - t < 0.05
        s.unwatch(b.fileno(), None)
        _traffic()
        s.before_io_wait(1.0)  # nothing watched
        assert s.spins == 3
    finally:
        a.close()
        b.close()


def test_slow_peers_are_probed_now_and_then() -> None:
    a, b = socket.socketpair()
    try:
        s = _spin.Spinner()
        s.watch(b.fileno(), None)
        for _ in range(200):
            _traffic()
            s.before_io_wait(1.0)
        assert s.hits == 0
        # the rate falls below MIN_HIT_RATE after a dozen misses; then one chance in PROBE_EVERY
        assert 13 <= s.spins <= 14 + 200 // _spin.PROBE_EVERY
        for _ in range(40):  # a peer that answers fast again: back to spinning every time
            a.send(b"x")
            _traffic()
            s.before_io_wait(1.0)
            b.recv(1)
        hits = s.hits
        for _ in range(10):
            a.send(b"x")
            _traffic()
            s.before_io_wait(1.0)
            b.recv(1)
        assert s.hits == hits + 10
    finally:
        a.close()
        b.close()


def test_no_spin_while_kernels_are_queued() -> None:
    async def main() -> None:
        async with ag.open_runtime() as rt:
            a, b = socket.socketpair()
            try:
                s = _spin.Spinner()
                s.watch(b.fileno(), rt.cpu)
                stream = rt.cpu.pool.acquire()
                gate = threading.Event()
                stream.submit(gate.wait)  # a kernel that runs until we let it go
                _traffic()
                s.before_io_wait(1.0)
                assert s.spins == 0
                gate.set()
                await stream.synchronize()
                _traffic()
                s.before_io_wait(1.0)
                assert s.spins == 1
                rt.cpu.pool.release(stream)
            finally:
                a.close()
                b.close()

    trio.run(main)


def test_calls_spin() -> None:
    async def main() -> None:
        with trio.fail_after(60):
            async with ag.open_runtime():
                async with ag.distributed.open_workers(1) as workers:
                    x = ag.tensor([1.0, 2.0])
                    for _ in range(50):
                        y = await workers[0].call(identity, x)
                    assert y.numpy().tolist() == [1.0, 2.0]
                    s = _spin._SPINNER.get()
                    assert s is not None and s.spins > 0  # (how many found the reply depends on the load)
                with trio.fail_after(10):
                    while _spin._SPINNER.get() is not None:  # the last connection gone: the spinner too
                        await trio.sleep(0.01)

    trio.run(main)


def test_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_spin, "SPIN_S", 0.0)  # ASYNCGRAD_RPC_SPIN_US=0 at import

    async def main() -> None:
        s = _spin.spinner()
        a, b = socket.socketpair()
        try:
            s.watch(b.fileno(), None)
            a.send(b"x")
            _traffic()
            await trio.sleep(0.001)  # the loop sleeps: no instrument, no spin
            assert s.spins == 0
            s.unwatch(b.fileno(), None)
        finally:
            a.close()
            b.close()

    trio.run(main)
