"""The population over real worker processes: streamed reports, cancellation, faults, equal results.

The tests run on both backends (all but one, whose subject does not depend on it): local worker
processes, and Ray actors on a local Ray of 2 CPUs (started once for the module; skipped where ray is
not installed).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist

from . import _pop_fns
from .conftest import TIMEOUT, children

CFG = {"steps": 12, "lr": 0.05}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray of 2 CPUs for this module's Ray tests (ray.init takes seconds: once per module)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # someone else's: use it, leave it
        yield ray
        return
    # on the main thread: Ray's daemons get a parent-death signal tied to the thread that started them
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(params=["local", "ray"])
def backend(request) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def assert_gone(pids: set) -> None:
    """The worker processes (children here, Ray actor processes on Ray) no longer run."""
    pids = {p for p in pids if p is not None}
    assert pids
    deadline = time.monotonic() + 5.0  # a killed process is reaped by its parent (the raylet) soon after
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if running(p)]


async def sequential(cfgs: list[dict]) -> list[list[np.ndarray]]:
    """The same trainings one after another in this process, with a worker's runtime settings."""
    out = []
    for cfg in cfgs:
        res = await _pop_fns.mlp(_pop_fns.FakeTrial(), cfg)
        out.append([p.numpy().copy() for p in res["params"]])
    return out


@pytest.fixture
async def rt1():
    """The parent's runtime, with a worker's settings (one lane, one BLAS thread) for the references."""
    async with ag.open_runtime(lanes=1, blas_threads=1) as r:
        yield r


def assert_same_params(got: list, want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)  # bit-identical


async def test_map_results_equal_sequential_runs(rt1, backend) -> None:
    cfgs = [{**CFG, "seed": s} for s in range(6)]
    before = children()
    got = {}
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=2, max_concurrent=2, backend=backend) as pop:
            pids = {w.pid for w in pop.workers}
            async for res in pop.map(_pop_fns.mlp, cfgs):
                assert res.error is None, res.error
                got[res.config["seed"]] = res
            stats = pop.statistics()
        want = await sequential(cfgs)
    assert sorted(got) == list(range(6))
    for s in range(6):
        assert_same_params(got[s].value["params"], want[s])
    assert {r.worker for r in got.values()} == {"worker0", "worker1"}  # both workers took runs
    assert stats.finished == 6 and stats.failed == 0 and stats.running == 0
    assert children() <= before
    assert_gone(pids)


async def test_reports_arrive_in_order_as_they_happen(rt1, backend) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=2, max_concurrent=2, backend=backend) as pop:
            runs = [await pop.start(_pop_fns.paced, {"n": 6, "delay": 0.15}) for _ in range(3)]
            seen: list[tuple[float, dict]] = []
            async for rep in runs[0].reports():
                seen.append((trio.current_time(), rep))
            for r in runs:
                assert await r.result() == 6
            done_at = trio.current_time()
    assert [rep["step"] for _, rep in seen] == list(range(6))
    for r in runs:  # kept per run, in order, even for the runs nobody read while they ran
        assert [rep["step"] for rep in r.reports_nowait()] == list(range(6))
    # streamed as they happen: report i arrives about i * delay after the first, not all at the end
    t = [at for at, _ in seen]
    gaps = np.diff(t)
    assert all(g > 0.07 for g in gaps), gaps
    assert t[0] < t[-1] - 0.5
    assert t[0] < done_at - 0.5


async def test_cancel_one_run_neighbours_finish(rt1, tmp_path, backend) -> None:
    marker = tmp_path / "cancelled"
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=2, max_concurrent=2, backend=backend) as pop:
            victim = await pop.start(_pop_fns.sleepy, {"sleep": 60, "marker": str(marker)})
            others = [await pop.start(_pop_fns.mlp, {**CFG, "seed": s, "delay": 0.02}) for s in range(3)]
            async for _ in victim.reports():
                break  # it is running
            victim.cancel()
            with pytest.raises(dist.RunCancelled):
                await victim.result()
            values = [await r.result() for r in others]
            # its worker carries on: a new run there still works
            again = await pop.start(_pop_fns.mlp, {**CFG, "seed": 0})
            v0 = await again.result()
        want = await sequential([{**CFG, "seed": s} for s in range(3)])
    for v, w in zip(values, want):
        assert_same_params(v["params"], w)
    assert_same_params(v0["params"], want[0])
    assert marker.read_text() == "cancelled"  # the training saw trio.Cancelled in its worker


