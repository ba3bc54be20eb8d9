"""A lone training takes every lane's BLAS threads only while other processes leave the cores free: a
multi-threaded BLAS call waits for its slowest thread, so beside busy processes it runs on one."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.devices import _blas

# timing bounds: run alone, not beside another xdist worker (README's serial phase)
pytestmark = pytest.mark.serial

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the load is read from /proc/stat")
BUSY = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"


async def _lanes_started(rt: Any) -> None:
    """Wait until every lane of ``rt`` has set its base BLAS count and waits for work (lanes start in their
    own threads; a small kernel may have run inline on the loop before any of them got that far, and the
    base recorded by an earlier runtime's lanes says nothing about this one's)."""
    with trio.fail_after(10):
        while _blas._base is None or not all(lane._idle for lane in rt.cpu._lanes):
            await trio.sleep(0.01)


async def _sample_for(seconds: float) -> None:
    """Sample the machine's load on the loop thread, as a lane does between kernels."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        _blas._next_sample = 0.0
        _blas.sample()
        await trio.sleep(_blas.SAMPLE_S)


@linux
async def test_busy_processes_leave_a_lone_training_one_blas_thread_and_it_gets_them_back() -> None:
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("needs 2+ cores")
    from asyncgrad.runtime._runtime import current_stream

    procs: list[subprocess.Popen[bytes]] = []
    try:
        with trio.fail_after(30):
            async with ag.open_runtime(lanes=cores) as rt:
                await (ag.ones(8, 8) @ ag.ones(8, 8)).ready()
                await _lanes_started(rt)
                if not _blas.boost_available():
                    pytest.skip("not a pthreads OpenBLAS: no thread count to switch")
                procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(cores)]
                current_stream(rt.cpu)  # one stream in the process: a lone training
                await _sample_for(1.0)
                # every core busy elsewhere (this process idles): no spare core for a second thread
                assert _blas.spare_cores() == 1
                assert not _blas.solo()
                assert _blas._target == _blas._base
                a = np.random.default_rng(0).standard_normal((300, 400))
                out = ag.tensor(a) @ ag.tensor(a.T)
                np.testing.assert_allclose((await out.ready()).numpy(), a @ a.T, rtol=1e-10)
                assert _blas._applied == _blas._base  # the lane ran it on its one thread

                for p in procs:
                    p.kill()
                    p.wait()
                procs.clear()
                # the estimate follows the load: once the cores are free again (on a machine shared with
                # other work only as far as that work leaves them), the lone training has them back
                deadline = time.monotonic() + 10
                while _blas.spare_cores() < cores and time.monotonic() < deadline:
                    await _sample_for(0.5)
                if _blas.spare_cores() < cores:
                    pytest.skip("other processes keep this machine's cores busy: cannot see them free")
                assert _blas.solo()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_pinned_estimate_is_not_resampled() -> None:
    _blas.pin_spare_cores(1)
    try:
        _blas._next_sample = 0.0
        _blas.sample()
        assert _blas.spare_cores() == 1
    finally:
        _blas.pin_spare_cores(None)
    assert _blas.spare_cores() == (os.cpu_count() or 1)


def _hash_until(stop: threading.Event) -> None:
    """Busy without the GIL (hashlib lets go of it for large buffers): CPU that is not the runtime's."""
    buf = b"x" * (8 << 20)
    while not stop.is_set():
        hashlib.sha256(buf).digest()


@linux
async def test_a_busy_thread_that_is_not_the_runtimes_counts_as_load() -> None:
    """A thread of this process that is not a lane, a loop or the BLAS pool (a torch training in a
    thread) is load beside the runtime, as another process is: its CPU is not taken for the runtime's."""
    stop = threading.Event()
    worker = threading.Thread(target=_hash_until, args=(stop,), daemon=True)
    _blas.pin_spare_cores(os.cpu_count() or 1)  # the lanes do not sample meanwhile: this test reads alone
    try:
        with trio.fail_after(30):
            async with ag.open_runtime(lanes=2):
                await (ag.ones(8, 8) @ ag.ones(8, 8)).ready()  # the lanes have started
                _blas._foreign_cpu_s()  # start counting from here
                a = np.random.default_rng(0).standard_normal((400, 400))
                out = ag.tensor(a)
                for _ in range(20):  # the lanes' and the loop's own work is not foreign
                    out = out @ ag.tensor(a) * 1e-2
                await out.ready()
                assert _blas._foreign_cpu_s() < 0.02
                worker.start()
                assert worker.native_id is not None
                _blas._foreign_cpu_s()  # the worker is seen from now on
                before = _thread_cpu_s(worker.native_id)
                await trio.sleep(0.5)
                used = _blas._foreign_cpu_s()
                mine = _thread_cpu_s(worker.native_id) - before
                assert used > 0
                assert used == pytest.approx(mine, abs=0.02)
    finally:
        _blas.pin_spare_cores(None)
        stop.set()
        if worker.is_alive():
            worker.join(10)


