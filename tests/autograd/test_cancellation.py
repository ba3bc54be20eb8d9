"""Failure and cancellation are per graph task (issue 3, items 2-3).

A cancelled pass, or one whose backward function or hook raised, ends that pass only: the caller sees the
exception (with the failing node named), other trainings carry on, the runtime stays usable, and every
`.grad` is bit-identical to what it was before the pass began.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import trio
import trio.testing

import asyncgrad as ag

# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------


def _snapshot(*ts):
    """The exact bytes of each tensor's `.grad` (None stays None)."""
    return [None if t.grad is None else (t.grad.numpy().dtype, t.grad.numpy().tobytes()) for t in ts]


def _preset(rng, *ts):
    for t in ts:
        t.grad = ag.tensor(rng.standard_normal(t.shape))


async def _settled(rt) -> None:
    """Wait until every pass task has ended; only the leaf owners are left in the runtime's nursery."""
    await trio.testing.wait_all_tasks_blocked()
    assert rt.graph_tasks_started == rt.graph_tasks_finished
    assert len(rt.nursery.child_tasks) == len(rt.owners)


async def _train_steps(seed: int, steps: int, out: dict, key: str) -> None:
    """An independent training: least squares on its own parameter, checked against numpy."""
    rng = np.random.default_rng(seed)
    X0, y0 = rng.standard_normal((40, 90)), rng.standard_normal(40)
    w0 = rng.standard_normal(90) * 0.1
    X, y = ag.tensor(X0), ag.tensor(y0)
    w = ag.tensor(w0, requires_grad=True)
    for _ in range(steps):
        r = (X @ w) - y
        await (r * r).sum().backward()
        with ag.no_grad():
            w -= 0.001 * w.grad
        w.grad = None
    ref = w0.copy()
    for _ in range(steps):
        ref = ref - 0.001 * (2 * X0.T @ (X0 @ ref - y0))
    out[key] = (w.numpy().copy(), ref)


class Hang(ag.Function):
    """Identity whose async backward announces itself, then waits for an event that never fires."""

    entered: trio.Event
    never: trio.Event

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    async def backward(ctx, g):
        Hang.entered.set()
        await Hang.never.wait()
        raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------------
# cancelling a pass
# ---------------------------------------------------------------------------------------------------


async def test_cancelled_backward_leaves_every_grad_bit_identical_and_others_continue():
    Hang.entered, Hang.never = trio.Event(), trio.Event()
    rng = np.random.default_rng(0)
    others: dict = {}
    async with ag.open_runtime(lanes=2) as rt:
        x = ag.tensor(rng.standard_normal((6, 5)), requires_grad=True)
        w1 = ag.tensor(rng.standard_normal((5, 4)), requires_grad=True)
        w2 = ag.tensor(rng.standard_normal((5, 4)), requires_grad=True)
        w3 = ag.tensor(rng.standard_normal(4), requires_grad=True)  # no .grad yet: must stay None
        _preset(rng, x, w1, w2)
        h = Hang.apply(x @ w2)  # created first: the pass reaches it after w1's branch is staged
        loss = ((x @ w1) * w3).sum() + h.sum()
        before = _snapshot(x, w1, w2, w3)
        cancelled = []

        async def victim(task_status=trio.TASK_STATUS_IGNORED):
            with trio.CancelScope() as cs:
                task_status.started(cs)
                try:
                    await loss.backward()
                except trio.Cancelled:
                    cancelled.append(True)
                    raise
            assert cs.cancelled_caught

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                cs = await n.start(victim)
                await Hang.entered.wait()
                # the hung pass holds its node; two other trainings run to completion meanwhile
                async with trio.open_nursery() as m:
                    m.start_soon(_train_steps, 1, 4, others, "t1")
                    m.start_soon(_train_steps, 2, 4, others, "t2")
                assert not cancelled
                cs.cancel()
            assert cancelled == [True]
            await _settled(rt)
        assert _snapshot(x, w1, w2, w3) == before
        for got, ref in others.values():
            np.testing.assert_allclose(got, ref, rtol=1e-12)
        # the runtime is still usable: a fresh pass over the same parameters adds onto the preset grads
        g_before = [t.grad.numpy().copy() for t in (x, w1, w2)]
        await ((x @ w1) + (x @ w2)).sum().backward()
        ones = np.ones((6, 4))
        gx = ones @ (w1.numpy() + w2.numpy()).T
        np.testing.assert_allclose(x.grad.numpy(), g_before[0] + gx, rtol=1e-13)
        np.testing.assert_allclose(w1.grad.numpy(), g_before[1] + x.numpy().T @ ones, rtol=1e-13)
        np.testing.assert_allclose(w2.grad.numpy(), g_before[2] + x.numpy().T @ ones, rtol=1e-13)
        assert w3.grad is None
        await _settled(rt)


