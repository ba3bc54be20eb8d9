"""Reentrant backward: an ``async def`` backward that awaits another backward pass (issue 3, items 1-2).

The W4 chain (a Function whose backward runs the same Function one level shallower) must reach depth
100,000 with the default recursion limit, no OS thread beyond the runtime's fixed set, and memory that
grows linearly. Depth runs are in fresh child processes so their thread count and peak RSS are their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import ClassVar

import numpy as np
import pytest
import trio
import trio.testing

import asyncgrad as ag
from asyncgrad.devices import INLINE_MAX_ELEMENTS

# ---------------------------------------------------------------------------------------------------
# W4 at depth 100,000 (child processes)
# ---------------------------------------------------------------------------------------------------

W4_CHILD = textwrap.dedent(
    """
    import json, os, sys, threading, time

    import numpy as np
    import trio

    import asyncgrad as ag

    depth = int(sys.argv[1])


    def os_threads():
        return len(os.listdir("/proc/self/task"))


    def rss_now_kb():
        # the current resident set: ru_maxrss / VmHWM can carry the parent's (pytest's) peak across exec
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0


    rec = {"depth": depth, "limit_before": sys.getrecursionlimit(), "samples": []}


    class Reent(ag.Function):
        @staticmethod
        def forward(ctx, x, d):
            ctx.d = d
            return x * 1.0

        @staticmethod
        async def backward(ctx, g):
            if ctx.d % 1000 == 0:
                # sample at every 1000th level, the deepest (d == 0) included
                rec["samples"].append((ctx.d, os_threads(), sys.getrecursionlimit(), rss_now_kb()))
            if ctx.d == 0:
                rec["rss_peak_kb"] = rss_now_kb()  # every level is alive here: the memory high point
            if ctx.d > 0:
                with ag.enable_grad():
                    leaf = ag.ones(4, requires_grad=True)
                    await Reent.apply(leaf, ctx.d - 1).sum().backward()
            return g * 2.0, None


    async def main():
        rec["threads_before_runtime"] = os_threads()
        async with ag.open_runtime() as rt:
            rec["runtime_threads"] = len(rt.threads())
            rec["runtime_thread_names"] = sorted(t.name for t in rt.threads())
            rec["threads_in_runtime"] = os_threads()
            x = ag.ones(4, dtype="float64", requires_grad=True)
            rec["rss_base_kb"] = rss_now_kb()
            t0 = time.perf_counter()
            await Reent.apply(x, depth).sum().backward()
            rec["seconds"] = time.perf_counter() - t0
            rec["grad"] = x.grad.numpy().tolist()
            rec["threads_after_pass"] = os_threads()
            st = rt.statistics()
            rec["graph_tasks"] = [st.graph_tasks_started, st.graph_tasks_finished]
        # the lanes are joined; their OS threads may still be finishing their exit for a moment
        deadline = time.monotonic() + 2.0
        while os_threads() > 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        rec["threads_after_runtime"] = os_threads()
        rec["py_threads_after_runtime"] = [t.name for t in threading.enumerate()]


    trio.run(main)
    rec["limit_after"] = sys.getrecursionlimit()
    print(json.dumps(rec))
    """
)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # BLAS libraries start their own thread pool when numpy is imported; that pool is not the runtime's
    # and is fixed in size, so pin it to the main thread to make "main + lanes" the whole process
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[k] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_w4_reentrant_chain_depth_100k_threads_recursion_and_memory():
    """Depth 100,000 in a child process of its own: values, threads, recursion, and RSS sampled every 1000
    levels (20,000 levels alive against 100,000: linear)."""
    env = _child_env()
    procs = {
        d: subprocess.Popen(
            [sys.executable, "-c", W4_CHILD, str(d)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for d in (100_000,)
    }
    recs = {}
    try:
        for d, p in procs.items():
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, f"depth {d}: child failed (rc={p.returncode}):\n{err[-3000:]}"
            recs[d] = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    figures = {
        d: dict(
            seconds=round(r["seconds"], 2),
            us_per_level=round(r["seconds"] / d * 1e6, 1),
            threads=(
                r["threads_before_runtime"],
                r["threads_in_runtime"],
                max(s[1] for s in r["samples"]),
                r["threads_after_pass"],
            ),
            rss_base_mb=round(r["rss_base_kb"] / 1024, 1),
            rss_peak_mb=round(r["rss_peak_kb"] / 1024, 1),
        )
        for d, r in recs.items()
    }
    print(f"W4 figures: {figures}")
    for d, r in recs.items():
        # the gradient of the outermost leaf: the outer backward returns g * 2 with g = 1
        np.testing.assert_array_equal(np.array(r["grad"]), np.full(4, 2.0))
        assert r["graph_tasks"] == [d + 1, d + 1], r["graph_tasks"]
        # the recursion limit was never raised (before, at every sampled level, after)
        assert r["limit_after"] == r["limit_before"]
        assert {s[2] for s in r["samples"]} == {r["limit_before"]}
        # every 1000th level was sampled, the deepest included
        assert len(r["samples"]) == d // 1000 + 1 and r["samples"][-1][0] == 0
        # no thread beyond the runtime's fixed set: main + lanes, at every sampled depth
        fixed = r["runtime_threads"] + 1
        names = r["runtime_thread_names"]
        assert names and all(n.startswith("asyncgrad-") for n in names)
        assert r["threads_before_runtime"] == 1, r
        assert r["threads_in_runtime"] == fixed, r
        assert {s[1] for s in r["samples"]} == {fixed}, f"depth {d}: threads per sampled level {r['samples']}"
        assert r["threads_after_pass"] == fixed
        assert r["py_threads_after_runtime"] == ["MainThread"]
        assert r["threads_after_runtime"] == 1
    r = recs[100_000]
    # the samples go from the outermost level (d = 100,000, one level alive) to the deepest (d = 0, all of
    # them): at d = 80,000, 20,000 levels are alive
    rss_at = {s[0]: s[3] for s in r["samples"]}
    g20 = (rss_at[80_000] - r["rss_base_kb"]) / 1024
    g100 = (r["rss_peak_kb"] - r["rss_base_kb"]) / 1024
    peak100 = r["rss_peak_kb"] / 1024
    msg = f"RSS growth: 20k levels alive {g20:.1f} MB, 100k {g100:.1f} MB, peak at 100k {peak100:.1f} MB"
    # linear: 5x the depth costs about 5x the memory (6x plus slack allows for allocator noise)
    assert g100 <= 6 * g20 + 64, msg
    assert g100 >= 3 * g20 - 64, msg  # and it is really per level, not a one-off
    assert peak100 < 1536, msg


# ---------------------------------------------------------------------------------------------------
# a plain (non-async) backward must not start a pass
# ---------------------------------------------------------------------------------------------------


def _plain_msg(what: str, node: str) -> str:
    return (
        f"{what} was called from inside the plain (non-async) backward of {node}; a backward that runs "
        "another backward pass must be `async def backward(ctx, ...)` and `await` it"
    )


class PlainGrad(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        with ag.enable_grad():
            leaf = ag.ones(3, requires_grad=True)
            ag.grad((leaf * 2.0).sum(), [leaf])  # not awaitable here: must raise at once
        return g


class PlainModuleBackward(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        with ag.enable_grad():
            leaf = ag.ones(3, requires_grad=True)
            ag.backward([(leaf * 2.0).sum()])
        return g


class PlainTensorBackward(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        with ag.enable_grad():
            leaf = ag.ones(3, requires_grad=True)
            pending = (leaf * 2.0).sum().backward()
            # a plain function cannot await it: the call itself must raise (else the pass is lost)
            getattr(pending, "close", lambda: None)()
        return g


@pytest.mark.parametrize(
    ("fn", "what"), [(PlainGrad, "grad()"), (PlainModuleBackward, "backward()")], ids=["grad", "ag.backward"]
)
async def test_plain_backward_starting_a_pass_gets_a_clear_error(fn, what):
    async with ag.open_runtime() as rt:
        x = ag.ones(3, dtype="float64", requires_grad=True)
        x.grad = ag.full((3,), 7.0, dtype="float64")
        with trio.fail_after(10), pytest.raises(RuntimeError) as info:
            await fn.apply(x).sum().backward()
        assert type(info.value) is RuntimeError
        assert str(info.value) == _plain_msg(what, f"{fn.__name__}Backward")
        assert info.value.__notes__ == [f"raised in the backward of {fn.__name__}Backward"]
        np.testing.assert_array_equal(x.grad.numpy(), np.full(3, 7.0))
        # the runtime is still usable
        await (x * 3.0).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), np.full(3, 10.0))
        assert rt.graph_tasks_started == rt.graph_tasks_finished


async def test_plain_backward_calling_tensor_backward_gets_a_clear_error():
    async with ag.open_runtime():
        x = ag.ones(3, dtype="float64", requires_grad=True)
        with trio.fail_after(10), pytest.raises(RuntimeError) as info:
            await PlainTensorBackward.apply(x).sum().backward()
        assert str(info.value) == _plain_msg("backward()", "PlainTensorBackwardBackward")
        assert info.value.__notes__ == ["raised in the backward of PlainTensorBackwardBackward"]
        assert x.grad is None


# ---------------------------------------------------------------------------------------------------
# an exception raised in a nested pass reaches the outer caller as itself
# ---------------------------------------------------------------------------------------------------


class InnerFails(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        raise KeyError("inner")


class OuterAwaitsInner(ag.Function):
    """Its backward awaits a nested pass through InnerFails: on this task's trampoline, or in a task of
    its own (started from a nursery inside the backward), or catching the inner error itself."""

    how = "trampoline"
    caught: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    async def backward(ctx, g):
        with ag.enable_grad():
            leaf = ag.ones(3, dtype="float64", requires_grad=True)
            inner = InnerFails.apply(leaf).sum()
        if OuterAwaitsInner.how == "own task":
            errors = []
            async with trio.open_nursery() as n:
                n.start_soon(_backward_of, inner, errors)
            raise errors[0]  # as it came out of the pass (a nursery would group it)
        elif OuterAwaitsInner.how == "caught":
            try:
                await inner.backward()
            except KeyError as e:
                OuterAwaitsInner.caught.append(e)
            assert leaf.grad is None
        else:
            await inner.backward()
        return g * 2.0


async def _backward_of(t, errors):
    try:
        await t.backward()  # from another task while a pass runs: the pass runs in a task of its own
    except KeyError as e:
        errors.append(e)


@pytest.mark.parametrize("how", ["trampoline", "own task"])
async def test_exception_in_a_nested_pass_reaches_the_caller_as_itself(how):
    OuterAwaitsInner.how = how
    async with ag.open_runtime() as rt:
        x = ag.ones(3, dtype="float64", requires_grad=True)
        x.grad = ag.full((3,), 7.0, dtype="float64")
        with trio.fail_after(10), pytest.raises(KeyError) as info:
            await OuterAwaitsInner.apply(x).sum().backward()
        e = info.value
        assert type(e) is KeyError and e.args == ("inner",)
        # named on its way out: the node that raised, then the node whose backward awaited the inner pass
        assert e.__notes__ == [
            "raised in the backward of InnerFailsBackward",
            "raised in the backward of OuterAwaitsInnerBackward",
        ]
        np.testing.assert_array_equal(x.grad.numpy(), np.full(3, 7.0))
        await trio.testing.wait_all_tasks_blocked()
        assert rt.graph_tasks_started == rt.graph_tasks_finished


async def test_an_outer_backward_may_catch_a_nested_pass_error_by_its_type():
    OuterAwaitsInner.how, OuterAwaitsInner.caught = "caught", []
    async with ag.open_runtime():
        x = ag.ones(3, dtype="float64", requires_grad=True)
        with trio.fail_after(10):
            await OuterAwaitsInner.apply(x).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), np.full(3, 2.0))
        (e,) = OuterAwaitsInner.caught
        assert type(e) is KeyError and e.__notes__ == ["raised in the backward of InnerFailsBackward"]


# ---------------------------------------------------------------------------------------------------
# a reentrant backward that needs the very device it released
# ---------------------------------------------------------------------------------------------------

N = 96  # N * N > INLINE_MAX_ELEMENTS: every kernel below queues on the single lane


class InnerMatmul(ag.Function):
    """Backward: d/dx sum((x @ W) * x * c) through a nested pass on big tensors, on the same device."""

    inner_grads: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x, W, c):
        ctx.save_for_backward(x)
        ctx.W, ctx.c = W, c
        return x * 1.0

    @staticmethod
    async def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with ag.enable_grad():
            xi = x.detach().requires_grad_()
            inner = ((xi @ ctx.W) * xi * ctx.c).sum()
        (gx,) = await ag.grad(inner, [xi])
        InnerMatmul.inner_grads.append(gx.numpy().copy())
        return g * gx, None, None


async def test_reentrant_backward_needs_the_device_it_released():
    assert N * N > INLINE_MAX_ELEMENTS
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal((N, N))
    W0 = rng.standard_normal((N, N)) * 0.1
    A0 = rng.standard_normal((N, N)) * 0.1
    c = 0.5
    InnerMatmul.inner_grads = []
    async with ag.open_runtime(lanes=1) as rt:
        assert len(rt.threads()) == 1
        x = ag.tensor(x0, requires_grad=True)
        A = ag.tensor(A0, requires_grad=True)
        W = ag.tensor(W0)
        h = x @ A  # queued on the lane before the reentrant node
        y = InnerMatmul.apply(h, W, c)
        loss = ((y @ A) * 0.25).sum()  # and after it
        with trio.fail_after(30):
            await loss.backward()
            await x.grad.ready()
            await A.grad.ready()
        gx, gA = x.grad.numpy(), A.grad.numpy()
        assert rt.graph_tasks_started == rt.graph_tasks_finished == 2
        # the kernels really went to the lane (not inline on the loop thread)
        assert sum(s.submitted for s in rt.cpu.pool.all_streams()) >= 6
    # by hand: h = x A; y = h (values); loss = 0.25 * sum(y A)
    h0 = x0 @ A0
    gy = 0.25 * np.ones((N, N)) @ A0.T
    # inner = c * sum((h W) * h): d/dh_ab = c * ((h W)_ab + sum_j h_aj W_bj) = c * (h W + h W^T)_ab
    g_inner = c * (h0 @ W0 + h0 @ W0.T)
    np.testing.assert_allclose(InnerMatmul.inner_grads[0], g_inner, rtol=1e-12, atol=1e-12)
    gh = gy * g_inner
    np.testing.assert_allclose(gx, gh @ A0.T, rtol=1e-10, atol=1e-10)
    gA_expected = x0.T @ gh + h0.T @ (0.25 * np.ones((N, N)))
    np.testing.assert_allclose(gA, gA_expected, rtol=1e-10, atol=1e-10)


class CpuChain(ag.Function):
    """An async backward whose nested pass is itself reentrant (two levels), all on one lane."""

    @staticmethod
    def forward(ctx, x, depth):
        ctx.save_for_backward(x)
        ctx.depth = depth
        return x * 1.0

    @staticmethod
    async def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if ctx.depth == 0:
            return g * 3.0, None
        with ag.enable_grad():
            xi = x.detach().requires_grad_()
            inner = (CpuChain.apply(xi @ xi.T * 0.0 + xi, ctx.depth - 1) * 1.0).sum()
        (gx,) = await ag.grad(inner, [xi])
        return g * gx, None


async def test_nested_reentrant_passes_share_one_lane():
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((N, N))
    async with ag.open_runtime(lanes=1):
        x = ag.tensor(x0, requires_grad=True)
        with trio.fail_after(30):
            await (CpuChain.apply(x * 2.0, 3) * 1.0).sum().backward()
            await x.grad.ready()
        # each level returns g * (gradient of its inner chain) = 3 at the bottom, so 2 * 3
        np.testing.assert_array_equal(x.grad.numpy(), np.full((N, N), 6.0))


# ---------------------------------------------------------------------------------------------------
# a backward awaiting an external event while another training finishes its own pass
# ---------------------------------------------------------------------------------------------------


class WaitFor(ag.Function):
    entered: trio.Event
    release: trio.Event
    log: list

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    async def backward(ctx, g):
        WaitFor.log.append("A: backward entered")
        WaitFor.entered.set()
        await WaitFor.release.wait()
        WaitFor.log.append("A: backward released")
        return g * 3.0


async def test_backward_awaiting_an_external_event_lets_another_training_finish():
    WaitFor.entered, WaitFor.release, WaitFor.log = trio.Event(), trio.Event(), []
    log = WaitFor.log
    rng = np.random.default_rng(11)
    a0, b0 = rng.standard_normal(5), rng.standard_normal((64, 80))
    results = {}
    async with ag.open_runtime(lanes=1) as rt:

        async def training_a():
            a = ag.tensor(a0, requires_grad=True)
            loss = (WaitFor.apply(a * a) * 2.0).sum()
            await loss.backward()
            log.append("A: backward done")
            results["a"] = a.grad.numpy().copy()

        async def training_b():
            await WaitFor.entered.wait()
            b = ag.tensor(b0, requires_grad=True)
            for step in range(3):  # big enough for the lane: the device A released is really used
                loss = ((b @ b.T) * b.sum(dim=1, keepdim=True)).sum()
                await loss.backward()
                await b.grad.ready()
                log.append(f"B: step {step} done")
            results["b"] = b.grad.numpy().copy()
            assert not WaitFor.release.is_set()
            WaitFor.release.set()

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                n.start_soon(training_a)
                n.start_soon(training_b)
        assert rt.graph_tasks_started == rt.graph_tasks_finished == 4
    assert log == [
        "A: backward entered",
        "B: step 0 done",
        "B: step 1 done",
        "B: step 2 done",
        "A: backward released",
        "A: backward done",
    ]
    np.testing.assert_allclose(results["a"], 2.0 * 3.0 * 2 * a0, rtol=1e-14)
    # loss = sum_ij (b b^T)_ij s_i with s = b.sum(1): three passes accumulate 3 * the gradient
    s = b0.sum(axis=1)
    M = b0 @ b0.T
    G = s[:, None] * np.ones((64, 64))  # dloss/dM
    g = G @ b0 + G.T @ b0 + M.sum(axis=1)[:, None]  # through M = b b^T, and through s
    np.testing.assert_allclose(results["b"], 3 * g, rtol=1e-10)


# ---------------------------------------------------------------------------------------------------
# a nested pass runs in its caller's task and context: it puts back what it set
# ---------------------------------------------------------------------------------------------------


class ModeProbe(ag.Function):
    """Each level records its grad mode around the nested pass; the innermost turns grad mode off plainly."""

    seen: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x, d):
        ctx.d = d
        return x * 1.0

    @staticmethod
    async def backward(ctx, g):
        if ctx.d == 0:
            ag.set_grad_enabled(False)  # the plain form: changes the mode of the running task at once
            return g * 2.0, None
        with ag.enable_grad():
            leaf = ag.ones(4, requires_grad=True)
            pending = ModeProbe.apply(leaf, ctx.d - 1).sum().backward()
            before = ag.is_grad_enabled()
            await pending
            ModeProbe.seen.append((ctx.d, before, ag.is_grad_enabled()))
            assert leaf.grad is not None
        return g * 2.0, None


async def test_nested_passes_put_back_grad_mode_and_count_every_pass():
    ModeProbe.seen = []
    async with ag.open_runtime() as rt:
        x = ag.ones(4, requires_grad=True)
        await ModeProbe.apply(x, 50).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), np.full(4, 2.0))
        assert ag.is_grad_enabled()
        assert rt.graph_tasks_started == rt.graph_tasks_finished == 51
    # every level awaited its nested pass with grad mode on, and found it on again afterwards
    assert ModeProbe.seen == [(d, True, True) for d in range(1, 51)]
