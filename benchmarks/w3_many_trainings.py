"""W3 many-trainings: 32 independent trainings (MLP 64-256-256-10, batch 64, float32, 40 SGD steps each)
run with P = 1, 2, 4, 8, 16, 32 at once. Figures: total seconds and speedup vs P=1, per contender.

Contenders:
- asyncgrad tasks: P worker tasks in ONE runtime (default lanes) pulling trainings from a shared list;
- asyncgrad threads: P OS threads, each calling ``ag.run(...)`` (its own runtime) and pulling trainings
  from a shared queue;
- torch: a ThreadPoolExecutor(P) over the trainings, with the default intra-op threads and with 1;
- asyncgrad population: ``dist.open_population(workers=2)`` (K=2 local worker processes, each one lane
  and one BLAS thread per core it has, the default per-worker limit), P feeders starting trainings on it
  (the population caps what runs at once at its limit: P above it only queues); the workers start and
  are warmed before the clock does;
- asyncgrad population-ray: the same with ``backend="ray"`` (K=2 Ray actors on a local Ray of the
  machine's cores, started before the clock and up only around this contender's cells of a round, so
  that its idle processes do not load the others' runs; skipped when ray is not installed);
- torch multiprocessing: a pool of min(P, cores) spawned processes (1 intra-op thread each, started and
  warmed before the clock), the same 32 trainings;
- numpy processes: the floor in a pool of min(P, cores) spawned processes (1 BLAS thread each, started and
  warmed before the clock): how far this machine's cores scale for these trainings with no framework at all,
  the limit the population's bar is measured against in the same run;
- numpy by hand (the floor) on a ThreadPoolExecutor(P): what plain threads over numpy give, with the
  default BLAS threads and with 1 (the GIL-free share of the floor's own step bounds what any Python
  framework over numpy can gain from threads; this row shows that bound in the same run).
Every training uses the same pre-generated data and start; training 0's final parameters are compared
with the floor's before timing.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from _common import Failed, fmt, have, median, say, table

T, STEPS, B, D, H, C = 32, 40, 64, 64, 256, 10
LR = 0.01


def make_data(seed: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    r = np.random.default_rng(seed)
    x = r.standard_normal((B, D), dtype=np.float32)
    y = r.integers(0, C, B)
    P = [r.standard_normal(s, dtype=np.float32) * 0.05 for s in [(D, H), (H,), (H, H), (H,), (H, C), (C,)]]
    return x, y, P


DATA: list[Any] = []


def data(i: int) -> Any:
    while len(DATA) <= i:
        DATA.append(make_data(len(DATA)))
    return DATA[i]


# ---- one training per contender -------------------------------------------------------------------


def numpy_training(i: int) -> list[np.ndarray]:
    X, Y, P0 = data(i)
    W1, b1, W2, b2, W3, b3 = P = [p.copy() for p in P0]
    ar = np.arange(B)
    for _ in range(STEPS):
        h1p = X @ W1 + b1
        h1 = np.maximum(h1p, 0)
        h2p = h1 @ W2 + b2
        h2 = np.maximum(h2p, 0)
        z = h2 @ W3 + b3
        z = z - z.max(1, keepdims=True)
        e = np.exp(z)
        g = e / e.sum(1, keepdims=True)
        g[ar, Y] -= 1
        g /= B
        gW3 = h2.T @ g
        gb3 = g.sum(0)
        gh2 = g @ W3.T
        gh2[h2p <= 0] = 0
        gW2 = h1.T @ gh2
        gb2 = gh2.sum(0)
        gh1 = gh2 @ W2.T
        gh1[h1p <= 0] = 0
        gW1 = X.T @ gh1
        gb1 = gh1.sum(0)
        for p_, g_ in zip(P, [gW1, gb1, gW2, gb2, gW3, gb3]):
            p_ -= LR * g_
    return P


def torch_training(i: int) -> list[np.ndarray]:
    import torch

    X, Y, P0 = data(i)
    x, y = torch.tensor(X), torch.tensor(Y)
    P = [torch.tensor(p, requires_grad=True) for p in P0]
    for _ in range(STEPS):
        W1, b1, W2, b2, W3, b3 = P
        h = torch.relu(x @ W1 + b1)
        h = torch.relu(h @ W2 + b2)
        z = h @ W3 + b3
        torch.nn.functional.cross_entropy(z, y).backward()
        with torch.no_grad():
            for p in P:
                p -= LR * p.grad
                p.grad = None
    return [p.detach().numpy() for p in P]


async def ag_training(i: int, loss_fn: Any, compiled: bool = False) -> Any:
    """One W3 training; ``compiled``: its step under `ag.compile` (recorded once, then replayed as one lane
    job), which must capture it."""
    import asyncgrad as ag

    X, Y, P0 = data(i)
    x, y, idx = ag.tensor(X), ag.tensor(Y), ag.arange(B)
    P = [ag.tensor(p, requires_grad=True) for p in P0]

    async def step(x: Any, y: Any, idx: Any) -> None:
        W1, b1, W2, b2, W3, b3 = P
        h = ag.relu(x @ W1 + b1)
        h = ag.relu(h @ W2 + b2)
        z = h @ W3 + b3
        loss = loss_fn(z, y, idx)
        await loss.backward()
        with ag.no_grad():
            for p in P:
                p -= LR * p.grad
                p.grad = None

    run = ag.compile(step) if compiled else step
    for _ in range(STEPS):
        await run(x, y, idx)
    if compiled and run.statistics().fallback_reason is not None:
        raise RuntimeError(f"W3's step was not captured: {run.statistics().fallback_reason}")
    for p in P:
        await p.ready()
    return P


async def ag_training_compiled(i: int, loss_fn: Any) -> Any:
    return await ag_training(i, loss_fn, compiled=True)


def _loss_fn() -> Any:
    from w1_mlp_step import ag_loss_fn

    return ag_loss_fn()[0]


# ---- P at once ------------------------------------------------------------------------------------


def _thread_cpu(tid: int) -> float:
    """CPU seconds (user + system) of one thread of this process (Linux; NaN elsewhere)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# the tasks contender's CPU by thread in its latest run at each P (see `_cpu_line`)
