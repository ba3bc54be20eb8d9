"""`ag.checkpoint` (issue 3, item 4): gradients equal the plain model's exactly, nested checkpoints, the
checkpointed function runs exactly once more in backward, and parameter grads are committed only with the
enclosing pass. With dropout inside, ``preserve_rng_state`` (default True, as in PyTorch) makes the
recompute draw the forward's masks without moving the caller's random stream.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import trio
import trio.testing

import asyncgrad as ag


@pytest.fixture
async def rt():
    async with ag.open_runtime(lanes=2) as r:
        yield r


class MLP:
    """Three dense layers; the parameters are captured by the closures below, not passed in."""

    def __init__(self, seed: int, sizes=(6, 16, 12, 3)):
        rng = np.random.default_rng(seed)
        self.Ws = [
            ag.tensor(rng.standard_normal((a, b)) / np.sqrt(a), requires_grad=True)
            for a, b in itertools.pairwise(sizes)
        ]
        self.bs = [ag.tensor(rng.standard_normal(b) * 0.1, requires_grad=True) for b in sizes[1:]]
        self.calls = {"block": 0, "inner": 0, "outer": 0}

    def params(self):
        return [*self.Ws, *self.bs]

    def layer(self, i, h, act=True):
        z = h @ self.Ws[i] + self.bs[i]
        return ag.tanh(z) if act else z

    def block(self, x):
        """Layers 0 and 1: the checkpointed part."""
        self.calls["block"] += 1
        return self.layer(1, ag.relu(self.layer(0, x)))

    def inner(self, h):
        self.calls["inner"] += 1
        return self.layer(1, h)

    def outer(self, x):
        """Layer 0, then a nested checkpoint of layer 1, then a square."""
        self.calls["outer"] += 1
        h = ag.relu(self.layer(0, x))
        h = ag.checkpoint(self.inner, h)
        return h * h

    def loss_plain(self, x):
        return (self.layer(2, self.block(x), act=False) ** 2).mean()

    def loss_ckpt(self, x):
        return (self.layer(2, ag.checkpoint(self.block, x), act=False) ** 2).mean()

    def loss_nested_plain(self, x):
        h = ag.relu(self.layer(0, x))
        h = self.layer(1, h)
        return (self.layer(2, h * h, act=False) ** 2).mean()

    def loss_nested_ckpt(self, x):
        return (self.layer(2, ag.checkpoint(self.outer, x), act=False) ** 2).mean()


def _grads(ts):
    return [t.grad.numpy().copy() for t in ts]


def _assert_exactly_equal(got, want, names):
    for g, w, n in zip(got, want, names):
        assert g.dtype == w.dtype == np.float64
        assert np.array_equal(g, w), f"{n}: max |diff| {np.max(np.abs(g - w))}"


NAMES = ["x", "W0", "W1", "W2", "b0", "b1", "b2"]


@pytest.mark.parametrize("batch", [5, 300], ids=["inline", "lanes"])
async def test_checkpoint_gradients_equal_the_plain_model_exactly(rt, batch):
    x0 = np.random.default_rng(10).standard_normal((batch, 6))
    plain, ckpt = MLP(1), MLP(1)
    xp = ag.tensor(x0, requires_grad=True)
    xc = ag.tensor(x0, requires_grad=True)
    with trio.fail_after(20):
        lp = plain.loss_plain(xp)
        lc = ckpt.loss_ckpt(xc)
        assert lc.item() == lp.item()
        await lp.backward()
        await lc.backward()
    _assert_exactly_equal(_grads([xc, *ckpt.params()]), _grads([xp, *plain.params()]), NAMES)
    # the checkpointed block ran once in forward and exactly once more in backward
    assert ckpt.calls["block"] == 2 and plain.calls["block"] == 1
    # two steps in a row keep matching (the second accumulates onto the first)
    await plain.loss_plain(xp).backward()
    await ckpt.loss_ckpt(xc).backward()
    _assert_exactly_equal(_grads([xc, *ckpt.params()]), _grads([xp, *plain.params()]), NAMES)
    assert ckpt.calls["block"] == 4


async def test_checkpoint_with_inputs_that_do_not_require_grad(rt):
    x0 = np.random.default_rng(11).standard_normal((7, 6))
    plain, ckpt = MLP(2), MLP(2)
    await plain.loss_plain(ag.tensor(x0)).backward()
    await ckpt.loss_ckpt(ag.tensor(x0)).backward()
    _assert_exactly_equal(_grads(ckpt.params()), _grads(plain.params()), NAMES[1:])
    assert ckpt.calls["block"] == 2


async def test_nested_checkpoint_equals_plain_and_counts_each_level(rt):
    x0 = np.random.default_rng(12).standard_normal((9, 6))
    plain, ckpt = MLP(3), MLP(3)
    xp = ag.tensor(x0, requires_grad=True)
    xc = ag.tensor(x0, requires_grad=True)
    lp = plain.loss_nested_plain(xp)
    lc = ckpt.loss_nested_ckpt(xc)
    assert lc.item() == lp.item()
    # forward: the outer function once; inside it the inner checkpoint runs `inner` once
    assert ckpt.calls == {"block": 0, "inner": 1, "outer": 1}
    with trio.fail_after(20):
        await lp.backward()
        await lc.backward()
    _assert_exactly_equal(_grads([xc, *ckpt.params()]), _grads([xp, *plain.params()]), NAMES)
    # backward: the outer level recomputes once (+1 outer, and its inner checkpoint's forward: +1 inner);
    # the inner level's own backward then recomputes inner once more (+1 inner)
    assert ckpt.calls == {"block": 0, "inner": 3, "outer": 2}
    assert rt.graph_tasks_started == rt.graph_tasks_finished == 4  # 2 top-level + 2 nested passes


async def test_checkpoint_grad_call_equals_plain(rt):
    """`ag.grad` (no accumulation) through a checkpoint: the same values, and no `.grad` written."""
    x0 = np.random.default_rng(13).standard_normal((4, 6))
    plain, ckpt = MLP(4), MLP(4)
    xp = ag.tensor(x0, requires_grad=True)
    xc = ag.tensor(x0, requires_grad=True)
    gp = await ag.grad(plain.loss_plain(xp), [xp, *plain.params()])
    gc = await ag.grad(ckpt.loss_ckpt(xc), [xc, *ckpt.params()])
    _assert_exactly_equal([g.numpy() for g in gc], [g.numpy() for g in gp], NAMES)
    assert all(p.grad is None for p in [xc, *ckpt.params()])


class FailLater(ag.Function):
    """Raises in backward; created before the checkpoint, so the pass reaches it after the checkpoint."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        raise ValueError("late failure")


