"""A lone training takes every lane's BLAS threads only while other processes leave the cores free: a
multi-threaded BLAS call waits for its slowest thread, so beside busy processes it runs on one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.devices import _blas

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the load is read from /proc/stat")
BUSY = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"


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
                await (ag.ones(8, 8) @ ag.ones(8, 8)).ready()  # the lanes have started (and set the base)
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