async def test_cancelled_grad_call_returns_nothing_and_changes_nothing():
    Hang.entered, Hang.never = trio.Event(), trio.Event()
    rng = np.random.default_rng(1)
    async with ag.open_runtime(lanes=1) as rt:
        a = ag.tensor(rng.standard_normal(8), requires_grad=True)
        b = ag.tensor(rng.standard_normal(8), requires_grad=True)
        _preset(rng, a, b)
        before = _snapshot(a, b)
        out = Hang.apply(a * b).sum() + (b * b).sum()
        with trio.fail_after(10):
            with trio.move_on_after(0.05) as cs:
                await ag.grad(out, [a, b])
            assert cs.cancelled_caught and Hang.entered.is_set()
            await _settled(rt)
        assert _snapshot(a, b) == before
        (ga,) = await ag.grad((a * b).sum(), [a])
        np.testing.assert_array_equal(ga.numpy(), b.numpy())


# ---------------------------------------------------------------------------------------------------
# reentrant chains: cancelled mid-way, failing deep down
# ---------------------------------------------------------------------------------------------------


class Chain(ag.Function):
    """W4's reentrant chain, instrumented: every level's fresh leaf and the depths reached."""

    leaves: list
    depths: list
    reached: trio.Event
    signal_at = -1
    fail_at = -1
    hang_at = -1
    before_fail: trio.Event | None = None

    @staticmethod
    def forward(ctx, x, d):
        ctx.d = d
        return x * 1.0

    @staticmethod
    async def backward(ctx, g):
        Chain.depths.append(ctx.d)
        if ctx.d == Chain.signal_at:
            Chain.reached.set()
            # let the cancelling task run now: left to trio's scheduling order, under load the chain could
            # descend several more levels before it ran (what is tested is what the cancel then reaches)
            await trio.testing.wait_all_tasks_blocked()
        if ctx.d == Chain.fail_at:
            if Chain.before_fail is not None:
                await Chain.before_fail.wait()
            raise ValueError(f"boom at level {ctx.d}")
        if ctx.d == Chain.hang_at:
            await trio.Event().wait()  # never fires
        if ctx.d > 0:
            with ag.enable_grad():
                leaf = ag.ones(4, dtype="float64", requires_grad=True)
                Chain.leaves.append(leaf)
                await Chain.apply(leaf, ctx.d - 1).sum().backward()
        return g * 2.0, None


def _reset_chain(signal_at=-1, fail_at=-1, hang_at=-1, before_fail=None):
    Chain.leaves, Chain.depths, Chain.reached = [], [], trio.Event()
    Chain.signal_at, Chain.fail_at, Chain.hang_at = signal_at, fail_at, hang_at
    Chain.before_fail = before_fail


async def _cancel_chain_at(depth: int, level: int, rt) -> tuple:
    """Run a Chain of ``depth`` and cancel the caller when the backward at ``level`` starts."""
    _reset_chain(signal_at=level)
    rng = np.random.default_rng(2)
    x = ag.tensor(rng.standard_normal(4), requires_grad=True)
    w = ag.tensor(rng.standard_normal(4), requires_grad=True)
    _preset(rng, x, w)
    before = _snapshot(x, w)
    loss = Chain.apply(x, depth).sum() + (w * w).sum()  # w's branch is staged before the chain node runs
    with trio.fail_after(30):
        with trio.CancelScope() as cs:
            async with trio.open_nursery() as n:

                async def cancel_at_level():
                    await Chain.reached.wait()
                    cs.cancel()

                n.start_soon(cancel_at_level)
                await loss.backward()
                raise AssertionError("the pass completed; it should have been cancelled")
        assert cs.cancelled_caught
        await _settled(rt)
    return x, w, before