class Hang(ag.Function):
    entered: trio.Event

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    async def backward(ctx, g):
        Hang.entered.set()
        await trio.Event().wait()


def _snapshot(ts):
    return [t.grad.numpy().tobytes() for t in ts]


async def test_a_failed_pass_through_a_checkpoint_leaves_parameter_grads_unchanged(rt):
    rng = np.random.default_rng(14)
    m = MLP(5)
    x = ag.tensor(rng.standard_normal((8, 6)), requires_grad=True)
    for t in [x, *m.params()]:
        t.grad = ag.tensor(rng.standard_normal(t.shape))
    before = _snapshot([x, *m.params()])
    side = FailLater.apply(x)  # node created before the checkpoint's
    loss = m.loss_ckpt(x) + side.sum() * 0.0
    with trio.fail_after(20), pytest.raises(ValueError) as info:
        await loss.backward()
    assert str(info.value) == "late failure"
    assert info.value.__notes__ == ["raised in the backward of FailLaterBackward"]
    # the checkpoint's backward did run (recompute + nested pass staged the parameter grads) before the
    # failure, yet nothing reached .grad
    assert m.calls["block"] == 2
    assert _snapshot([x, *m.params()]) == before
    await trio.testing.wait_all_tasks_blocked()
    assert rt.graph_tasks_started == rt.graph_tasks_finished
    # the same model trains normally afterwards, and its grads match a plain model's increments
    plain = MLP(5)
    ref = await ag.grad(plain.loss_plain(ag.tensor(x.numpy())), plain.params())
    g0 = [t.grad.numpy().copy() for t in m.params()]
    await m.loss_ckpt(x).backward()
    for p, b, r, n in zip(m.params(), g0, ref, NAMES[1:]):
        np.testing.assert_allclose(p.grad.numpy() - b, r.numpy(), rtol=1e-12, atol=1e-14, err_msg=n)


async def test_a_cancelled_pass_inside_a_checkpoint_leaves_parameter_grads_unchanged(rt):
    """Cancelled while the checkpoint's nested pass runs (a hang inside the recomputed block)."""
    Hang.entered = trio.Event()
    rng = np.random.default_rng(15)
    m = MLP(6)
    x = ag.tensor(rng.standard_normal((8, 6)), requires_grad=True)
    for t in [x, *m.params()]:
        t.grad = ag.tensor(rng.standard_normal(t.shape))
    before = _snapshot([x, *m.params()])

    def block_with_hang(h):
        # layer 1's parameters get their gradients in the nested pass before it reaches the hang
        return m.layer(1, Hang.apply(ag.relu(m.layer(0, h))))

    loss = (m.layer(2, ag.checkpoint(block_with_hang, x), act=False) ** 2).mean()
    with trio.fail_after(20):
        with trio.CancelScope() as cs:
            async with trio.open_nursery() as n:

                async def cancel_when_hung():
                    await Hang.entered.wait()
                    cs.cancel()

                n.start_soon(cancel_when_hung)
                await loss.backward()
        assert cs.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
    assert rt.graph_tasks_started == rt.graph_tasks_finished
    assert _snapshot([x, *m.params()]) == before