def _thread_cpu_s(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
        return int(f.read().split()[0]) * 1e-9


@linux
async def test_a_busy_thread_beside_a_lone_training_leaves_it_one_blas_thread() -> None:
    cores = os.cpu_count() or 1
    if cores != 2:
        pytest.skip("the estimate drops below every core only where one busy thread is a whole core's share")
    from asyncgrad.runtime._runtime import current_stream

    stop = threading.Event()
    worker = threading.Thread(target=_hash_until, args=(stop,), daemon=True)
    try:
        with trio.fail_after(30):
            async with ag.open_runtime(lanes=cores) as rt:
                await (ag.ones(8, 8) @ ag.ones(8, 8)).ready()
                if not _blas.boost_available():
                    pytest.skip("not a pthreads OpenBLAS: no thread count to switch")
                current_stream(rt.cpu)
                worker.start()
                await _sample_for(1.0)
                # one core busy with a thread that is not the runtime's: a two-thread call would stall
                assert _blas.spare_cores() == 1
                assert not _blas.solo()
    finally:
        stop.set()
        if worker.is_alive():
            worker.join(10)


@linux
async def test_work_between_two_runtimes_is_not_load_the_next_one_meets() -> None:
    """The sampling window closes with the last device: this process's work while no runtime ran (a torch
    step between two runtimes, on threads that are not the runtime's and outlive it) is not counted as load
    beside the next runtime, whose first lane opens a new window."""
    busy, stop = threading.Event(), threading.Event()
    busy_end = [0.0]

    def torch_like() -> None:  # a thread that lives on, busy only between the runtimes
        busy.wait()
        end = time.monotonic() + 0.3
        buf = b"x" * (1 << 20)
        while time.monotonic() < end:
            hashlib.sha256(buf).digest()
        busy_end[0] = time.monotonic()
        stop.wait()

    worker = threading.Thread(target=torch_like, daemon=True)
    worker.start()
    try:
        with trio.fail_after(30):
            async with ag.open_runtime(lanes=2):
                await (ag.ones(8, 8) @ ag.ones(8, 8)).ready()
                await _sample_for(0.3)  # the idle worker thread is seen as not the runtime's
                assert _blas._last is not None
            assert _blas._last is None  # the window closed with the runtime
            busy.set()
            while not busy_end[0]:  # busy, but no runtime is open
                await trio.sleep(0.05)
            async with ag.open_runtime(lanes=2):
                await (ag.ones(8, 8) @ ag.ones(8, 8)).ready()
                while _blas._last is None:  # a lane opens the new window as it starts or runs its first kernel
                    await trio.sleep(0.01)
                first = _blas._last
                # the new window starts after the busy gap: its first estimate covers only this runtime's life
                # (before, it started at the last sample of the closed runtime and counted the gap's work)
                assert first[0] >= busy_end[0]
                await trio.sleep(_blas.SAMPLE_S)
                _blas._next_sample = 0.0
                _blas.sample()
                assert _blas._last is not None and _blas._last[0] - first[0] < 0.25 + _blas.SAMPLE_S
    finally:
        busy.set()
        stop.set()
        worker.join(10)


async def test_a_lone_trainings_count_is_back_after_a_kernel_shared_slices() -> None:
    """`ops._slices` runs shared slices on one BLAS thread each; the rest of the lane job (the next
    backward rules) must run at the lone training's full count again, not at the base until the next job."""
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("needs 2+ cores")
    from asyncgrad.runtime._runtime import current_stream

    with trio.fail_after(30):
        async with ag.open_runtime(lanes=cores) as rt:
            await _lanes_started(rt)
            if not _blas.boost_available():
                pytest.skip("not a pthreads OpenBLAS: no thread count to switch")
            current_stream(rt.cpu)
            _blas.pin_spare_cores(cores)  # the cores are ours whatever else runs on this machine
            try:
                _blas._retarget()
                assert _blas.solo()
                from threadpoolctl import threadpool_info

                def count() -> int:
                    return next(i["num_threads"] for i in threadpool_info() if i["internal_api"] == "openblas")

                _blas.sync()
                assert count() == _blas._target > _blas._base
                _blas.boosted(1)
                assert count() == 1
                _blas.unboost()
                assert count() == _blas._target  # the full count, not the base
                assert _blas._applied == _blas._target
            finally:
                _blas.pin_spare_cores(None)


async def test_a_lane_starting_beside_a_training_leaves_the_count_to_the_next_sync() -> None:
    """A lane sets its base count itself, then records it (`set_base`); a lane of another runtime (in another
    thread) may set another count in between. The record must not claim the base then: the next `sync` has to
    set the target, or OpenBLAS keeps the other count while the record says the base (runtimes in threads
    kept two BLAS threads per product beside each other, the pool spinning: 2.5x slower)."""
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("needs 2+ cores")
    from threadpoolctl import threadpool_info

    def count() -> int:
        return next(i["num_threads"] for i in threadpool_info() if i["internal_api"] == "openblas")

    with trio.fail_after(30):
        async with ag.open_runtime(lanes=cores) as rt:
            await _lanes_started(rt)
            if not _blas.boost_available():
                pytest.skip("not a pthreads OpenBLAS: no thread count to switch")
            base = _blas._base
            assert base == 1
            _blas.sync()
            assert count() == _blas._target == 1  # no training: the base
            _blas._setter(cores)  # another runtime's lone training syncs to its full count meanwhile...
            _blas.set_base(base)  # ...after this lane had set its own count, and before it records it
            _blas.sync()
            assert count() == _blas._target == 1
            assert _blas._applied == 1