TASKS_CPU: dict[int, dict[str, float]] = {}
TASKS_CPU_COMPILED: dict[int, dict[str, float]] = {}


def run_ag_tasks(P: int, n: int, compiled: bool = False) -> float:
    """P worker tasks in one runtime pull trainings from a shared list; seconds for all ``n``.

    Also notes the CPU seconds of the loop thread, of the runtime's lanes and of the process's other
    threads (BLAS pool threads) in `TASKS_CPU`: where the time goes when trainings share the runtime."""
    import trio

    import asyncgrad as ag

    loss_fn = _loss_fn()

    async def main() -> float:
        async with ag.open_runtime() as rt:
            todo = list(range(n))

            train = ag_training_compiled if compiled else ag_training

            async def worker() -> None:
                while todo:
                    await train(todo.pop(), loss_fn)

            loop_tid = threading.get_native_id()
            lane_tids = [th.native_id for th in rt.threads() if th.native_id is not None]
            before = [_thread_cpu(loop_tid)] + [_thread_cpu(tid) for tid in lane_tids]
            cpu0 = time.process_time()
            t = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(P):
                    nursery.start_soon(worker)
            dt = time.perf_counter() - t
            cpu = time.process_time() - cpu0
            after = [_thread_cpu(loop_tid)] + [_thread_cpu(tid) for tid in lane_tids]
            used = [b - a for a, b in zip(before, after)]
            (TASKS_CPU_COMPILED if compiled else TASKS_CPU)[P] = {
                "wall": dt, "process": cpu, "loop": used[0], "lanes": sum(used[1:]), "other": cpu - sum(used)
            }
            return dt

    return trio.run(main)  # type: ignore[no-any-return]