async def test_concurrent_checkpointed_trainings(rt):
    """Four models, each checkpointed, trained concurrently: each equals its plain twin exactly."""
    results = {}

    async def pair(seed):
        x0 = np.random.default_rng(100 + seed).standard_normal((16, 6))
        plain, ckpt = MLP(seed), MLP(seed)
        xp = ag.tensor(x0, requires_grad=True)
        xc = ag.tensor(x0, requires_grad=True)
        for _ in range(2):
            await ckpt.loss_ckpt(xc).backward()
            await trio.sleep(0)
            await plain.loss_plain(xp).backward()
        results[seed] = (_grads([xc, *ckpt.params()]), _grads([xp, *plain.params()]))

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for seed in range(4):
                n.start_soon(pair, seed)
    for got, want in results.values():
        _assert_exactly_equal(got, want, NAMES)


# ---------------------------------------------------------------------------------------------------
# random ops inside a checkpoint: preserve_rng_state
# ---------------------------------------------------------------------------------------------------


def _state():
    return ag.default_generator().bit_generator.state


def _drop_params(seed):
    rng = np.random.default_rng(seed)
    shapes = [(6, 16), (16,), (16, 12), (12,), (12, 3)]
    return [ag.tensor(rng.standard_normal(s) / 3.0, requires_grad=True) for s in shapes]


def _drop_inner(ps, h):
    return ag.dropout(ag.tanh(h @ ps[2] + ps[3]), 0.5, True)


def _drop_outer(ps, x, nested):
    h = ag.dropout(ag.tanh(x @ ps[0] + ps[1]), 0.3, True)
    h = ag.checkpoint(_drop_inner, ps, h) if nested else _drop_inner(ps, h)
    return h * h


def _drop_loss(ps, x, mode):
    if mode == "plain":
        out = _drop_outer(ps, x, nested=False)
    elif mode == "checkpoint":
        out = ag.checkpoint(_drop_outer, ps, x, False)
    else:  # a checkpoint inside a checkpoint, both with dropout
        out = ag.checkpoint(_drop_outer, ps, x, True)
    return ((out @ ps[4]) ** 2).mean()


async def test_checkpointed_dropout_recomputes_the_forward_mask(rt):
    x = ag.tensor(np.ones(1000), requires_grad=True)
    y = ag.checkpoint(lambda a: ag.dropout(a, 0.5, True) * a, x)
    with trio.fail_after(20):
        await y.sum().backward()
    mask = y.numpy() != 0
    assert 300 < mask.sum() < 700
    # d/da (2 m a * a) = 4 m at a = 1: exact in float64
    assert x.grad.dtype == np.float64
    assert np.array_equal(x.grad.numpy(), 4.0 * mask)


@pytest.mark.parametrize("mode", ["checkpoint", "nested"])
async def test_checkpointed_dropout_gradients_equal_the_plain_model_exactly(rt, mode):
    x0 = np.random.default_rng(20).standard_normal((64, 6))
    ps_plain, ps_ckpt = _drop_params(21), _drop_params(21)
    xp = ag.tensor(x0, requires_grad=True)
    xc = ag.tensor(x0, requires_grad=True)
    with trio.fail_after(20):
        for step in range(2):
            ag.manual_seed(1000 + step)
            lp = _drop_loss(ps_plain, xp, "plain")
            await lp.backward()
            after_plain = _state()
            ag.manual_seed(1000 + step)
            lc = _drop_loss(ps_ckpt, xc, mode)
            assert lc.item() == lp.item()
            await lc.backward()
            # the recompute left the stream where the forward left it: as after the plain step
            assert _state() == after_plain
    names = ["x", "W0", "b0", "W1", "b1", "W2"]
    _assert_exactly_equal(_grads([xc, *ps_ckpt]), _grads([xp, *ps_plain]), names)


async def test_backward_does_not_advance_the_callers_rng_stream(rt):
    ag.manual_seed(5)
    y = ag.checkpoint(lambda a: ag.dropout(a, 0.5, True) * a, ag.ones(100, dtype="float64", requires_grad=True))
    ref = np.random.default_rng(5)
    ref.integers(0, 2**63 - 1)  # the seed of the forward's mask
    before = _state()
    assert before == ref.bit_generator.state
    gen = ag.default_generator()
    with trio.fail_after(20):
        await y.sum().backward()
    assert ag.default_generator() is gen
    assert _state() == before
    np.testing.assert_array_equal(ag.rand(4, dtype="float64").numpy(), ref.random(4))