async def test_cancelling_a_reentrant_chain_midway():
    async with ag.open_runtime(lanes=2) as rt:
        x, w, before = await _cancel_chain_at(200, 100, rt)
        # the caller saw Cancelled (above); levels 200..100 were entered; nothing of the pass committed
        assert Chain.depths[:101] == list(range(200, 99, -1))
        assert _snapshot(x, w) == before
        # the runtime is still usable, the chain included
        _reset_chain()
        x2 = ag.ones(4, dtype="float64", requires_grad=True)
        with trio.fail_after(30):
            await Chain.apply(x2, 50).sum().backward()
        np.testing.assert_array_equal(x2.grad.numpy(), np.full(4, 2.0))
        assert len(Chain.leaves) == 50
        assert all(np.array_equal(leaf.grad.numpy(), np.full(4, 2.0)) for leaf in Chain.leaves)
        await _settled(rt)


async def test_cancelling_a_reentrant_chain_stops_it_promptly():
    async with ag.open_runtime(lanes=2) as rt:
        await _cancel_chain_at(200, 100, rt)
        deepest = min(Chain.depths)
        committed = sum(leaf.grad is not None for leaf in Chain.leaves)
        # the cancel reaches every nested pass at once, not one level per scheduler batch
        assert deepest >= 95 and committed == 0, (
            f"chain of 200 cancelled at level 100: went on to level {deepest}; "
            f"{committed} nested passes committed after the cancel"
        )


async def test_exception_deep_in_a_reentrant_chain():
    depth, fail_level = 100, 50
    others_done = trio.Event()
    _reset_chain(fail_at=fail_level, before_fail=others_done)
    rng = np.random.default_rng(3)
    others: dict = {}
    async with ag.open_runtime(lanes=2) as rt:
        x = ag.tensor(rng.standard_normal(4), requires_grad=True)
        w = ag.tensor(rng.standard_normal(4), requires_grad=True)
        _preset(rng, x, w)
        before = _snapshot(x, w)
        loss = Chain.apply(x, depth).sum() + (w * 3.0).sum()
        errors = []

        async def chain_training():
            try:
                await loss.backward()
            except ValueError as e:  # the backward's own exception, not wrapped
                errors.append(e)

        async def other_trainings():
            async with trio.open_nursery() as m:
                m.start_soon(_train_steps, 4, 3, others, "t4")
                m.start_soon(_train_steps, 5, 3, others, "t5")
            others_done.set()

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                n.start_soon(chain_training)
                n.start_soon(other_trainings)
            await _settled(rt)
        assert len(errors) == 1, "the caller must see the error"
        assert type(errors[0]) is ValueError and str(errors[0]) == f"boom at level {fail_level}"
        # one note per node on the way out: the failing level and every level above it
        assert errors[0].__notes__ == ["raised in the backward of ChainBackward"] * (depth - fail_level + 1)
        assert Chain.depths == list(range(depth, fail_level - 1, -1))
        assert _snapshot(x, w) == before
        assert all(leaf.grad is None for leaf in Chain.leaves)
        for got, ref in others.values():
            np.testing.assert_allclose(got, ref, rtol=1e-12)
        await (w * 3.0).sum().backward()
        np.testing.assert_array_equal(w.grad.numpy(), np.frombuffer(before[1][1]) + 3.0)


# ---------------------------------------------------------------------------------------------------
# exceptions in hooks
# ---------------------------------------------------------------------------------------------------


async def _two_owner_leaves(rng, shape=(5,)):
    """Two leaves owned by different leaf owners (each first committed from its own task)."""
    a = ag.tensor(rng.standard_normal(shape), requires_grad=True)
    b = ag.tensor(rng.standard_normal(shape), requires_grad=True)
    hold = trio.Event()

    async def first_commit(t):
        await (t * 0.0).sum().backward()
        await hold.wait()  # keep this task (and its stream) alive until both have committed

    async with trio.open_nursery() as n:
        n.start_soon(first_commit, a)
        n.start_soon(first_commit, b)
        await trio.testing.wait_all_tasks_blocked()
        hold.set()
    assert a.__dict__["_owner"] is not b.__dict__["_owner"]
    return a, b


def _boom(*_):
    raise ValueError("hook says no")


