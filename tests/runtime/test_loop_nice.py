"""The loop thread's scheduling while a runtime is open: a short scheduler slice (``loop_slice_s``, 0.3 ms
by default) and on request a raised priority (``loop_nice``, lanes keep theirs), both restored on leaving; a clear
PermissionError where the process may not raise it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest
import trio

import asyncgrad as ag

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _may_raise_priority() -> bool:
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, before - 1)
    except PermissionError:
        return False
    os.setpriority(os.PRIO_PROCESS, tid, before)
    return True


@linux
async def test_the_loop_thread_runs_raised_while_the_runtime_is_open_and_the_lanes_do_not() -> None:
    if not _may_raise_priority():
        pytest.skip("this process may not raise its priority (needs root or CAP_SYS_NICE)")
    tid = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, tid)
    with trio.fail_after(30):
        async with ag.open_runtime(loop_nice=base - 5) as rt:
            assert os.getpriority(os.PRIO_PROCESS, tid) == base - 5
            out = ag.ones(200, 200) @ ag.ones(200, 200)
            assert float((await out.ready()).numpy()[0, 0]) == 200.0
            lanes = [os.getpriority(os.PRIO_PROCESS, th.native_id) for th in rt.threads() if th.native_id]
            assert lanes and lanes == [base] * len(lanes)
    assert os.getpriority(os.PRIO_PROCESS, tid) == base


@linux
async def test_an_error_in_the_block_still_restores_the_loops_priority() -> None:
    if not _may_raise_priority():
        pytest.skip("this process may not raise its priority (needs root or CAP_SYS_NICE)")
    tid = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, tid)
    with trio.fail_after(30), pytest.raises(KeyError):
        async with ag.open_runtime(loop_nice=base - 3):
            raise KeyError("boom")
    assert os.getpriority(os.PRIO_PROCESS, tid) == base


SCRIPT = """
import trio, asyncgrad as ag
async def main():
    async with ag.open_runtime(loop_nice=-10):
        pass
try:
    trio.run(main)
except PermissionError as e:
    print("PermissionError:", e)
"""


@linux
def test_without_the_privilege_it_is_a_clear_permission_error() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a child without CAP_SYS_NICE")
    # the child keeps uid 0 but loses CAP_SYS_NICE: what an unprivileged user has
    p = subprocess.run(
        ["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice", sys.executable, "-c", SCRIPT],
        capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "PermissionError: open_runtime(loop_nice=-10)" in p.stdout
    assert "CAP_SYS_NICE" in p.stdout and "loop_nice at None" in p.stdout


@linux
async def test_the_loop_thread_asks_for_a_short_slice_while_the_runtime_is_open_when_told_to() -> None:
    from asyncgrad.runtime._loop_sched import thread_slice_ns

    before = thread_slice_ns()
    if before is None:
        pytest.skip("no sched_getattr on this platform")
    with trio.fail_after(30):
        async with ag.open_runtime(loop_slice_s=None) as rt:
            assert thread_slice_ns() == before  # None leaves the kernel's
        async with ag.open_runtime(loop_slice_s=0.0001) as rt:
            assert thread_slice_ns() == 100_000
            lanes = [thread_slice_ns(th.native_id) for th in rt.threads() if th.native_id]
            assert lanes and all(s == before for s in lanes)  # lanes keep the kernel's slice
            out = ag.ones(100, 100) @ ag.ones(100, 100)
            assert float((await out.ready()).numpy().sum()) == 100.0 * 100 * 100
        assert thread_slice_ns() == before
    with pytest.raises(ValueError, match=r"loop_slice_s=0\.5"):
        async with ag.open_runtime(loop_slice_s=0.5):
            pass
    assert thread_slice_ns() == before


@linux
async def test_by_default_the_loop_asks_for_a_0_3_ms_slice_and_gets_its_own_back_on_leaving() -> None:
    from asyncgrad.runtime._loop_sched import thread_slice_ns
    from asyncgrad.runtime._runtime import DEFAULT_LOOP_SLICE_S

    before = thread_slice_ns()
    if before is None:
        pytest.skip("no sched_getattr on this platform")
    assert DEFAULT_LOOP_SLICE_S == 0.0003
    with trio.fail_after(30):
        async with ag.open_runtime() as rt:
            if thread_slice_ns() == before and before != 300_000:
                pytest.skip("this kernel keeps no per-thread slice (EEVDF's sched_runtime, Linux 6.12+)")
            assert thread_slice_ns() == 300_000
            lanes = [thread_slice_ns(th.native_id) for th in rt.threads() if th.native_id]
            assert lanes and all(s == before for s in lanes)  # lanes keep the kernel's slice
            out = ag.ones(64, 64) @ ag.ones(64, 64)
            assert float((await out.ready()).numpy()[0, 0]) == 64.0
        assert thread_slice_ns() == before
        with pytest.raises(KeyError):  # an error in the block restores it too
            async with ag.open_runtime():
                assert thread_slice_ns() == 300_000
                raise KeyError("boom")
        assert thread_slice_ns() == before
