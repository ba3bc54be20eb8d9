"""2 ranks: hook ownership (counts, close, re-wrap, two instances, GC), no_sync, comm hooks, unused
parameters, a failed and a cancelled backward. Each check compares with the same computation done here in
one process on the whole batch (every rank has all the data). Writes OUT/rank{r}.json."""

import gc
import json
import sys
import threading
import weakref

import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist
from asyncgrad import nn
from asyncgrad.distributed import comm_hooks
from asyncgrad.nn.parallel import DistributedDataParallel as DDP

F = nn.functional


def hooks(model: nn.Module) -> list[int]:
    return [len(p._post_hooks or {}) for p in model.parameters()]


def mlp(seed: int = 3) -> nn.Module:
    rng = np.random.default_rng(seed)
    m = nn.Sequential(nn.Linear(6, 8, dtype=ag.float64), nn.Tanh(), nn.Linear(8, 3, dtype=ag.float64))
    for layer in (m[0], m[2]):
        layer.weight = nn.Parameter(ag.from_numpy(rng.standard_normal(tuple(layer.weight.shape))))
        layer.bias = nn.Parameter(ag.from_numpy(rng.standard_normal(tuple(layer.bias.shape))))
    return m


class TwoHeads(nn.Module):
    """``head`` is used only when asked; ``spare`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.head = nn.Linear(3, 3, dtype=ag.float64)
        self.spare = nn.Linear(3, 3, dtype=ag.float64)

    def forward(self, x: ag.Tensor, use_head: bool) -> ag.Tensor:
        y = self.body(x)
        return self.head(y) if use_head else y


RNG = np.random.default_rng(5)
X = [RNG.standard_normal((8, 6)) for _ in range(4)]
Y = [RNG.integers(0, 3, 8) for _ in range(4)]


def loss_of(model: nn.Module, x: np.ndarray, y: np.ndarray, *a: object) -> ag.Tensor:
    return F.cross_entropy(model(ag.from_numpy(x), *a), ag.tensor(y))


def grads(model: nn.Module) -> dict[str, list[float] | None]:
    return {n: (None if p.grad is None else p.grad.numpy().ravel().tolist()) for n, p in model.named_parameters()}


def rel(a: dict, b: dict) -> float:
    worst = 0.0
    for k in b:
        if (a[k] is None) != (b[k] is None):
            return float("inf")
        if a[k] is not None:
            x, y = np.array(a[k]), np.array(b[k])
            worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-300)))
    return worst


async def reference(steps: list[int], build=mlp, *extra: object) -> dict:
    """Gradients one process gets from the whole batches ``steps`` (summed over them, as accumulation does)."""
    m = build()
    for k in steps:
        await loss_of(m, X[k], Y[k], *extra).backward()
    return grads(m)


async def main(out: str) -> None:
    threads_before = threading.active_count()
    g = dist.init_process_group("mpi", timeout=20)
    rank = g.rank
    part = slice(rank * 4, rank * 4 + 4)
    res: dict = {}
    with trio.fail_after(90):
        # ---- hooks leave with their owner ----
        model = mlp()
        user_calls: list[int] = []
        model[0].weight.register_post_accumulate_grad_hook(lambda p: user_calls.append(1))
        res["hooks_before"] = hooks(model)
        a = DDP(model)
        res["hooks_wrapped"] = hooks(model)
        hook_fn = weakref.ref(list(model[2].bias._post_hooks.values())[-1])
        reducer = weakref.ref(a._ddp_reducer)
        await loss_of(a, X[0][part], Y[0][part]).backward()
        res["user_calls_1"] = len(user_calls)
        a.close()
        gc.collect()
        res["hooks_closed"] = hooks(model)
        res["reducer_gone_after_close"] = reducer() is None
        res["hook_fn_gone_after_close"] = hook_fn() is None
        b = DDP(model)
        c = DDP(model)
        res["hooks_two"] = hooks(model)
        model.zero_grad()
        await loss_of(b, X[1][part], Y[1][part]).backward()  # b's and c's hooks both see the pass...
        res["two_instances_grad_rel"] = rel(grads(model), await reference([1]))  # ...and average once each
        b.close()
        res["hooks_one_left"] = hooks(model)
        model.zero_grad()
        await loss_of(c, X[2][part], Y[2][part]).backward()
        res["one_left_grad_rel"] = rel(grads(model), await reference([2]))
        reducer = weakref.ref(c._ddp_reducer)
        del c
        gc.collect()
        res["hooks_after_gc"] = hooks(model)
        res["reducer_gone_after_gc"] = reducer() is None
        async with DDP(model) as d:
            res["hooks_async_with"] = hooks(model)
            del d
        res["hooks_after_async_with"] = hooks(model)
        res["user_calls_end"] = len(user_calls)
        # a failed wrap (ranks disagree on the model) adds nothing, and wrapping again works
        other = mlp()
        if rank == 1:
            other[0].weight = nn.Parameter(ag.from_numpy(np.asfortranarray(other[0].weight.numpy())))
        try:
            DDP(other)
            res["wrap_mismatch"] = "no error"
        except ValueError as e:
            res["wrap_mismatch"] = str(e)
        res["hooks_after_failed_wrap"] = hooks(other)
        e2 = DDP(mlp())
        res["rewrap_hooks"] = hooks(e2.module)
        e2.close()

        # ---- no_sync: two local micro-batches, then one synchronized ----
        model = mlp()
        ddp = DDP(model)
        with ddp.no_sync():
            await loss_of(ddp, X[0][part], Y[0][part]).backward()
            local = grads(model)
            await loss_of(ddp, X[1][part], Y[1][part]).backward()
        await loss_of(ddp, X[2][part], Y[2][part]).backward()
        res["no_sync_local_differs"] = rel(local, await reference([0])) > 1e-3
        res["no_sync_grad_rel"] = rel(grads(model), await reference([0, 1, 2]))
        res["no_sync_stats"] = [ddp.statistics().synced_passes, ddp.statistics().local_passes]
        ddp.close()

        # ---- gradient_as_bucket_view + accumulation without zero_grad ----
        model = mlp()
        ddp = DDP(model, gradient_as_bucket_view=True)
        await loss_of(ddp, X[0][part], Y[0][part]).backward()
        await loss_of(ddp, X[1][part], Y[1][part]).backward()
        res["view_accum_rel"] = rel(grads(model), await reference([0, 1]))
        ddp.close()

        # ---- comm hooks ----
        for name, hook in (("allreduce", comm_hooks.allreduce_hook), ("fp16", comm_hooks.fp16_compress_hook)):
            model = mlp()
            ddp = DDP(model)
            ddp.register_comm_hook(None, hook)
            await loss_of(ddp, X[3][part], Y[3][part]).backward()
            res[f"hook_{name}_rel"] = rel(grads(model), await reference([3]))
            res[f"hook_{name}_dtype"] = str(model[0].weight.grad.dtype)
            try:
                ddp.register_comm_hook(None, hook)
                res["hook_twice"] = "no error"
            except RuntimeError as e:
                res["hook_twice"] = str(e)
            ddp.close()
        model = mlp()
        ddp = DDP(model)

        async def wrong(bucket: comm_hooks.GradBucket) -> ag.Tensor:
            return ag.zeros(1, dtype=ag.float64)

        ddp.register_comm_hook(None, lambda state, bucket: wrong(bucket))
        try:
            await loss_of(ddp, X[3][part], Y[3][part]).backward()
            res["hook_wrong"] = "no error"
        except TypeError as e:
            res["hook_wrong"] = str(e)
        res["hook_wrong_grads_none"] = all(p.grad is None for p in model.parameters())
        ddp.close()

        # ---- unused parameters ----
        model = TwoHeads()
        ddp = DDP(model, find_unused_parameters=True)
        init = {k: np.array(v) for k, v in model.state_dict().items()}  # rank 0's, broadcast
        use_head = rank == 0  # head is used on rank 0 only, spare nowhere
        await loss_of(ddp, X[0][part], Y[0][part], use_head).backward()
        res["unused_spare_none"] = model.spare.weight.grad is None and model.spare.bias.grad is None
        res["unused_head_set"] = model.head.weight.grad is not None
        # one process: rank 0's half through the head, rank 1's half without it, averaged
        halves = []
        for r in range(2):
            m = TwoHeads()
            m.load_state_dict(init)
            await loss_of(m, X[0][r * 4 : r * 4 + 4], Y[0][r * 4 : r * 4 + 4], r == 0).backward()
            halves.append(grads(m))
        want = {}
        for k in halves[0]:
            parts = [h[k] for h in halves if h[k] is not None]
            want[k] = None if not parts else (sum(np.array(x) for x in parts) / 2).tolist()
        res["unused_rel"] = rel(grads(model), want)
        ddp.close()
        ddp = DDP(TwoHeads())
        try:
            await loss_of(ddp, X[0][part], Y[0][part], True).backward()
            res["unused_error"] = "no error"
        except RuntimeError as e:
            res["unused_error"] = str(e)
        res["unused_error_grads_none"] = all(p.grad is None for p in ddp.module.parameters())
        ddp.close()

        # ---- broadcast_buffers: rank 0's running statistics before each synchronized forward ----
        for flag in (True, False):
            ag.manual_seed(rank)  # different initial buffers would be overwritten at construction anyway
            model = nn.Sequential(nn.Linear(6, 4, dtype=ag.float64), nn.BatchNorm1d(4, dtype=ag.float64))
            ddp = DDP(model, broadcast_buffers=flag)
            start = np.array(model[1].running_mean.numpy())  # rank 0's, broadcast at construction
            if rank == 1:
                with ag.no_grad():
                    model[1].running_mean.fill_(100.0)
            x = X[0][part]
            await ddp(ag.from_numpy(x)).sum().backward()
            h = x @ model[0].weight.numpy().T + model[0].bias.numpy()
            base = start if (flag or rank == 0) else np.full(4, 100.0)
            want = 0.9 * base + 0.1 * h.mean(0)
            got = model[1].running_mean.numpy()
            res[f"bn_{flag}_rel"] = float(np.abs(got - want).max() / np.abs(want).max())
            ddp.close()

        # ---- a failed backward leaves grads as they were; the reducer works after it ----
        model = mlp()
        ddp = DDP(model)
        await loss_of(ddp, X[0][part], Y[0][part]).backward()
        before = grads(model)
        fail = [True]

        def boom(p: ag.Tensor) -> None:
            if fail[0]:
                fail[0] = False
                raise ValueError("boom")

        h = model[0].bias.register_post_accumulate_grad_hook(boom)
        try:
            await loss_of(ddp, X[1][part], Y[1][part]).backward()
            res["failed"] = "no error"
        except ValueError as e:
            res["failed"] = str(e)
        res["failed_grads_as_before"] = rel(grads(model), before) == 0.0
        h.remove()
        await loss_of(ddp, X[2][part], Y[2][part]).backward()
        res["after_failure_rel"] = rel(grads(model), await reference([0, 2]))

        # ---- a cancelled backward (while it waits for the peer's buckets) likewise ----
        model.zero_grad()
        await loss_of(ddp, X[0][part], Y[0][part]).backward()
        before = grads(model)
        loss = loss_of(ddp, X[1][part], Y[1][part])
        if rank == 1:
            await trio.sleep(1.0)  # rank 0 waits for this rank's buckets meanwhile, and gets cancelled
            await loss.backward()
        else:
            with trio.move_on_after(0.3) as cs:
                await loss.backward()
            res["cancelled"] = cs.cancelled_caught
            res["cancelled_grads_as_before"] = rel(grads(model), before) == 0.0
        model.zero_grad()
        await loss_of(ddp, X[2][part], Y[2][part]).backward()
        res["after_cancel_rel"] = rel(grads(model), await reference([2]))
        ddp.close()
    dist.destroy_process_group()
    res["threads_left"] = threading.active_count() - threads_before  # comm lanes stop with their group
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    ag.run(main, sys.argv[1])
