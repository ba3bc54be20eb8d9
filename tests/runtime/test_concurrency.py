"""Concurrent backward passes (issue 3, item 2): the no-reentrant-apply invariant, no lost updates into
shared leaves, one leaf owner per independent training, trainings in several OS threads, per-task grad mode.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import pytest
import trio
import trio.testing

import asyncgrad as ag


@pytest.fixture
async def rt():
    async with ag.open_runtime(lanes=2) as r:
        yield r


# ---------------------------------------------------------------------------------------------------
# two passes over one retained graph with an async-backward node: never inside it twice at once
# ---------------------------------------------------------------------------------------------------


class Probe(ag.Function):
    """y = x * k; its async backward records how many passes are inside it at once."""

    inside = 0
    max_inside = 0
    entries = 0
    started_at_exit: ClassVar[list] = []
    started: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * k

    @staticmethod
    async def backward(ctx, g):
        Probe.inside += 1
        Probe.entries += 1
        Probe.max_inside = max(Probe.max_inside, Probe.inside)
        try:
            # let every other task run until it blocks: a second pass gets as far as it can
            await trio.testing.wait_all_tasks_blocked()
            Probe.started_at_exit.append(len(Probe.started))
            return g * ctx.k, None
        finally:
            Probe.inside -= 1


def _reset_probe() -> None:
    Probe.inside = Probe.max_inside = Probe.entries = 0
    Probe.started_at_exit, Probe.started = [], []


async def test_concurrent_passes_over_a_retained_graph_never_reenter_a_node(rt):
    _reset_probe()
    rng = np.random.default_rng(0)
    x0, w0 = rng.standard_normal((4, 5)), rng.standard_normal((5, 3))
    x = ag.tensor(x0, requires_grad=True)
    w = ag.tensor(w0, requires_grad=True)
    y = ag.tanh(Probe.apply(x @ w, 1.5))
    loss = (y * y).sum()

    async def one_pass():
        Probe.started.append(1)
        await loss.backward(retain_graph=True)

    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            n.start_soon(one_pass)
            n.start_soon(one_pass)
    assert Probe.entries == 2
    assert Probe.max_inside == 1, "two passes were inside one node's backward at once"
    # the first pass left the node only after the second had started (the passes really overlapped)
    assert Probe.started_at_exit[0] == 2
    assert rt.graph_tasks_started == rt.graph_tasks_finished == 2
    # by hand, once, then doubled
    z = x0 @ w0
    t = np.tanh(1.5 * z)
    gz = 2 * t * (1 - t * t) * 1.5
    np.testing.assert_allclose(x.grad.numpy(), 2 * (gz @ w0.T), rtol=1e-13)
    np.testing.assert_allclose(w.grad.numpy(), 2 * (x0.T @ gz), rtol=1e-13)
    # and the graph is still there for a third pass
    await loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), 3 * (gz @ w0.T), rtol=1e-13)


async def test_many_passes_over_a_retained_graph_with_big_kernels(rt):
    """Eight passes over one retained graph whose kernels run on the lanes: grads are 8x one pass."""
    rng = np.random.default_rng(1)
    a0, b0 = rng.standard_normal((128, 96)), rng.standard_normal((96, 64))
    a = ag.tensor(a0, requires_grad=True)
    b = ag.tensor(b0, requires_grad=True)
    loss = ag.relu(a @ b).sum()
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(lambda: loss.backward(retain_graph=True))
        await a.grad.ready()
        await b.grad.ready()
    mask = (a0 @ b0 > 0).astype(np.float64)
    np.testing.assert_allclose(a.grad.numpy(), 8 * (mask @ b0.T), rtol=1e-12)
    np.testing.assert_allclose(b.grad.numpy(), 8 * (a0.T @ mask), rtol=1e-12)


# ---------------------------------------------------------------------------------------------------
# many tasks into one shared leaf: no lost update
# ---------------------------------------------------------------------------------------------------


class Gate(ag.Function):
    """Identity whose backward waits until every pass is inside its own Gate (all in flight at once)."""

    arrived = 0
    expected = 0
    go: trio.Event

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    async def backward(ctx, g):
        Gate.arrived += 1
        if Gate.arrived == Gate.expected:
            Gate.go.set()
        await Gate.go.wait()
        return g


@pytest.mark.parametrize("size", [(7,), (80, 80)], ids=["inline", "lanes"])
async def test_32_tasks_accumulate_into_one_shared_leaf_without_lost_updates(rt, size):
    P = 32
    Gate.arrived, Gate.expected, Gate.go = 0, P, trio.Event()
    rng = np.random.default_rng(2)
    # integer-valued float64 contributions: the exact sum does not depend on the order of additions
    cs = [rng.integers(-50, 50, size=size).astype(np.float64) for _ in range(P)]
    w = ag.zeros(size, dtype="float64", requires_grad=True)
    other = [ag.zeros(size, dtype="float64", requires_grad=True) for _ in range(P)]

    async def task(i):
        loss = (Gate.apply(w * ag.tensor(cs[i])) + other[i] * 2.0).sum()
        await loss.backward()

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for i in range(P):
                n.start_soon(task, i)
        await w.grad.ready()
    assert Gate.arrived == P
    np.testing.assert_array_equal(w.grad.numpy(), np.sum(cs, axis=0))
    for o in other:
        np.testing.assert_array_equal(o.grad.numpy(), np.full(size, 2.0))
    assert rt.graph_tasks_started == rt.graph_tasks_finished == P


async def test_shared_leaf_hit_by_concurrent_passes_over_retained_graphs(rt):
    """Two retained graphs sharing a leaf; each backpropagated twice, all four passes concurrent."""
    rng = np.random.default_rng(3)
    w0, x0 = rng.standard_normal((64, 64)), rng.standard_normal((64, 64))
    w = ag.tensor(w0, requires_grad=True)
    x = ag.tensor(x0, requires_grad=True)
    g1 = ((w @ x) * (w @ x)).sum()  # d/dw = 2 (w x) x^T
    g2 = (ag.exp(w * 0.1) * x).sum()  # d/dw = 0.1 exp(0.1 w) * x
    # the gate opens once two passes are inside: necessarily one in each Gate node, since a node is
    # entered by one pass at a time (waiting for four would deadlock, by that very invariant)
    Gate.arrived, Gate.expected, Gate.go = 0, 2, trio.Event()
    g1 = Gate.apply(g1)
    g2 = Gate.apply(g2)

    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            for loss in (g1, g2, g1, g2):
                n.start_soon(lambda loss=loss: loss.backward(retain_graph=True))
        await w.grad.ready()
        await x.grad.ready()
    assert Gate.arrived == 4
    d1 = 2 * (w0 @ x0) @ x0.T
    d2 = 0.1 * np.exp(0.1 * w0) * x0
    np.testing.assert_allclose(w.grad.numpy(), 2 * (d1 + d2), rtol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), 2 * (2 * w0.T @ (w0 @ x0) + np.exp(0.1 * w0)), rtol=1e-12)


# ---------------------------------------------------------------------------------------------------
# independent trainings: one owner each
# ---------------------------------------------------------------------------------------------------


def _reference_sgd(seed: int, steps: int, lr: float) -> tuple[np.ndarray, np.ndarray]:
    """The training below, in numpy: 2-layer tanh regression, mean squared error, plain SGD."""
    rng = np.random.default_rng(seed)
    X, Y = rng.standard_normal((32, 6)), rng.standard_normal((32, 2))
    W1, W2 = rng.standard_normal((6, 8)) * 0.3, rng.standard_normal((8, 2)) * 0.3
    for _ in range(steps):
        H = np.tanh(X @ W1)
        E = H @ W2 - Y
        gO = 2 * E / E.size
        gW2 = H.T @ gO
        gW1 = X.T @ ((gO @ W2.T) * (1 - H * H))
        W1 = W1 - lr * gW1
        W2 = W2 - lr * gW2
    return W1, W2


async def _train(seed: int, steps: int, lr: float, out: dict, yield_every_step: bool = True):
    rng = np.random.default_rng(seed)
    X, Y = rng.standard_normal((32, 6)), rng.standard_normal((32, 2))
    W1 = ag.tensor(rng.standard_normal((6, 8)) * 0.3, requires_grad=True)
    W2 = ag.tensor(rng.standard_normal((8, 2)) * 0.3, requires_grad=True)
    X, Y = ag.tensor(X), ag.tensor(Y)
    for _ in range(steps):
        E = ag.tanh(X @ W1) @ W2 - Y
        loss = (E * E).mean()
        await loss.backward()
        with ag.no_grad():
            W1 -= lr * W1.grad
            W2 -= lr * W2.grad
        W1.grad = None
        W2.grad = None
        if yield_every_step:
            await trio.sleep(0)
    out[seed] = (W1, W2)


async def test_independent_trainings_never_share_a_leaf_owner(rt):
    P, steps, lr = 6, 5, 0.1
    out: dict = {}
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for seed in range(P):
                n.start_soon(_train, seed, steps, lr, out)
    owners = {}
    for seed, params in out.items():
        got = {p.__dict__["_owner"] for p in params}
        assert len(got) == 1, f"training {seed}: its parameters have several owners {got}"
        owners[seed] = got.pop()
    assert len(set(owners.values())) == P, f"trainings share owners: {owners}"
    assert len(rt.owners) == P
    for seed, owner in owners.items():
        st = owner.owner_statistics()
        # each owner saw exactly its own training's passes: one commit of both parameters per step
        assert (st.commits, st.graph_tasks_seen, st.leaves_committed) == (steps, steps, 2 * steps), st
        W1_ref, W2_ref = _reference_sgd(seed, steps, lr)
        np.testing.assert_allclose(out[seed][0].numpy(), W1_ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(out[seed][1].numpy(), W2_ref, rtol=1e-12, atol=1e-14)


def test_trainings_in_several_os_threads_each_with_ag_run():
    """P OS threads, each with its own `ag.run` (its own trio loop and runtime), train concurrently."""
    P, steps, lr = 4, 6, 0.1
    barrier = threading.Barrier(P, timeout=30)
    results: dict = {}
    errors: list = []

    async def main(seed):
        rt = ag.current_runtime()
        lanes = list(rt.threads())
        barrier.wait()  # every thread's runtime is open before any training starts
        out: dict = {}
        await _train(seed, steps, lr, out)
        W1, W2 = out[seed]
        return W1.numpy().copy(), W2.numpy().copy(), rt, lanes, set(rt.owners.values())

    def thread_main(seed):
        try:
            results[seed] = ag.run(main, seed, lanes=1)
        except BaseException as e:  # reported below, with the seed
            errors.append((seed, e))

    threads = [threading.Thread(target=thread_main, args=(s,), name=f"trainer-{s}") for s in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a training thread hung"
    assert not errors, errors
    # isolated: P runtimes, P distinct lanes, no owner shared
    assert len({id(results[s][2]) for s in range(P)}) == P
    lanes = [t for s in range(P) for t in results[s][3]]
    assert len(lanes) == P and len(set(lanes)) == P
    owners = [o for s in range(P) for o in results[s][4]]
    assert len(owners) == len(set(owners)) == P
    for seed in range(P):
        W1_ref, W2_ref = _reference_sgd(seed, steps, lr)
        np.testing.assert_allclose(results[seed][0], W1_ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(results[seed][1], W2_ref, rtol=1e-12, atol=1e-14)
    assert not any(t.is_alive() for t in lanes)
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncgrad-")]


# ---------------------------------------------------------------------------------------------------
# grad mode is per task
# ---------------------------------------------------------------------------------------------------


async def test_no_grad_in_one_task_does_not_leak_into_a_concurrent_task(rt):
    a_inside = trio.Event()
    b_done = trio.Event()
    seen = {}

    async def task_a():
        x = ag.ones(3, dtype="float64", requires_grad=True)
        with ag.no_grad():
            a_inside.set()
            await b_done.wait()  # task B runs entirely while A is inside no_grad
            y = x * 2.0
            seen["a_enabled"] = ag.is_grad_enabled()
        seen["a_requires_grad"] = y.requires_grad
        ag.set_grad_enabled(False)  # the plain call form, also per task
        seen["a_after_set"] = ag.is_grad_enabled()

    async def task_b():
        await a_inside.wait()
        seen["b_enabled"] = ag.is_grad_enabled()
        x = ag.tensor([1.0, 2.0, 3.0], dtype="float64", requires_grad=True)
        y = (x * x).sum()
        seen["b_requires_grad"] = y.requires_grad
        await y.backward()
        seen["b_grad"] = x.grad.numpy().copy()
        b_done.set()

    async def task_c():
        # starts after A switched grad off with the plain call: unaffected
        await b_done.wait()
        await trio.testing.wait_all_tasks_blocked()
        seen["c_enabled"] = ag.is_grad_enabled()

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(task_a)
            n.start_soon(task_b)
            n.start_soon(task_c)
    assert seen["b_enabled"] is True and seen["b_requires_grad"] is True
    np.testing.assert_array_equal(seen["b_grad"], [2.0, 4.0, 6.0])
    assert seen["a_enabled"] is False and seen["a_requires_grad"] is False
    assert seen["a_after_set"] is False
    assert seen["c_enabled"] is True
    assert ag.is_grad_enabled() is True
