"""2 ranks: every collective on tensors of several layouts, mismatches, ordering after pending kernels, an
event loop that keeps running meanwhile, two groups at once, a timeout, and the lanes cleaned up.
Writes OUT/rank{r}.npz (arrays) and OUT/rank{r}.txt (error messages)."""

import sys
import threading
import time

import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist


def layouts(base: np.ndarray) -> dict[str, np.ndarray]:
    cl = np.ascontiguousarray(base.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    wide = np.zeros((*base.shape[:-1], base.shape[-1] * 2))
    wide[..., ::2] = base
    return {"c": base.copy(), "f": np.asfortranarray(base), "cl": cl, "strided": wide[..., ::2]}


async def main(out: str) -> None:
    threads_before = threading.active_count()
    dist.init_process_group("mpi", timeout=30)
    rank, size = dist.get_rank(), dist.get_world_size()
    res: dict[str, np.ndarray] = {"rank": np.array(rank), "size": np.array(size)}
    msgs: list[str] = []
    base = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5) + 1
    with trio.fail_after(60):
        for name, arr in layouts(base * (rank + 1)).items():
            t = ag.from_numpy(arr)
            strides = t.strides
            await dist.all_reduce(t)
            res[f"sum/{name}"] = np.array(t.numpy())
            res[f"sum_strides_kept/{name}"] = np.array(t.strides == strides)
            res[f"sum_in_place/{name}"] = np.array(np.shares_memory(t.numpy(), arr))
            t = ag.from_numpy(layouts(base * (rank + 1))[name])
            await dist.all_reduce(t, op="avg")
            res[f"avg/{name}"] = np.array(t.numpy())
            t = ag.from_numpy(layouts(base * (rank + 1))[name])
            await dist.all_reduce(t, op="max")
            res[f"max/{name}"] = np.array(t.numpy())
            t = ag.from_numpy(layouts(base * (10 + rank))[name])
            await dist.broadcast(t, src=1)
            res[f"bcast/{name}"] = np.array(t.numpy())
            outs = [ag.from_numpy(layouts(np.zeros_like(base))[name]) for _ in range(size)]
            await dist.all_gather(outs, ag.from_numpy(layouts(base * (rank + 1))[name]))
            res[f"gather/{name}"] = np.stack([o.numpy() for o in outs])
        o = ag.zeros(3, dtype=ag.float64)
        ins = [ag.tensor([1.0, 2.0, 3.0], dtype=ag.float64) * (rank + 1) + 10 * r for r in range(size)]
        await dist.reduce_scatter(o, ins)
        res["reduce_scatter"] = np.array(o.numpy())
        h = ag.tensor([0.5, 1.5, 2.5], dtype=ag.float16) * (rank + 1)
        await dist.all_reduce(h)
        res["f16"] = np.array(h.numpy())
        ints = ag.tensor([rank + 1, 10 * (rank + 1)], dtype=ag.int64)
        await dist.all_reduce(ints, op="prod")
        res["prod_int"] = np.array(ints.numpy())

        # ordered after the kernels producing the input: a big matmul queued just before
        a = ag.from_numpy(np.random.default_rng(rank).standard_normal((300, 300)))
        y = a @ a  # pending on this task's stream
        w = dist.all_reduce_nowait(y)
        res["matmul_sum"] = np.array((await w).numpy())
        res["matmul_parts"] = np.array((a @ a).numpy())
        # and a later op waits for the collective: z reads y after the all-reduce wrote it
        y2 = a @ a
        dist.all_reduce_nowait(y2)
        res["after"] = np.array((y2 * 2).numpy())

        # the event loop keeps running while a collective waits for a late peer
        ticks = 0
        stop = False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await trio.sleep(0.005)

        async with trio.open_nursery() as n:
            n.start_soon(ticker)
            if rank == 1:
                time.sleep(0.5)  # this rank blocks its own loop: it arrives late on purpose
            t0 = time.perf_counter()
            await dist.all_reduce(ag.ones(4, dtype=ag.float64))
            res["late_wait_s"] = np.array(time.perf_counter() - t0)
            stop = True
        res["ticks"] = np.array(ticks)

        # mismatches: shape, dtype, layout: a clear error on every rank, and the group still works after
        cases = {
            "shape": ag.zeros(3 if rank == 0 else 4, dtype=ag.float64),
            "dtype": ag.zeros(3, dtype=ag.float64 if rank == 0 else ag.float32),
            "layout": ag.from_numpy(np.zeros((4, 5)) if rank == 0 else np.asfortranarray(np.zeros((4, 5)))),
        }
        for what, t in cases.items():
            try:
                await dist.all_reduce(t)
                msgs.append(f"{what}: no error")
            except dist.CollectiveMismatchError as e:
                msgs.append(f"{what}: {e}")
        t = ag.ones(2, dtype=ag.float64)
        await dist.all_reduce(t)
        res["after_mismatch"] = np.array(t.numpy())

        # two groups, each its own communicator and comm lane, used by concurrent tasks
        g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
        got: dict[str, list[float]] = {"a": [], "b": []}

        async def worker(g: dist.ProcessGroup, key: str, k: float) -> None:
            for i in range(40):
                t = ag.full((1000,), float(i) * k * (rank + 1), dtype=ag.float64)
                await dist.all_reduce(t, group=g)
                got[key].append(float(t.numpy()[0]))

        async with trio.open_nursery() as n:
            n.start_soon(worker, g1, "a", 1.0)
            n.start_soon(worker, g2, "b", 7.0)
        res["groups_a"] = np.array(got["a"])
        res["groups_b"] = np.array(got["b"])
        res["g1_stats_completed"] = np.array(g1.statistics().collectives_completed)

        # a rank that never joins: the other fails within the group's timeout, and says why
        short = dist.new_group([0, 1], timeout=1.0)
        if rank == 0:
            t0 = time.perf_counter()
            try:
                await dist.all_reduce(ag.ones(3, dtype=ag.float64), group=short)
                msgs.append("timeout: no error")
            except dist.CollectiveTimeout as e:
                msgs.append(f"timeout: {e}")
            res["timeout_s"] = np.array(time.perf_counter() - t0)
            try:
                await dist.barrier(group=short)
                msgs.append("broken: no error")
            except dist.DistributedError as e:
                msgs.append(f"broken: {e}")
        await dist.barrier()  # the default group is unaffected
        res["threads_with_groups"] = np.array(threading.active_count() - threads_before)
    dist.destroy_process_group()
    res["threads_after"] = np.array(threading.active_count() - threads_before)
    res["initialized_after"] = np.array(dist.is_initialized())
    np.savez(f"{out}/rank{rank}.npz", **res)
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write("\n".join(msgs))


if __name__ == "__main__":
    ag.run(main, sys.argv[1])
