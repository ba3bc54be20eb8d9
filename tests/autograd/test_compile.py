"""ag.compile: captured training is bit for bit the eager training; each fallback reason is reported."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag

from ._compile_models import assert_same, batches, state_arrays, step_fn, twin

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
