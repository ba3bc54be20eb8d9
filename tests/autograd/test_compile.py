"""ag.compile: captured training is bit for bit the eager training; each fallback reason is reported."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag

from ._compile_models import MLP, assert_same, batches, state_arrays, step_fn, twin

STEPS = 20


async def _train_both(kind: str, opt: str, steps: int = STEPS) -> ag.CompiledStep:
    m1, o1, m2, o2 = twin(kind, opt)
    eager = step_fn(kind, m1, o1)
    step = ag.compile(step_fn(kind, m2, o2))
    for x, y in batches(kind, steps):
        l1 = await eager(x, y)
        l2 = await step(x, y)
        await ag.current_runtime().synchronize()
        assert l1.numpy().tobytes() == l2.numpy().tobytes()
        assert l1.requires_grad == l2.requires_grad and l1._version == l2._version
        assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
    return step


@pytest.mark.parametrize("opt", ["sgd", "adam"])
async def test_mlp_bit_identical(rt, opt):
    with trio.fail_after(60):
        step = await _train_both("mlp", opt)
    st = step.statistics()
    assert st.fallback_reason is None
    assert (st.eager_calls, st.recordings, st.replays) == (1, 1, STEPS - 2)
    assert st.instructions > 10


@pytest.mark.parametrize("opt", ["sgd", "adam"])
async def test_cnn_bit_identical(rt, opt):
    with trio.fail_after(60):
        step = await _train_both("cnn", opt)
    st = step.statistics()
    assert st.fallback_reason is None and st.replays == STEPS - 2


@pytest.mark.parametrize("opt", ["sgd", "adam"])
async def test_lstm_bit_identical(rt, opt):
    with trio.fail_after(60):
        step = await _train_both("lstm", opt)
    st = step.statistics()
    assert st.fallback_reason is None and st.replays == STEPS - 2


# ---- fallbacks: each reason, the warning once, and the eager results ------------------------------------


async def _fallback(make_step, n: int = 4):
    """Run a compiled step and the same eager step side by side; returns (step, warnings)."""
    m1, o1, m2, o2 = twin("mlp", "sgd")
    eager, step = make_step(m1, o1), ag.compile(make_step(m2, o2))
    with pytest.warns(ag.CaptureFallback) as caught:
        for i, (x, y) in enumerate(batches("mlp", n)):
            ag.manual_seed(i)  # the same draws for both (dropout)
            await eager(x, y)
            ag.manual_seed(i)
            await step(x, y)
    await ag.current_runtime().synchronize()
    assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
    st = step.statistics()
    assert st.replays == 0 and st.recordings == 1 and st.programs == 0
    assert len([w for w in caught if issubclass(w.category, ag.CaptureFallback)]) == 1
    assert st.fallback_reason == step.fallback_reason
    return step


def _plain(extra):
    def make_step(model, opt):
        async def fn(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(extra(model, model(x)), y)
            await loss.backward()
            opt.step()
            return loss

        return fn

    return make_step


F = ag.nn.functional


async def test_fallback_item(rt):
    def make_step(model, opt):
        async def fn(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            await loss.backward()
            opt.step()
            return float(await loss.ready())

        return fn

    with trio.fail_after(30):
        step = await _fallback(make_step)
    assert "reads a value on the host" in step.fallback_reason


async def test_fallback_data_dependent_shape(rt):
    with trio.fail_after(30):
        step = await _fallback(_plain(lambda m, out: out + ag.nonzero(out > 0).shape[0] * 0.0))
    assert "data-dependent shape" in step.fallback_reason and "nonzero" in step.fallback_reason


async def test_fallback_random_draw_in_python(rt):
    # a factory's draw happens in Python at call time: a replay could not repeat it
    with trio.fail_after(30):
        step = await _fallback(_plain(lambda m, out: out + ag.randn(*out.shape) * 0.1))
    assert "random" in step.fallback_reason


async def test_fallback_random_op_with_its_own_generator(rt):
    # a seed drawn from a generator of the user's: not one the replay can draw again
    def drop(m, out):
        return F.dropout(out, 0.5, generator=np.random.default_rng(3))

    with trio.fail_after(30):
        step = await _fallback(_plain(drop))
    assert "random op dropout" in step.fallback_reason


@pytest.mark.parametrize("opt", ["sgd", "adam"])
async def test_dropout_replays_bit_identical(rt, opt):
    """Random ops replay: each replay draws the seeds the eager step would draw, from the same generator."""
    m1, o1, m2, o2 = twin("mlp", opt)
    make = _plain(lambda m, out: F.dropout(out, 0.3) + F.dropout(out * 2.0, 0.6))
    runs = []
    with trio.fail_after(60):
        for model, o, compiled in ((m1, o1, False), (m2, o2, True)):
            step = ag.compile(make(model, o)) if compiled else make(model, o)
            ag.manual_seed(11)  # the same stream of draws for both trainings
            losses = []
            for x, y in batches("mlp", STEPS):
                losses.append((await (await step(x, y)).ready()).numpy().tobytes())
            losses.append(ag.default_generator().integers(0, 2**63 - 1))  # the stream advanced alike
            runs.append(losses)
            await ag.current_runtime().synchronize()
    assert runs[0] == runs[1]
    assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
    st = step.statistics()
    assert st.fallback_reason is None and st.replays == STEPS - 2


async def test_fallback_tensor_hook(rt):
    def make_step(model, opt):
        model.fc1.weight.register_hook(lambda g: g * 2.0)
        return _plain(lambda m, out: out)(model, opt)

    with trio.fail_after(30):
        step = await _fallback(make_step)
    assert "Python hook on a leaf" in step.fallback_reason


async def test_fallback_module_hook(rt):
    def make_step(model, opt):
        model.fc2.register_forward_hook(lambda mod, args, out: out * 0.5)
        return _plain(lambda m, out: out)(model, opt)

    with trio.fail_after(30):
        step = await _fallback(make_step)
    assert "forward hook on module Linear" in step.fallback_reason


async def test_fallback_create_graph(rt):
    def make_step(model, opt):
        async def fn(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            await loss.backward(create_graph=True)
            opt.step()
            return loss.detach()

        return fn

    with trio.fail_after(30):
        step = await _fallback(make_step)
    assert "create_graph" in step.fallback_reason


async def test_guard_failure_recaptures_with_a_bound(rt):
    """A new batch shape records again (bit-identical still); max_programs bounds what is kept, and a
    step whose guards keep failing after max_recaptures recordings runs eagerly, saying why."""
    m1, o1, m2, o2 = twin("mlp", "sgd")
    eager = step_fn("mlp", m1, o1)
    step = ag.compile(step_fn("mlp", m2, o2), max_programs=2, max_recaptures=3)
    rng = np.random.default_rng(5)
    with trio.fail_after(30):
        for n in [8, 8, 8, 16, 16, 8, 16, 4, 4]:
            x = ag.tensor(rng.standard_normal((n, 32)).astype(np.float32))
            y = ag.tensor(rng.integers(0, 10, n))
            await eager(x, y)
            await step(x, y)
        await ag.current_runtime().synchronize()
        assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
        st = step.statistics()
        # 8: eager, record, replay; 16: record, replay; 8, 16: replays; 4: record (drops 8's program), replay
        assert (st.recordings, st.replays, st.programs, st.guard_failures) == (3, 5, 2, 2)
        assert "shapes" in step.last_guard_failure
        with pytest.warns(ag.CaptureFallback, match="guards still fail"):
            for n in [5, 6, 7]:
                x = ag.tensor(rng.standard_normal((n, 32)).astype(np.float32))
                y = ag.tensor(rng.integers(0, 10, n))
                await eager(x, y)
                await step(x, y)
        await ag.current_runtime().synchronize()
        assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
        assert "recorded" in step.fallback_reason


async def test_grad_kept_and_lr_schedule(rt):
    """zero_grad(set_to_none=False) (accumulation into the same .grad, in place) and a learning-rate
    schedule between steps (the optimizer's kernels are re-made on each replay): still bit-identical."""
    m1, o1, m2, o2 = twin("mlp", "adam")
    s1, s2 = ag.optim.lr_scheduler.StepLR(o1, 2, 0.5), ag.optim.lr_scheduler.StepLR(o2, 2, 0.5)

    def make_step(model, opt):
        async def fn(x, y):
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x), y)
            await loss.backward()
            opt.step()
            return loss

        return fn

    eager, step = make_step(m1, o1), ag.compile(make_step(m2, o2))
    with trio.fail_after(30):
        for x, y in batches("mlp", 8):
            await eager(x, y)
            await step(x, y)
            s1.step()
            s2.step()
        await ag.current_runtime().synchronize()
    assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
    st = step.statistics()
    # the first step leaves .grad None, the second has one: a guard failure, then replays
    assert st.replays >= 5 and st.fallback_reason is None