async def test_exception_reaches_only_its_result(rt1, backend) -> None:
    cfgs = [{**CFG, "seed": s, **({"fail_at": 3} if s == 1 else {})} for s in range(4)]
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=2, backend=backend) as pop:
            results = {r.config["seed"]: r async for r in pop.map(_pop_fns.mlp, cfgs)}
            bad = await pop.start(_pop_fns.not_async, {})
            with pytest.raises(TypeError, match="async def train"):
                await bad.result()
        want = await sequential([cfgs[0], cfgs[2], cfgs[3]])
    assert isinstance(results[1].error, ValueError)
    assert "failed at step 3 on purpose" in str(results[1].error)
    assert results[1].value is None
    for s, w in zip([0, 2, 3], want):
        assert results[s].error is None
        assert_same_params(results[s].value["params"], w)


async def _kill_mid_training(backend: str, max_retries: int, ray_kill: bool = False) -> tuple[dict, list, object]:
    """SIGKILL the worker of run 0 mid-training (or, ``ray_kill``, kill its Ray actor with ray.kill)."""
    slow = {"steps": 12, "lr": 0.05, "delay": 0.1}
    before = children()
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=2, max_concurrent=2, max_retries=max_retries, backend=backend) as pop:
            pids = {w.pid for w in pop.workers}
            runs = [await pop.start(_pop_fns.mlp, {**slow, "seed": s}) for s in range(4)]
            target = runs[0]
            async for rep in target.reports():
                if rep["step"] >= 3:
                    break
            victim = target.worker
            pid = rep["pid"]
            on_victim = [r.index for r in runs if r.worker == victim]
            if ray_kill:
                import ray

                (w,) = [w for w in pop.workers if w.name == victim]
                assert w.pid == pid
                ray.kill(w.process.actor)
            else:
                os.kill(pid, signal.SIGKILL)
            outcomes = {}
            for r in runs:
                try:
                    outcomes[r.index] = ("ok", await r.result())
                except dist.WorkerDied as e:
                    outcomes[r.index] = ("died", e)
            # the replacement may still be starting when the others finish (a loaded machine)
            while pop.statistics().workers_replaced < 1:
                await trio.sleep(0.05)
            stats = pop.statistics()
            pids |= {w.pid for w in pop.workers}
            # the replacement worker takes new runs
            extra = await (await pop.start(_pop_fns.mlp, {**CFG, "seed": 9})).result()
        assert children() <= before  # the killed worker, its replacement and the others: all gone
    assert_gone(pids)
    return outcomes, on_victim, (stats, victim, extra)


async def test_killed_worker_fails_only_its_runs(rt1, backend) -> None:
    # on Ray the actor is killed with ray.kill (the resume test below SIGKILLs the actor's process)
    ray_kill = backend == "ray"
    outcomes, on_victim, (stats, victim, extra) = await _kill_mid_training(backend, 0, ray_kill)
    want = await sequential([{**CFG, "seed": s, "steps": 12} for s in range(4)])
    assert 0 in on_victim
    for i, (kind, v) in outcomes.items():
        if i in on_victim:
            assert kind == "died", (i, v)
            assert v.worker == victim
            # Ray does not say how an actor's process ended
            assert v.exitcode == (-signal.SIGKILL if backend == "local" else None)
        else:
            assert kind == "ok", (i, v)
            assert_same_params(v["params"], want[i])
    assert stats.failed == len(on_victim) and stats.workers_replaced == 1
    assert victim not in stats.workers and len(stats.workers) == 2
    assert_same_params(extra["params"], (await sequential([{**CFG, "seed": 9}]))[0])