def _cpu_line(P: int) -> str:
    c = TASKS_CPU[P]
    return (f"P={P}: loop {c['loop']:.2f} s, lanes {c['lanes']:.2f} s, other threads {c['other']:.2f} s "
            f"in {c['wall']:.2f} s ({c['process'] / c['wall']:.2f} cores busy)")


def run_ag_threads(P: int, n: int) -> float:
    """P OS threads, each `ag.run(...)` (its own runtime), pull trainings from a shared queue."""
    import asyncgrad as ag

    loss_fn = _loss_fn()
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(n):
        todo.put(i)
    errors: list[BaseException] = []

    async def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            await ag_training(i, loss_fn)

    def thread_main() -> None:
        try:
            ag.run(worker)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=thread_main) for _ in range(P)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    if errors:
        raise errors[0]
    return dt


async def pop_training(trial: Any, i: int) -> list[Any]:
    """One W3 training as a population training (runs in a worker)."""
    return await ag_training(i, _loss_fn())  # type: ignore[no-any-return]


async def pop_warm(trial: Any, n: int) -> list[Any]:
    """A worker's warm-up outside the clock: the ``n`` trainings' data made (the other contenders' is made
    before their clock too), then training 0 (imports, first kernels)."""
    for i in range(n):
        data(i)
    return await pop_training(trial, 0)


POP_WORKERS = 2


def run_population(P: int, n: int, check: bool = False, backend: str = "local") -> Any:
    """P trainings in flight over K=2 worker processes (``backend="ray"``: Ray actors); seconds for all
    ``n`` (workers started before)."""
    import trio

    import asyncgrad as ag
    from asyncgrad import distributed as dist

    async def main() -> Any:
        async with ag.open_runtime(lanes=1):
            async with dist.open_population(workers=POP_WORKERS, backend=backend) as pop:
                # warm each worker (imports, the data, first kernels) outside the clock, as the threads' contenders are
                warm = [await pop.start(pop_warm, n) for _ in range(POP_WORKERS)]
                for r in warm:
                    await r.result()
                if check:
                    return [p.numpy().copy() for p in await (await pop.start(pop_training, 0)).result()]
                todo = list(range(n))

                async def feeder() -> None:
                    while todo:
                        run = await pop.start(pop_training, todo.pop())
                        await run.result()

                t = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(P):
                        nursery.start_soon(feeder)
                return time.perf_counter() - t

    return trio.run(main)


def _start_ray(cores: int) -> bool:
    """A local Ray of this machine's cores for the population-ray contender; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    return True


def _ray_cell(P: int, n: int, cores: int, last_P: int, check: bool = False) -> Any:
    """The population-ray contender at ``P``: a local Ray runs only around its cells (started at the
    first of a round, shut down after ``last_P``). An idle local Ray keeps ~0.06 of a core busy (GCS,
    raylet; measured here), which the other contenders' runs at P >= 2 would pay on a 2-core machine."""
    import ray

    _start_ray(cores)  # outside the timed part of the cell (`run_population` times only the trainings)
    try:
        return run_population(P, n, check=check, backend="ray")
    finally:
        if P == last_P:
            ray.shutdown()


def _torch_proc_init() -> None:
    import torch

    torch.set_num_threads(1)
    for i in range(T):  # the data, before the clock (as the parent's is for the threads' contenders)
        data(i)


def _torch_proc_training(i: int) -> int:
    torch_training(i)
    return i


def _process_pool(mp: Any, init: Any, train: Any, P: int, n: int) -> float:
    """Seconds for ``n`` trainings ``train(i)`` on a pool of min(P, cores) spawned processes (``mp``: the
    multiprocessing module), each set up by ``init``, all started and warmed before the clock."""
    procs = min(P, os.cpu_count() or 1)
    with mp.get_context("spawn").Pool(procs, initializer=init) as pool:
        pool.map(train, range(procs), chunksize=1)  # start and warm every process
        t = time.perf_counter()
        pool.map(train, range(n), chunksize=1)
        return time.perf_counter() - t  # type: ignore[no-any-return]


