"""2 ranks, one fault: ``raise`` (rank 1's backward raises mid-pass) or ``die`` (rank 1 exits mid-backward).
Rank 0 must fail with a clear error within the group's timeout; it writes OUT/rank0.json."""

import json
import os
import sys
import time

import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist
from asyncgrad import nn
from asyncgrad.nn.parallel import DistributedDataParallel as DDP

TIMEOUT = 2.0
ARMED = [False]


class Fault(ag.Function):
    """Identity forward; once armed, its backward faults on rank 1 (the pass there never commits)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        if ARMED[0] and dist.get_rank() == 1:
            if sys.argv[2] == "die":
                os._exit(3)
            raise RuntimeError("rank 1 failed in the middle of its backward")
        return g


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32, dtype=ag.float64)
        self.l2 = nn.Linear(32, 4, dtype=ag.float64)

    def forward(self, x):
        # the fault sits between the layers: l2's gradients are computed before it, l1's after
        return self.l2(Fault.apply(self.l1(x).relu()))


async def main(out: str, mode: str) -> None:
    g = dist.init_process_group("mpi", timeout=TIMEOUT)
    rank = g.rank
    model = Net()
    ddp = DDP(model)
    x = ag.from_numpy(np.random.default_rng(rank).standard_normal((8, 16)))
    res: dict = {"mode": mode}
    with trio.fail_after(TIMEOUT * 5):
        await ddp(x).sum().backward()  # one good step first
        before = {n: np.array(p.grad.numpy()) for n, p in model.named_parameters()}
        ARMED[0] = True
        t0 = time.perf_counter()
        try:
            await ddp(x).sum().backward()
            res["error"] = "no error"
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
        res["elapsed"] = time.perf_counter() - t0
        res["grads_as_before"] = all(np.array_equal(p.grad.numpy(), before[n]) for n, p in model.named_parameters())
    if rank == 0:
        with open(f"{out}/rank0.json", "w") as f:
            json.dump(res, f)
    else:
        time.sleep(TIMEOUT * 1.5)  # let rank 0 see its timeout before this rank's exit ends the job
    raise SystemExit(1 if rank == 1 else 0)


if __name__ == "__main__":
    ag.run(main, sys.argv[1], sys.argv[2])