async def test_killed_worker_runs_resume_from_checkpoint(rt1, backend) -> None:
    outcomes, on_victim, (stats, _victim, _) = await _kill_mid_training(backend, 1)
    want = await sequential([{**CFG, "seed": s, "steps": 12} for s in range(4)])
    for i, (kind, v) in outcomes.items():
        assert kind == "ok", (i, v)
        assert_same_params(v["params"], want[i])  # resumed or not: the right result
        if i in on_victim:
            assert v["attempt"] == 1 and v["start"] >= 3  # it restarted from its checkpoint, not from 0
        else:
            assert v["attempt"] == 0 and v["start"] == 0
    assert stats.retried == len(on_victim) and stats.failed == 0


async def test_cancelling_the_scope_stops_everything(rt1, tmp_path, backend) -> None:
    before = children()
    markers = [tmp_path / f"m{i}" for i in range(4)]
    with trio.fail_after(TIMEOUT):
        with trio.move_on_after(60) as cs:
            async with dist.open_population(workers=2, max_concurrent=2, backend=backend) as pop:
                pids = {w.pid for w in pop.workers}
                runs = [await pop.start(_pop_fns.sleepy, {"marker": str(m)}) for m in markers]
                for r in runs:
                    async for _ in r.reports():
                        break
                t0 = trio.current_time()
                cs.cancel()
                await trio.sleep_forever()
        took = trio.current_time() - t0
    assert cs.cancelled_caught
    assert took < 5.0
    for r in runs:
        with pytest.raises(dist.RunCancelled):
            r.result_nowait()
    assert all(m.read_text() == "cancelled" for m in markers)  # each training saw trio.Cancelled
    assert children() <= before
    assert_gone(pids)


async def test_bad_arguments(rt1, backend) -> None:
    with pytest.raises(ValueError, match="backend"):
        async with dist.open_population(workers=1, backend="nope"):
            pass
    with pytest.raises(ValueError, match="workers"):
        async with dist.open_population(workers=0, backend=backend):
            pass
    with pytest.raises(ValueError, match="address= names a Ray cluster"):
        async with dist.open_population(workers=1, address="auto"):
            pass
    if backend == "ray":
        with trio.fail_after(TIMEOUT), pytest.raises(ValueError, match="do not fit the Ray cluster's 2 CPU"):
            async with dist.open_population(workers=3, backend=backend):
                pass
        return  # the checks of pop.start below happen before any worker is involved: once (local) is enough
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=1, backend=backend) as pop:
            with pytest.raises(ValueError, match="cores=4"):
                await pop.start(_pop_fns.mlp, {}, cores=4)
            with pytest.raises(TypeError, match="module level"):
                async def local(trial, cfg):
                    return 1
                await pop.start(local, {})


async def test_leaving_map_early_cancels_the_rest(rt1, tmp_path) -> None:
    # local only: what it tests is the population's own bookkeeping, the same over any backend (and a
    # Ray variant costs ~8 s of the module's time budget)
    from contextlib import aclosing

    backend = "local"
    markers = [tmp_path / f"m{i}" for i in range(2)]
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=1, max_concurrent=3, backend=backend) as pop:
            cfgs = [{**CFG, "seed": 0}] + [{"sleep": 60, "marker": str(m)} for m in markers]

            first = None
            async with aclosing(pop.map(_pop_fns.mixed, cfgs)) as results:
                async for res in results:
                    first = res
                    break
            while pop.statistics().cancelled < 2:
                await trio.sleep(0.05)
            v = await (await pop.start(_pop_fns.mlp, {**CFG, "seed": 1})).result()  # the worker carries on
        want = await sequential([{**CFG, "seed": 0}, {**CFG, "seed": 1}])
    assert first is not None and first.error is None
    assert_same_params(first.value["params"], want[0])
    assert_same_params(v["params"], want[1])
    assert all(m.read_text() == "cancelled" for m in markers)


