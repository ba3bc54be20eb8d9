"""One rank of W7 (started by w7_ddp.py through the launcher): trains W1's MLP (784-512-512-10, float32,
batch 64 per rank, SGD) data-parallel with asyncgrad DDP or torch DDP (gloo), and writes its figures.

    python -m asyncgrad.distributed.launch -n 2 benchmarks/_w7_rank.py {asyncgrad|torch} OUT.json STEPS [LANES]
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

B, D, H, C = 64, 784, 512, 10
LR = 0.01
WARMUP = 5


def init() -> list[np.ndarray]:
    r = np.random.default_rng(1)
    return [r.standard_normal(s, dtype=np.float32) * 0.05 for s in [(H, D), (H,), (H, H), (H,), (C, H), (C,)]]


def data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal((B, D), dtype=np.float32), rng.integers(0, C, B)


def run_asyncgrad(out: str, steps: int, lanes: int) -> None:
    import trio

    import asyncgrad as ag
    from asyncgrad import distributed as dist
    from asyncgrad import nn
    from asyncgrad.nn.parallel import DistributedDataParallel as DDP

    async def main() -> None:
        g = dist.init_process_group("mpi", timeout=60)
        rank = g.rank
        model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, C))
        with ag.no_grad():
            for p, arr in zip(model.parameters(), init()):
                p.copy_(ag.from_numpy(arr))
        # the last gradient the backward computes: where its stream's backward work ends (see below)
        compute_end: list[float] = []
        armed = [False]

        def mark_end(p: ag.Tensor) -> None:
            if armed[0]:
                s, _ = ag.runtime.stream_work(p.grad)
                if s is not None:  # a job after every kernel queued on the compute stream so far
                    ag.runtime.submit_on(s, lambda: compute_end.append(time.perf_counter()), [], after_caller=False)
                else:
                    compute_end.append(time.perf_counter())

        model[0].weight.register_post_accumulate_grad_hook(mark_end)
        ddp = DDP(model)
        opt = ag.optim.SGD(ddp.parameters(), lr=LR)
        x, y = data(rank)
        X, Y = ag.from_numpy(x), ag.tensor(y)

        async def step() -> None:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(X), Y)
            await loss.backward()
            opt.step()

        with trio.fail_after(300):
            for _ in range(WARMUP):
                await step()
            await ddp.parameters().__next__().ready()
            await dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                await step()
            for p in ddp.parameters():
                await p.ready()
            await dist.barrier()
            elapsed = time.perf_counter() - t0
            check = float(np.abs(model[0].weight.numpy()).sum())  # after the same steps as torch's
            # the timeline of a few steps: bucket all-reduces (comm lane) against the backward's compute
            fractions = []
            detail = []
            for _ in range(5):
                for p in ddp.parameters():
                    await p.ready()
                await dist.barrier()
                g.enable_timeline(True)
                compute_end.clear()
                armed[0] = True
                t_start = time.perf_counter()
                await step()
                armed[0] = False
                for p in ddp.parameters():
                    await p.ready()
                tl = [e for e in g.timeline() if e.nbytes > 64]  # the buckets (not the barrier)
                g.enable_timeline(False)
                end = compute_end[0]
                total = sum(e.end - e.start for e in tl)
                hidden = sum(max(0.0, min(e.end, end) - max(e.start, t_start)) for e in tl)
                fractions.append(hidden / total if total else 0.0)
                detail.append({
                    "backward_compute_end_ms": (end - t_start) * 1e3,
                    "buckets": [
                        {"bytes": e.nbytes, "start_ms": (e.start - t_start) * 1e3, "end_ms": (e.end - t_start) * 1e3}
                        for e in tl
                    ],
                })
        st = ddp.statistics()
        res = {
            "rank": rank,
            "samples_per_s": 2 * B * steps / elapsed,
            "ms_per_step": elapsed / steps * 1e3,
            "overlap_fraction": float(np.median(fractions)),
            "overlap_fractions": fractions,
            "timeline": detail[int(np.argsort(fractions)[len(fractions) // 2])],
            "bucket_sizes": st.bucket_sizes,
            "loss_param_check": check,
        }
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
        ddp.close()
        dist.destroy_process_group()

    ag.run(main, lanes=lanes, blas_threads=1)


def run_torch(out: str, steps: int) -> None:
    import torch
    import torch.distributed as tdist
    from torch import nn

    torch.set_num_threads(1)
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    port = int(os.environ.get("W7_TORCH_PORT", "29517"))
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, C))
    with torch.no_grad():
        for p, arr in zip(model.parameters(), init()):
            p.copy_(torch.from_numpy(arr))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    x, y = data(rank)
    X, Y = torch.from_numpy(x), torch.from_numpy(y)

    def step() -> None:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(X), Y)
        loss.backward()
        opt.step()

    for _ in range(WARMUP):
        step()
    tdist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    tdist.barrier()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rank": rank, "samples_per_s": 2 * B * steps / elapsed, "ms_per_step": elapsed / steps * 1e3,
                       "loss_param_check": float(model[0].weight.detach().abs().sum())}, f)
    tdist.destroy_process_group()


if __name__ == "__main__":
    which, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if which == "asyncgrad":
        run_asyncgrad(out, steps, int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    else:
        run_torch(out, steps)
