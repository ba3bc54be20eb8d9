"""2 ranks: train each (model, optimizer, gradient_as_bucket_view) case on halves of each batch; write
the final parameters, the .grad/param strides and the bucket layout to OUT/rank{r}.npz."""

import sys

import ddp_common as C
import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist
from asyncgrad.nn.parallel import DistributedDataParallel as DDP

CASES = [(k, o, v) for k in ("mlp", "cnn") for o in ("sgd", "adam") for v in (False, True)]


async def main(out: str) -> None:
    group = dist.init_process_group("mpi", timeout=60)
    rank, world = group.rank, group.size
    half = C.BATCH // world
    part = slice(rank * half, (rank + 1) * half)
    results: dict[str, np.ndarray] = {}
    with trio.fail_after(120):
        for kind, opt_name, view in CASES:
            tag = f"{kind}-{opt_name}-{'view' if view else 'copy'}"
            model = C.build(kind)
            ddp = DDP(model, bucket_cap_mb=0.25, gradient_as_bucket_view=view)
            opt = C.optimizer(opt_name, ddp.parameters())
            strides = await C.train(ddp, opt, C.data(kind), part)
            for name, arr in C.params_of(model).items():
                results[f"{tag}/param/{name}"] = arr
            results[f"{tag}/strides_ok"] = np.array(
                [all(p == g for p, g in step) for step in strides], dtype=bool
            )
            st = ddp.statistics()
            results[f"{tag}/buckets"] = np.array(st.bucket_sizes)
            results[f"{tag}/rebuilt"] = np.array(st.rebuilt)
            results[f"{tag}/synced"] = np.array(st.synced_passes)
            if view:
                # .grad is a view of its bucket: writing the bucket shows through it
                results[f"{tag}/grad_is_view"] = np.array(
                    [np.shares_memory(p.grad.numpy(), b.numpy()) for p in model.parameters()
                     for b in [next(b for b in ddp.buckets() if np.shares_memory(p.grad.numpy(), b.numpy()))]]
                )
            ddp.close()
    np.savez(f"{out}/rank{rank}.npz", **results)
    dist.destroy_process_group()


if __name__ == "__main__":
    ag.run(main, sys.argv[1])