@pytest.mark.parametrize("where", ["leaf tensor hook", "non-leaf tensor hook", "node pre-hook", "node hook"])
async def test_exception_in_a_hook_ends_the_pass_with_grads_unchanged(where):
    rng = np.random.default_rng(4)
    async with ag.open_runtime(lanes=1) as rt:
        a, b = await _two_owner_leaves(rng)
        c = ag.tensor(rng.standard_normal(5), requires_grad=True)  # never committed: no owner yet
        _preset(rng, a, b, c)
        before = _snapshot(a, b, c)
        ab = a * b
        out = (ab * c).sum() + (a * 2.0).sum()
        if where == "leaf tensor hook":
            b.register_hook(_boom)
            expect = "raised in a hook on a leaf tensor of shape (5,)"
        elif where == "non-leaf tensor hook":
            ab.register_hook(_boom)
            expect = "raised in a hook on MulBackward0"
        elif where == "node pre-hook":
            ab.grad_fn.register_prehook(_boom)
            expect = "raised in a hook on MulBackward0"
        else:
            ab.grad_fn.register_hook(_boom)
            expect = "raised in a hook on MulBackward0"
        with trio.fail_after(10), pytest.raises(ValueError) as info:
            await out.backward()
        assert str(info.value) == "hook says no" and info.value.__notes__ == [expect], info.value.__notes__
        await _settled(rt)
        assert _snapshot(a, b, c) == before
        # the same tensors, a pass without the failing hook: the runtime and the owners still work
        await (a * 2.0 + c).sum().backward()
        np.testing.assert_array_equal(a.grad.numpy(), np.frombuffer(before[0][1]) + 2.0)
        np.testing.assert_array_equal(c.grad.numpy(), np.frombuffer(before[2][1]) + 1.0)


@pytest.mark.parametrize("failing", ["a", "b", "both"])
async def test_post_accumulate_hook_error_does_not_half_commit_a_pass(failing):
    rng = np.random.default_rng(5)
    async with ag.open_runtime(lanes=1) as rt:
        a, b = await _two_owner_leaves(rng)
        _preset(rng, a, b)
        before = _snapshot(a, b)
        ran = []
        for t, name in ((a, "a"), (b, "b")):
            if failing in (name, "both"):
                t.register_post_accumulate_grad_hook(_boom)
            else:
                t.register_post_accumulate_grad_hook(lambda p, name=name: ran.append(name))
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(10), pytest.raises(ValueError, match="hook says no") as info:
            await (a * 2.0 + b * 3.0).sum().backward()
        assert len(info.value.__notes__) == 1 and "post-accumulate-grad hook" in info.value.__notes__[0]
        await _settled(rt)
        # none of the pass, in both owners, whichever of them committed (and ran its hooks) first
        assert _snapshot(a, b) == before
        # the owners still work
        if failing != "both":
            ran.clear()
            ok = b if failing == "a" else a
            with trio.fail_after(10):
                await (a * 2.0 + b * 3.0).sum().backward(inputs=[ok])
            assert ran == [{"a": "b", "b": "a"}[failing]]


async def test_a_rolled_back_commit_keeps_what_other_passes_committed_meanwhile():
    """A pass whose leaves have two owners commits to both with no await in between, so the undo of a
    failing post-accumulate hook never drops what a concurrent pass committed into the same leaf."""
    from asyncgrad.autograd._leaf_owner import _SYNC

    async with ag.open_runtime(lanes=1) as rt:
        a, b = await _two_owner_leaves(np.random.default_rng(7))
        a.grad, b.grad = ag.zeros(5, dtype="float64"), ag.zeros(5, dtype="float64")
        owner_a, owner_b = a.__dict__["_owner"], b.__dict__["_owner"]
        # leaf tensor hooks run in the prepare phase: each leaves the other leaf's owner with a queued
        # message, so the failing pass finds an owner busy when it is about to commit
        a.register_hook(lambda g: owner_b.send_nowait(_SYNC))
        b.register_hook(lambda g: owner_a.send_nowait(_SYNC))
        b.register_post_accumulate_grad_hook(_boom)
        failures = []

        async def other_training():
            for _ in range(40):
                await (a * 1.0).sum().backward()  # a alone: owner a's commits
                await trio.lowlevel.checkpoint()

        async def failing_training():
            for _ in range(20):
                try:
                    # the engine runs the latest node first: a is staged, so committed, before b
                    await (b * 3.0 + a * 2.0).sum().backward()
                except ValueError:
                    failures.append(1)
                await trio.lowlevel.checkpoint()

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                n.start_soon(other_training)
                n.start_soon(failing_training)
            await _settled(rt)
        assert len(failures) == 20
        np.testing.assert_array_equal(a.grad.numpy(), np.full(5, 40.0))
        np.testing.assert_array_equal(b.grad.numpy(), np.zeros(5))