async def test_ray_missing_names_the_extra(rt1, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where ray is not installed
    with trio.fail_after(TIMEOUT), pytest.raises(ImportError, match=r"pip install 'asyncgrad\[ray\]'"):
        async with dist.open_population(workers=1, backend="ray"):
            pass


def test_core_groups() -> None:
    from asyncgrad.distributed._population import _core_groups

    assert _core_groups([0, 1], 2, 1) == [[0], [1]]
    assert _core_groups([2, 3, 5, 7, 8], 2, 2) == [[2, 3], [5, 7]]  # the CPUs this process may use, in order
    assert _core_groups([0, 1], 1, 2) is None  # one worker: all of them, nothing to pin
    assert _core_groups([0, 1], 3, 1) is None  # more workers than cores: they share them all


_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


async def _masks_by_worker(pop, n: int) -> dict[str, list[list[int]]]:
    """The CPU masks of every thread of each of the ``n`` workers (one run on each: least-loaded placement)."""
    runs = [await pop.start(_pop_fns.affinity, i) for i in range(n)]
    out = {}
    for r in runs:
        got = await r.result()
        out[got["worker"]] = got["masks"]
    assert len(out) == n
    return out


@pytest.mark.skipif(len(_CPUS) < 2 or not os.path.isdir("/proc/self/task"), reason="needs 2 CPUs and Linux")
async def test_local_workers_run_on_cores_of_their_own(rt1) -> None:
    per = len(_CPUS) // 2
    groups = [_CPUS[:per], _CPUS[per : 2 * per]]
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=2) as pop:
            masks = await _masks_by_worker(pop, 2)
            by_name = {w.name: w for w in pop.workers}
            # every thread of worker i (loop, lane, OpenBLAS's pool) runs on the i-th group only
            assert {name: masks[name] for name in sorted(masks)} == {
                name: [groups[by_name[name].index]] * len(masks[name]) for name in sorted(masks)
            }
            victim = pop.workers[0]
            os.kill(victim.pid, signal.SIGKILL)
            while victim.alive:
                await trio.sleep(0.05)
            await (await pop.start(_pop_fns.affinity, 0)).result()  # placing it replaces the dead worker
            while pop.statistics().workers_replaced < 1:
                await trio.sleep(0.05)
            masks = await _masks_by_worker(pop, 2)
            (survivor,) = [w for w in pop.workers if w.name in by_name]
            (replacement,) = [w for w in pop.workers if w.name not in by_name]
        # the replacement takes the dead worker's cores; the survivor keeps its own
        assert all(m == groups[survivor.index] for m in masks[survivor.name])
        assert all(m == groups[victim.index] for m in masks[replacement.name])


@pytest.mark.skipif(len(_CPUS) < 2 or not os.path.isdir("/proc/self/task"), reason="needs 2 CPUs and Linux")
async def test_more_workers_than_cores_share_them_all(rt1) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=len(_CPUS) + 1) as pop:
            masks = await _masks_by_worker(pop, len(_CPUS) + 1)
    assert all(m == _CPUS for ms in masks.values() for m in ms)


async def test_a_full_worker_takes_one_more_and_a_cancelled_one_never_runs(rt1, tmp_path, backend) -> None:
    marks = [tmp_path / f"m{i}" for i in range(4)]
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=1, backend=backend) as pop:
            c = pop.capacity  # each run counts for all the worker's cores: one at a time runs there
            first = await pop.start(_pop_fns.marks_start, {"marker": str(marks[0]), "sleep": 60}, cores=c)
            async for _ in first.reports():
                break  # it is running
            # the worker is full: one more is placed on it at once and waits there
            queued = await pop.start(_pop_fns.marks_start, {"marker": str(marks[1])}, cores=c)
            stats = pop.statistics()
            assert (stats.running, stats.queued, stats.waiting) == (c, c, 0)
            # a third waits in the parent: the worker has one waiting already
            with trio.move_on_after(0.5) as cs:
                await pop.start(_pop_fns.marks_start, {"marker": str(marks[2])}, cores=c)
            assert cs.cancelled_caught and pop.statistics().waiting == 0
            queued.cancel()
            with pytest.raises(dist.RunCancelled):
                await queued.result()
            assert pop.statistics().queued == 0
            # the next one waits behind the running one and starts the moment it returns
            after = await pop.start(_pop_fns.marks_start, {"marker": str(marks[3])}, cores=c)
            await trio.sleep(0.3)
            assert not marks[3].exists() and pop.statistics().queued == c
            first.cancel()
            with pytest.raises(dist.RunCancelled):
                await first.result()
            pid = await after.result()
            stats = pop.statistics()
            assert pid == pop.workers[0].pid and stats.running == 0 and stats.queued == 0
    assert marks[0].exists() and marks[3].exists()
    assert not marks[1].exists() and not marks[2].exists()  # cancelled before they ran: never started


