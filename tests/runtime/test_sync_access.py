"""Sync accessors on the event loop thread: the warning when they block it, and the async form.

The warning fires only when the accessor really waited (for more than `BLOCKED_WARN_S`) and only on a
trio loop's thread; the async form ``(await t.ready()).item()`` gives the same value and lets a heartbeat
beside it keep ticking.
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.runtime import BLOCKED_WARN_S

# timing bounds: run alone, not beside another xdist worker (README's serial phase)
pytestmark = pytest.mark.serial


def slow_value(n: int = 600, reps: int = 8) -> tuple[ag.Tensor, Expected]:
    """A one-element tensor behind ``reps`` queued matmuls (tens of ms of kernels), and a way to get its
    value with numpy (called after the read: computing it first would give the lanes time to finish)."""
    r = np.random.default_rng(0)
    a_np = (r.standard_normal((n, n)) / np.sqrt(n)).astype(np.float64)
    a = ag.from_numpy(a_np)
    b = a
    for _ in range(reps):
        b = b @ a
    return b.sum(), Expected(a_np, reps)


class Expected:
    def __init__(self, a: np.ndarray, reps: int) -> None:
        self.a, self.reps = a, reps

    def __call__(self) -> float:
        b = self.a
        for _ in range(self.reps):
            b = b @ self.a
        return float(b.sum())


def sync_warnings(record: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, ag.SyncAccessWarning)]


async def test_blocking_item_warns_naming_the_async_form(rt) -> None:
    with trio.fail_after(60):
        s, expect = slow_value()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            v = s.item()  # blocks the loop: the kernels are still queued
            blocked = time.perf_counter() - t0
        assert v == pytest.approx(expect(), rel=1e-9)
        assert blocked > BLOCKED_WARN_S
        ws = sync_warnings(rec)
        assert len(ws) == 1, [str(w.message) for w in rec]
        msg = str(ws[0].message)
        assert "item()" in msg and "(await t.ready()).item()" in msg and "blocked the trio event loop" in msg
        assert ws[0].filename == __file__  # the user's line, not asyncgrad's


async def test_each_sync_accessor_warns_once_per_call_site(rt) -> None:
    with trio.fail_after(60):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for _ in range(3):  # one call site, three blocking calls: one warning
                s, expect = slow_value()
                assert float(s) == pytest.approx(expect(), rel=1e-9)
            s, _ = slow_value()
            assert bool(s) is True
            s, expect = slow_value()
            assert np.asarray(s) == pytest.approx(expect(), rel=1e-9)
            s, expect = slow_value()
            assert s.reshape(1).tolist() == pytest.approx([expect()], rel=1e-9)
        msgs = [str(w.message) for w in sync_warnings(rec)]
        assert len(msgs) == 4, msgs
        for form in ("float(await t.ready())", "bool(await t.ready())", "np.asarray(t)", ".tolist()"):
            assert sum(form in m for m in msgs) == 1, (form, msgs)


async def test_no_warning_when_the_value_was_ready(rt) -> None:
    with trio.fail_after(60):
        s, expect = slow_value()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            v = (await s.ready()).item()  # the async form: the accessor then returns at once
            assert float(s) == v and s.numpy() == v and s.tolist() == v
        assert v == pytest.approx(expect(), rel=1e-9)
        assert sync_warnings(rec) == []


def test_no_warning_outside_a_trio_loop() -> None:
    """A worker thread (no trio run) may wait as long as it likes: that is what a sync read is for."""
    out: dict[str, object] = {}

    async def main() -> None:
        with trio.fail_after(60):
            s, expect = slow_value()

            def read() -> None:
                with warnings.catch_warnings(record=True) as rec:
                    warnings.simplefilter("always")
                    out["v"] = s.item()
                out["warnings"] = sync_warnings(rec)
                out["expect"] = expect()

            th = threading.Thread(target=read)
            th.start()
            await trio.to_thread.run_sync(th.join)

    ag.run(main)
    assert out["v"] == pytest.approx(out["expect"], rel=1e-9)
    assert out["warnings"] == []


async def test_async_form_keeps_the_loop_responsive(rt) -> None:
    """While the loss is read through the async form, a 1 ms heartbeat beside it keeps ticking."""
    with trio.fail_after(60):
        late: list[float] = []
        done = trio.Event()

        async def heartbeat() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await trio.sleep(0.001)
                late.append(time.perf_counter() - t)

        async with trio.open_nursery() as n:
            n.start_soon(heartbeat)
            await trio.sleep(0.01)
            s, expect = slow_value(reps=10)
            t0 = time.perf_counter()
            v = (await s.ready()).item()
            waited = time.perf_counter() - t0
            done.set()
        assert v == pytest.approx(expect(), rel=1e-9)
        # the heartbeat ran during the wait: ticks while the kernels ran, not one long stall
        assert waited > 0.02
        assert len(late) >= 5