async def test_the_recompute_draws_from_the_generator_the_forward_drew_from(rt):
    g1 = ag.manual_seed(1)
    x = ag.tensor(np.ones(500), requires_grad=True)
    y = ag.checkpoint(lambda a: ag.dropout(a, 0.5, True) * a, x)
    g1_after_forward = g1.bit_generator.state
    g2 = ag.manual_seed(2)  # a new default generator object for this thread
    g2_before = g2.bit_generator.state
    with trio.fail_after(20):
        await y.sum().backward()
    assert np.array_equal(x.grad.numpy(), 4.0 * (y.numpy() != 0))
    # neither generator moved, and the thread's default is the one the caller put there
    assert ag.default_generator() is g2
    assert g2.bit_generator.state == g2_before
    assert g1.bit_generator.state == g1_after_forward


async def test_preserve_rng_state_false_draws_afresh_in_the_recompute(rt):
    # documented: the recompute draws from the generator's current state and advances it, so random ops
    # inside get a new mask (wrong gradients); a function without random ops is unaffected
    ag.manual_seed(3)
    x = ag.tensor(np.ones(1000), requires_grad=True)
    y = ag.checkpoint(lambda a: ag.dropout(a, 0.5, True) * a, x, preserve_rng_state=False)
    before = _state()
    with trio.fail_after(20):
        await y.sum().backward()
    assert _state() != before  # the recompute drew one seed from the caller's stream
    fwd_mask = y.numpy() != 0
    grad = x.grad.numpy()
    # the gradient is the recomputed function's, 4 m' for the recompute's own mask m', not the forward's
    assert set(np.unique(grad)) == {0.0, 4.0}
    assert not np.array_equal(grad, 4.0 * fwd_mask)

    x0 = np.random.default_rng(22).standard_normal((9, 6))
    plain, ckpt = MLP(4), MLP(4)
    xp, xc = ag.tensor(x0, requires_grad=True), ag.tensor(x0, requires_grad=True)
    lc = (plain.layer(2, ag.checkpoint(ckpt.block, xc, preserve_rng_state=False), act=False) ** 2).mean()
    lp = (plain.layer(2, plain.block(xp), act=False) ** 2).mean()
    with trio.fail_after(20):
        await lp.backward()
        W2, b2 = plain.Ws[2].grad.numpy().copy(), plain.bs[2].grad.numpy().copy()
        plain.Ws[2].grad = plain.bs[2].grad = None
        await lc.backward()
    _assert_exactly_equal(_grads([xc, *ckpt.Ws[:2], *ckpt.bs[:2]]), _grads([xp, *plain.Ws[:2], *plain.bs[:2]]),
                          ["x", "W0", "W1", "b0", "b1"])
    assert np.array_equal(plain.Ws[2].grad.numpy(), W2) and np.array_equal(plain.bs[2].grad.numpy(), b2)


async def test_a_failing_recompute_puts_the_generator_back(rt):
    calls = []

    def fn(a):
        calls.append(1)
        h = ag.dropout(a, 0.5, True) * a
        if len(calls) == 2:
            raise OSError("recompute failed")
        return h

    gen = ag.manual_seed(9)
    x = ag.tensor(np.ones(10), requires_grad=True)
    y = ag.checkpoint(fn, x)
    before = _state()
    with trio.fail_after(20), pytest.raises(OSError, match="recompute failed") as info:
        await y.sum().backward()
    assert info.value.__notes__ == ["raised in the backward of _CheckpointBackward"]
    assert ag.default_generator() is gen and _state() == before
    assert x.grad is None


async def test_concurrent_checkpointed_dropout_trainings(rt):
    """Tasks sharing the thread's default generator, their forwards and backwards interleaved: each
    recompute draws its own forward's masks, and no backward moves the shared stream."""
    results = {}

    async def training(k):
        x = ag.tensor(np.full(400, 1.0 + k), requires_grad=True)
        ys = []
        for _ in range(3):
            ys.append(ag.checkpoint(lambda a: ag.dropout(a, 0.5, True) * a, x))
            await trio.sleep(0)
        for y in reversed(ys):
            before = _state()
            await y.sum().backward()
            assert _state() == before
            await trio.sleep(0)
        want = sum(4.0 * (1.0 + k) * (y.numpy() != 0) for y in ys)  # d/da (2 m a^2) = 4 m a
        results[k] = (x.grad.numpy(), want)

    ag.manual_seed(11)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for k in range(4):
                n.start_soon(training, k)
    assert len(results) == 4
    for got, want in results.values():
        np.testing.assert_array_equal(got, want)
