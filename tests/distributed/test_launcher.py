"""The RPC layer's seam for whoever starts worker processes: `Launcher`, `Workers.start`, `Worker.call_streaming`.

The population's backends (local processes, Ray actors) both go through it; here a launcher of our own
(real local processes, recorded) shows the contract.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import trio

from asyncgrad import distributed as dist
from asyncgrad.distributed._workers import LocalLauncher, WorkerProcess, _Process

from . import _fns
from .conftest import TIMEOUT, children


class Recording:
    """A launcher that starts local workers and remembers what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []
        self.processes: list[WorkerProcess] = []

    def launch(self, name: str, address: str, secret: bytes) -> WorkerProcess:
        self.asked.append((name, address))
        p = LocalLauncher().launch(name, address, secret)
        self.processes.append(p)
        return p


class ExitsAtOnce:
    """A launcher whose 'worker' ends before it joins (exit status 3)."""

    def launch(self, name: str, address: str, secret: bytes) -> WorkerProcess:
        return _Process([sys.executable, "-c", "import sys; sys.exit(3)"], {}, secret)


async def test_a_launcher_starts_the_workers_and_their_replacements(rt) -> None:
    before = children()
    rec = Recording()
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1, launcher=rec) as workers:
            assert await workers[0].call(_fns.add, 1, 2) == 3
            new = await workers.start(1)  # more workers, by the same launcher
            assert [w.name for w in new] == ["worker1"] and workers.names == ["worker0", "worker1"]
            assert await new[0].call(_fns.add, 40, 2) == 42
            assert [n for n, _ in rec.asked] == ["worker0", "worker1"]
            assert {a for _, a in rec.asked} == {workers.address}
            assert [w.pid for w in workers] == [p.pid for p in rec.processes]
            with pytest.raises(dist.WorkerDied, match=r"worker2.*exit code 3.*before it was ready"):
                await workers.start(1, launcher=ExitsAtOnce())
            (again,) = await workers.start(1)  # a failed start fails no later one
            assert await again.call(_fns.add, 2, 2) == 4
        assert all(p.ended and p.returncode == 0 for p in rec.processes)  # shut down, not killed
    assert children() <= before


async def test_call_streaming_hands_each_message_over_as_it_comes(rt) -> None:
    got: list[tuple[float, dict]] = []
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            result = await workers[0].call_streaming(
                _fns.stream_steps, 5, on_notify=lambda m: got.append((trio.current_time(), m))
            )
            done_at = trio.current_time()
            with pytest.raises(TimeoutError, match="my streaming call"):
                await workers[0].call_streaming(_fns.stream_steps, 1000, on_notify=got.append, timeout=0.05,
                                                what="my streaming call")
    assert result == "finished"
    assert [m["step"] for _, m in got[:5]] == [0, 1, 2, 3, 4]  # in order, as they happened
    assert got[0][0] < done_at - 0.02  # the first arrived while the call was still running
    np.testing.assert_array_equal(got[4][1]["value"].numpy(), [4.0, 4.0])