def run_torch_mp(P: int, n: int) -> float:
    """A pool of min(P, cores) spawned processes (1 intra-op thread each) runs the ``n`` trainings."""
    import torch.multiprocessing as mp

    return _process_pool(mp, _torch_proc_init, _torch_proc_training, P, n)


def _np_proc_init() -> None:
    from threadpoolctl import threadpool_limits

    global _NP_PROC_LIMIT
    _NP_PROC_LIMIT = threadpool_limits(limits=1, user_api="blas")  # kept: the limit holds while it lives
    for i in range(T):  # the data, before the clock
        data(i)


_NP_PROC_LIMIT: Any = None


def _np_proc_training(i: int) -> int:
    numpy_training(i)
    return i


def run_np_mp(P: int, n: int) -> float:
    """The floor in a pool of min(P, cores) spawned processes (1 BLAS thread each): what this machine gives
    processes running the same trainings with no framework at all."""
    import multiprocessing as mp

    return _process_pool(mp, _np_proc_init, _np_proc_training, P, n)


def run_pool(fn: Any, P: int, n: int) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(P) as ex:
        list(ex.map(fn, range(n)))
    return time.perf_counter() - t


def run_pool_blas1(fn: Any, P: int, n: int) -> float:
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return run_pool(fn, P, n)


def run_torch(P: int, n: int, intra: int | None) -> float:
    import torch

    prev = torch.get_num_threads()
    if intra is not None:
        torch.set_num_threads(intra)
    try:
        return run_pool(torch_training, P, n)
    finally:
        torch.set_num_threads(prev)


def ag_check(compiled: bool = False) -> list[np.ndarray]:
    import trio

    import asyncgrad as ag

    loss_fn = _loss_fn()

    async def main() -> list[np.ndarray]:
        async with ag.open_runtime():
            P = await (ag_training_compiled if compiled else ag_training)(0, loss_fn)
            return [p.numpy().copy() for p in P]

    return trio.run(main)  # type: ignore[no-any-return]


# ---- the workload ---------------------------------------------------------------------------------