async def test_a_run_waiting_on_a_dead_worker_is_placed_again(rt1, tmp_path, backend) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=2, backend=backend) as pop:
            busy = [await pop.start(_pop_fns.sleepy, {"sleep": 60}) for _ in range(2)]
            for r in busy:
                async for _ in r.reports():
                    break  # both workers are running one
            waiting = await pop.start(_pop_fns.mlp, {**CFG, "seed": 5})
            assert pop.statistics().queued == 1
            while waiting.worker is None:  # its call goes out from a task of the population
                await trio.sleep(0.01)
            (victim,) = [w for w in pop.workers if w.name == waiting.worker]
            (on_victim,) = [r for r in busy if r.worker == victim.name]
            (other,) = [r for r in busy if r is not on_victim]
            if backend == "ray":
                import ray

                ray.kill(victim.process.actor)
            else:
                os.kill(victim.pid, signal.SIGKILL)
            with pytest.raises(dist.WorkerDied):
                await on_victim.result()  # it ran there: it fails (no retries asked for)
            # it never ran there: placed again (behind the other worker's run, or on the replacement)
            while waiting.worker == victim.name:
                await trio.sleep(0.01)
            other.cancel()
            v = await waiting.result()
            assert waiting.attempts == 1 and waiting.worker != victim.name  # no attempt used by the dead one
            stats = pop.statistics()
            assert stats.failed == 1 and stats.retried == 0 and stats.finished == 1
    assert_same_params(v["params"], (await sequential([{**CFG, "seed": 5}]))[0])


async def test_the_workers_close_at_once_after_one_died(rt1, backend, caplog) -> None:
    """Leaving a population whose worker was killed: its replacement is still starting (the population
    launched it at the death), the healthy worker is running a training; everything ends in well under a
    second, the healthy worker on its own (exit status 0), and nobody has to be killed for not leaving."""
    caplog.set_level(logging.WARNING, logger="asyncgrad.distributed")
    before = children()
    with trio.fail_after(TIMEOUT):
        async with dist.open_population(workers=2, backend=backend) as pop:
            runs = [await pop.start(_pop_fns.sleepy, {"sleep": 60}) for _ in range(2)]
            for r in runs:
                async for _ in r.reports():
                    break  # both workers are running one
            victim, healthy = pop.workers
            (on_victim,) = [r for r in runs if r.worker == victim.name]
            if backend == "ray":
                import ray

                ray.kill(victim.process.actor)
            else:
                os.kill(victim.pid, signal.SIGKILL)
            with pytest.raises(dist.WorkerDied):
                await on_victim.result()
            await trio.sleep(0.1)  # the population has launched a replacement: it is starting now
            if backend == "local":
                assert children() - before - {victim.pid, healthy.pid}, "no replacement worker was started"
            assert victim.name not in pop.statistics().workers
            t0 = trio.current_time()
        closed = trio.current_time() - t0
    assert closed < 1.0, f"closing took {closed:.2f} s"
    assert healthy.exitcode == 0  # it left on its own
    assert not [r.getMessage() for r in caplog.records if "did not shut down" in r.getMessage()]
    if backend == "local":
        assert children() <= before  # the replacement that was starting is gone (and reaped) too