async def test_sgd_reuses_its_kernels_until_its_hyperparameters_change(rt, monkeypatch):
    """SGD's step advances no Python state once its momentum buffers exist: a replay reuses the kernels the
    last re-run of `step` made while the hyperparameters stay the same, and re-makes them when a schedule
    (or a hand edit) changes them; a subclass with its own `_update` is re-run on every replay."""
    calls = [0]
    sgd_update = ag.optim.SGD._update

    def counting(self, p, g, group, state):
        calls[0] += 1
        sgd_update(self, p, g, group, state)

    monkeypatch.setattr(ag.optim.SGD, "_update", counting)  # (SGD's own update still: it may reuse)

    class CountingSGD(ag.optim.SGD):
        def _update(self, p, g, group, state):
            super()._update(p, g, group, state)

    def make(cls):
        ag.manual_seed(0)
        m = MLP()
        return m, cls(m.parameters(), lr=0.1, momentum=0.9, nesterov=True)

    def make_step(model, opt):
        async def fn(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            await loss.backward()
            opt.step()
            return loss

        return fn

    for cls in (ag.optim.SGD, CountingSGD):
        (m1, o1), (m2, o2) = make(cls), make(cls)
        s1, s2 = ag.optim.lr_scheduler.StepLR(o1, 3, 0.5), ag.optim.lr_scheduler.StepLR(o2, 3, 0.5)
        eager, step = make_step(m1, o1), ag.compile(make_step(m2, o2))
        n_params = len(list(m2.parameters()))
        last = None
        with trio.fail_after(30):
            for i, (x, y) in enumerate(batches("mlp", 10)):
                if i == 7:
                    for o in (o1, o2):
                        o.param_groups[0]["momentum"] = 0.5
                calls[0] = 0
                l1 = await eager(x, y)
                eager_calls = calls[0]
                calls[0] = 0
                hyper = (o2.param_groups[0]["lr"], o2.param_groups[0]["momentum"])
                l2 = await step(x, y)
                await ag.current_runtime().synchronize()
                assert l1.numpy().tobytes() == l2.numpy().tobytes()
                assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
                assert eager_calls == n_params
                if i >= 3:  # replays (steps 0-1 eager, 2 recorded)
                    reused = cls is ag.optim.SGD and hyper == last
                    assert calls[0] == (0 if reused else n_params), (cls, i, calls[0])
                last = hyper
                s1.step()
                s2.step()
        st = step.statistics()
        assert st.replays >= 7 and st.fallback_reason is None


async def test_sgd_state_loaded_between_replays(rt):
    """An SGD whose state is loaded between replays (its momentum buffers other tensors now): the replay
    re-makes its kernels over the new buffers, still bit for bit the eager training."""
    m1, o1, m2, o2 = twin("mlp", "sgd")
    eager, step = step_fn("mlp", m1, o1), ag.compile(step_fn("mlp", m2, o2))
    with trio.fail_after(30):
        saved = None
        for i, (x, y) in enumerate(batches("mlp", 10)):
            if i == 4:
                await ag.current_runtime().synchronize()
                saved = (o1.state_dict(), o2.state_dict())
            if i == 7:
                o1.load_state_dict(saved[0])
                o2.load_state_dict(saved[1])
            await eager(x, y)
            await step(x, y)
            await ag.current_runtime().synchronize()
            assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
    assert step.statistics().fallback_reason is None


async def test_fallback_inplace_on_a_tensor_made_in_the_step(rt):
    def extra(m, out):
        t = ag.zeros(out.shape)
        t.add_(1.0)  # in place on a tensor made here: its recorded value would be replayed
        return out + t

    with trio.fail_after(30):
        step = await _fallback(_plain(extra))
    assert "writes in place to a tensor of shape (16, 10)" in step.fallback_reason


async def test_batchnorm_buffers_and_detach(rt):
    """Module buffers written in the step (BatchNorm's running statistics, its batch counter) replay in place;
    `.detach()` inside the step is recorded as an op."""
    nn = ag.nn

    def make():
        ag.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
        return m, ag.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def make_step(model, opt):
        async def fn(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            await loss.backward()
            opt.step()
            return loss.detach()

        return fn

    (m1, o1), (m2, o2) = make(), make()
    eager, step = make_step(m1, o1), ag.compile(make_step(m2, o2))
    with trio.fail_after(30):
        for x, y in batches("mlp", 6):
            l1 = await eager(x, y)
            l2 = await step(x, y)
            await ag.current_runtime().synchronize()
            assert l1.numpy().tobytes() == l2.numpy().tobytes()
            assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
            for b1, b2 in zip(m1.buffers(), m2.buffers()):
                assert b1.numpy().tobytes() == b2.numpy().tobytes()
                assert b1._version == b2._version, (b1._version, b2._version)
    assert step.statistics().replays == 4 and step.fallback_reason is None


async def test_replay_is_one_lane_job_and_keeps_grads_on_cancel(rt):
    """A replay queues the whole step as ONE job on the task's stream (no kernel per op); a replay cancelled
    while it waits for its run-ahead leaves every .grad as it was."""
    m, o, _, _ = twin("mlp", "adam")
    step = ag.compile(step_fn("mlp", m, o))
    data = batches("mlp", 4)
    with trio.fail_after(30):
        for x, y in data[:2]:
            await step(x, y)
        await ag.current_runtime().synchronize()
        stream = ag.runtime.current_stream(m.fc1.weight.device)
        before = stream.submitted
        loss = await step(*data[2])
        assert stream.submitted - before == 1 and step.statistics().replays == 1
        assert not loss.requires_grad or loss.grad_fn is not None  # as eager leaves it: released graph
        grads = [p.grad for p in m.parameters()]
        state = [dict(o.state[p]) for p in m.parameters()]
        with trio.CancelScope() as cs:
            cs.cancel()
            await step(*data[3])  # cancelled at its first checkpoint, before it changes anything
        assert cs.cancelled_caught and step.statistics().replays == 1
        assert all(p.grad is g for p, g in zip(m.parameters(), grads))
        assert [o.state[p]["step"] for p in m.parameters()] == [s["step"] for s in state]
        await ag.current_runtime().synchronize()


async def test_compiled_steps_of_concurrent_tasks_stay_apart(rt):
    """Two trainings side by side in one runtime, each with its own compiled step: a recording belongs to
    its task (the other task's ops run eagerly meanwhile, unrecorded), and each training ends bit-identical
    to its eager twin trained alone."""
    pairs = [twin("mlp", "sgd"), twin("mlp", "adam")]
    with trio.fail_after(60):
        for m1, o1, _, _ in pairs:
            eager = step_fn("mlp", m1, o1)
            for x, y in batches("mlp", STEPS):
                await eager(x, y)
        steps: list[ag.CompiledStep] = []

        async def train(m2, o2):
            step = ag.compile(step_fn("mlp", m2, o2))
            steps.append(step)
            for x, y in batches("mlp", STEPS):
                await step(x, y)
                await trio.sleep(0)  # the other training runs between steps too

        async with trio.open_nursery() as nursery:
            for _, _, m2, o2 in pairs:
                nursery.start_soon(train, m2, o2)
        await ag.current_runtime().synchronize()
    for m1, o1, m2, o2 in pairs:
        assert_same(state_arrays(m1, o1), state_arrays(m2, o2))
    for step in steps:
        st = step.statistics()
        assert st.fallback_reason is None and st.recordings >= 1 and st.replays >= STEPS - 4


# ---- the update users write by hand: `p -= lr * p.grad` ------------------------------------------------


def _sgd_by_hand(model, keep: list | None):
    async def step(x, y):
        loss = F.cross_entropy(model(x), y)
        await loss.backward()
        with ag.no_grad():
            for p in model.parameters():
                d = 0.05 * p.grad
                p -= d
                if keep is not None:  # the temporary is used elsewhere: the update may not take it over
                    keep.append(d)
                del d
                p.grad = None
        return loss.detach()

    return step


@pytest.mark.parametrize("hold", [False, True], ids=["one-pass", "temporary-kept"])
async def test_hand_written_sgd_replays_bit_identical(rt, hold):
    # hidden 256: the weight updates run on a lane and take the one-pass (BLAS axpy) form, which rounds
    # differently from `p - (lr * g)`; the replay must choose as the eager step did
    ag.manual_seed(0)
    m1, m2 = MLP(hidden=256), MLP(hidden=256)
    m2.load_state_dict(m1.state_dict())
    k1, k2 = ([], []) if hold else (None, None)
    eager, step = _sgd_by_hand(m1, k1), ag.compile(_sgd_by_hand(m2, k2))
    with trio.fail_after(60):
        for x, y in batches("mlp", STEPS):
            l1 = await eager(x, y)
            l2 = await step(x, y)
            await ag.current_runtime().synchronize()
            assert l1.numpy().tobytes() == l2.numpy().tobytes()
            for a, b in zip(m1.parameters(), m2.parameters()):
                assert a.numpy().tobytes() == b.numpy().tobytes()
    st = step.statistics()
    assert st.fallback_reason is None and st.replays == STEPS - 2
    if hold:
        # the replay hands out no temporaries: the kept ones are the eager and recording steps' own
        assert len(k1) == STEPS * 6 and len(k2) == 2 * 6