def run(quick: bool = False) -> dict[str, Any]:
    from _common import interleave

    n = T
    Ps = [1, 2, 8] if quick else [1, 2, 4, 8, 16, 32]
    rounds = 1 if quick else 3
    cores = os.cpu_count() or 1
    say(f"W3 many-trainings: {n} trainings x MLP {D}-{H}-{H}-{C}, batch {B}, float32, {STEPS} SGD steps; "
        f"P={Ps}; {rounds} interleaved round(s)")
    for i in range(n):
        data(i)

    runners: dict[str, Any] = {
        "asyncgrad population (K=2)": run_population,
        "asyncgrad tasks": run_ag_tasks,
        "asyncgrad tasks, ag.compile": lambda P, n: run_ag_tasks(P, n, compiled=True),
        "asyncgrad threads": run_ag_threads,
    }
    torch_threads = None
    if have("torch"):
        import torch

        torch_threads = torch.get_num_threads()
        runners[f"torch threads (intra-op {torch_threads})"] = lambda P, n: run_torch(P, n, None)
        runners["torch threads (intra-op 1)"] = lambda P, n: run_torch(P, n, 1)
        runners["torch multiprocessing (1 thread)"] = run_torch_mp
    else:
        say("  torch: not installed, skipped (pip install torch==2.13.0)")
    if have("ray"):
        runners["asyncgrad population-ray (K=2)"] = lambda P, n: _ray_cell(P, n, cores, Ps[-1])
    else:
        say("  population-ray: ray not installed, skipped (pip install 'asyncgrad[ray]')")
    runners["numpy threads (floor)"] = lambda P, n: run_pool(numpy_training, P, n)
    runners["numpy threads, 1 BLAS thread"] = lambda P, n: run_pool_blas1(numpy_training, P, n)
    runners["numpy processes, 1 BLAS thread"] = run_np_mp

    say("  checking training 0 against the floor...")
    ref = numpy_training(0)
    checks = {}
    check_fns: list[tuple[str, Any]] = [
        ("asyncgrad", ag_check), ("asyncgrad, ag.compile", lambda: ag_check(compiled=True)),
        ("asyncgrad population", lambda: run_population(1, 1, check=True)),
    ]
    if have("ray"):
        check_fns.append(("asyncgrad population-ray", lambda: _ray_cell(1, 1, cores, 1, check=True)))
    if torch_threads is not None:
        check_fns.append(("torch", lambda: torch_training(0)))
    for name, fn in check_fns:
        try:
            err = max(float(np.max(np.abs(a - b))) for a, b in zip(fn(), ref))
            checks[name] = f"max |param - floor| = {err:.1e}" + ("" if err < 1e-4 else "  << DIFFERS")
        except Exception as e:
            checks[name] = str(Failed(e))
        say(f"    {name}: {checks[name]}")

    try:  # the captured training is the eager one bit for bit
        same = all(np.array_equal(a, b) for a, b in zip(ag_check(), ag_check(compiled=True)))
        checks["ag.compile vs eager"] = "bit-identical" if same else "DIFFERS"
    except Exception as e:
        checks["ag.compile vs eager"] = str(Failed(e))
    say(f"    asyncgrad, ag.compile vs eager: {checks['ag.compile vs eager']}")

    # one contender = (runner, P); interleave all of them, round after round
    # numpy threads with the default BLAS oversubscribe it (P threads x BLAS threads) and take long: that
    # floor runs at P=1, 2, 8 only (--quick: P=1 only); with 1 BLAS thread it runs at every P
    floor_Ps = [1] if quick else [1, 2, 8]
    contenders = {
        f"{name}|{P}": (lambda fn=fn, P=P: fn(P, n))
        for name, fn in runners.items()
        for P in Ps
        if not (name == "numpy threads (floor)" and P not in floor_Ps)
    }
    say(f"  timing {len(contenders)} (contender, P) runs per round...")
    res = interleave(contenders, rounds, pause=0.1, log=say, budget_s=12.0)
    if have("ray"):
        import ray

        ray.shutdown()

    out: dict[str, Any] = {"trainings": n, "P": Ps, "rounds": rounds, "checks": checks, "contenders": {}}
    rows = []
    floor1 = res.get(f"numpy threads (floor)|{Ps[0]}")
    floor1_med = median(floor1) if isinstance(floor1, list) and floor1 else float("nan")
    for name in runners:
        cells = [name]
        rec: dict[str, Any] = {}
        base = res[f"{name}|1"]
        base_med = median(base) if isinstance(base, list) and base else float("nan")
        fails = []
        for P in Ps:
            r = res.get(f"{name}|{P}")
            if r is None:
                cells.append("-")
                continue
            if isinstance(r, Failed):
                cells.append("FAIL")
                fails.append(f"P={P}: {r}")
                rec[P] = {"error": str(r)}
                continue
            med = median(r)
            cells.append(f"{med:.2f}s {base_med / med:.2f}x")
            rec[P] = {"seconds": r, "median": med, "speedup_vs_P1": base_med / med,
                      "throughput_vs_floor_P1": floor1_med / med}
        cells.append(fmt(floor1_med / base_med) + "x")
        meds = [v["median"] for v in rec.values() if "median" in v]
        cells.append(fmt(floor1_med / min(meds)) + "x" if meds else "-")
        rows.append(cells)
        out["contenders"][name] = rec
        for f in fails[:1]:
            rows.append([f"  {name}: FAILED {f}"])
    say()
    say("  (a run that took over 12 s in all gets no further rounds: its cell is then one measurement)")
    say(f"  each cell: median total seconds, speedup vs the same contender at P=1 ({cores} cores);")
    say("  last columns: throughput at P=1 and at its best P, relative to the numpy floor at P=1")
    hdr = ["contender"] + [f"P={P}" for P in Ps] + ["P=1 /floor", "best /floor"]
    say(table(hdr, [r if len(r) > 1 else r + [""] * (len(hdr) - 1) for r in rows]))
    if TASKS_CPU:
        # the tasks contender's latest run at each P: with several trainings the loop and the lanes all run
        # Python under one GIL (numpy's small kernels hold it), so fewer cores stay busy than at P=1
        say("  asyncgrad tasks, CPU by thread (latest run; other threads: BLAS pool threads, which spin "
            "while they wait): " + "; ".join(_cpu_line(P) for P in Ps if P in TASKS_CPU))
        out["tasks_cpu_by_thread"] = dict(TASKS_CPU)
    for label in ("asyncgrad tasks", "asyncgrad tasks, ag.compile"):
        ct = out["contenders"].get(label, {})
        sp = [ct[P]["speedup_vs_P1"] for P in Ps if P in ct and "speedup_vs_P1" in ct[P]]
        if sp:
            s2 = ct.get(2, {}).get("speedup_vs_P1", float("nan"))
            ok = min(sp) >= 1.0 and s2 >= 1.5
            say(f"  target ({label}): >= 1.0x at every P, >= 1.5x at P=2 -> min {min(sp):.2f}x, "
                f"P=2 {s2:.2f}x ({'met' if ok else 'NOT met'})")
    at = out["contenders"].get("asyncgrad tasks", {})
    pop = out["contenders"].get("asyncgrad population (K=2)", {})
    # one after another: the same 32 trainings, one at a time, in one runtime (asyncgrad tasks at P=1) and
    # on one worker of the population (its P=1); the target is checked against the faster of the two
    seqs = [v for v in (at.get(1, {}).get("median"), pop.get(1, {}).get("median")) if v]
    if pop and seqs:
        seq = min(seqs)
        sp_seq = {P: seq / pop[P]["median"] for P in Ps if P in pop and "median" in pop[P]}
        out["population_speedup_vs_one_after_another"] = sp_seq
        cells = ", ".join(f"P={P} {v:.2f}x" for P, v in sp_seq.items())
        at2 = [v for P, v in sp_seq.items() if P >= 2]
        ok2 = bool(at2) and min(at2) >= 1.7
        say(f"  population vs the 32 trainings one after another ({seq:.2f} s, the faster of one runtime at "
            f"P=1 and one worker at P=1): {cells}")
        say(f"  target (population): >= 1.7x at every P >= 2 -> min {min(at2) if at2 else float('nan'):.2f}x "
            f"({'met' if ok2 else 'NOT met'})")
    nb: dict[Any, Any] = out["contenders"].get("numpy threads, 1 BLAS thread", {})
    if 2 in nb and "speedup_vs_P1" in nb[2]:
        say(f"  the same bar for plain numpy threads with 1 BLAS thread (no framework at all): P=2 "
            f"{nb[2]['speedup_vs_P1']:.2f}x")
    npp: dict[Any, Any] = out["contenders"].get("numpy processes, 1 BLAS thread", {})
    sp_np = {P: v["speedup_vs_P1"] for P, v in npp.items() if P >= 2 and "speedup_vs_P1" in v}
    if sp_np:
        # the machine's own limit in this run: the same trainings in processes, no framework, no messages
        out["machine_process_scaling"] = sp_np
        say("  this machine's process scaling in the same run (the floor in min(P, cores) processes, no "
            "framework): " + ", ".join(f"P={P} {v:.2f}x" for P, v in sp_np.items())
            + f"; min {min(sp_np.values()):.2f}x (what processes reach here with no framework at all)")
    return out