async def test_a_pass_cancelled_while_its_commit_waits_for_the_owner_is_all_or_nothing():
    rng = np.random.default_rng(6)
    async with ag.open_runtime(lanes=1) as rt:
        w = ag.tensor(rng.standard_normal(3), requires_grad=True)
        _preset(rng, w)
        g0 = w.grad.numpy().copy()
        outcome = {}

        async def training():
            # a fresh task: a fresh stream, so its first commit goes to a new owner, not started yet;
            # the pass waits for the owner's reply, and the leaf hook fires the cancel at that moment
            # (as a deadline expiring right then would)
            with trio.CancelScope() as cs:
                w.register_hook(lambda g: cs.cancel())
                await (w * 5.0).sum().backward()
                outcome["returned"] = True
            outcome["cancelled"] = cs.cancelled_caught

        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                n.start_soon(training)
            await _settled(rt)
        returned = outcome.get("returned", False)
        changed = not np.array_equal(w.grad.numpy(), g0)
        assert returned != outcome["cancelled"] or returned
        assert changed == returned, (
            f"backward returned normally: {returned}, raised Cancelled: {outcome['cancelled']}; "
            f".grad changed: {changed}"
        )


# ---------------------------------------------------------------------------------------------------
# cancelling the whole runtime mid-training
# ---------------------------------------------------------------------------------------------------


def _asyncgrad_threads():
    return {t for t in threading.enumerate() if t.name.startswith("asyncgrad-")}


async def test_cancelling_the_runtime_scope_mid_training_joins_every_thread():
    before_threads = _asyncgrad_threads()
    Hang.entered, Hang.never = trio.Event(), trio.Event()
    _reset_chain(signal_at=0, hang_at=0)
    progress = {"big": 0}

    async def big_training():
        rng = np.random.default_rng(7)
        W = ag.tensor(rng.standard_normal((256, 256)) * 0.05, requires_grad=True)
        X = ag.tensor(rng.standard_normal((128, 256)))
        while True:
            await (ag.tanh(X @ W) @ W).sum().backward()
            with ag.no_grad():
                W -= 1e-4 * W.grad
            W.grad = None
            progress["big"] += 1

    async def hung_chain():
        # a reentrant chain 30 levels deep whose innermost backward never returns
        x = ag.ones(4, requires_grad=True)
        await Chain.apply(x, 30).sum().backward()

    async def hung_pass():
        x = ag.ones(4, requires_grad=True)
        await Hang.apply(x * 2.0).sum().backward()

    with trio.fail_after(30):
        with trio.CancelScope() as scope:
            async with ag.open_runtime(lanes=2) as rt:
                threads = rt.threads()
                assert len(threads) == 2 and all(t.is_alive() for t in threads)
                async with trio.open_nursery() as n:
                    n.start_soon(big_training)
                    n.start_soon(big_training)
                    n.start_soon(hung_chain)
                    n.start_soon(hung_pass)
                    await Chain.reached.wait()
                    await Hang.entered.wait()
                    while progress["big"] < 4:
                        await trio.sleep(0.01)
                    t0 = time.perf_counter()
                    scope.cancel()
        took = time.perf_counter() - t0
    assert scope.cancelled_caught
    print(f"runtime cancelled with a 30-level chain and 2 trainings in flight: exit took {took * 1e3:.1f} ms")
    assert took < 2.0, f"shutdown took {took:.2f}s"
    assert not any(t.is_alive() for t in threads)
    assert _asyncgrad_threads() == before_threads
    # and a new runtime works
    async with ag.open_runtime(lanes=1):
        x = ag.tensor([3.0], dtype="float64", requires_grad=True)
        await (x * x).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), [6.0])
