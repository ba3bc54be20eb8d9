"""Reuse of an embedding gradient's mapping: only when the noted rows are all that can be non-zero (the
gradient bound and never written in place); a reused array is all zeros; anything else is unmapped."""

from __future__ import annotations

import gc

import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import runtime
from asyncgrad.runtime import _row_support

ROWS, DIM = 6000, 64  # 3 MB in float64: the untouched (mmap) zeros path


async def _grad(rt, seed: int) -> ag.Tensor:
    rng = np.random.default_rng(seed)
    w = ag.tensor(rng.standard_normal((ROWS, DIM)), requires_grad=True)
    ids = ag.tensor(rng.integers(0, ROWS, size=(50,)))
    (g,) = await ag.autograd.grad([ag.embedding(ids, w)], [w], [ag.tensor(rng.standard_normal((50, DIM)))])
    await rt.synchronize()
    return g


async def _reused_after(rt, *, bind: bool, touch: bool) -> bool:
    """Whether the mapping of a gradient handled so is the next one's (and that next one is all zero)."""
    g = await _grad(rt, 0)
    if bind:
        runtime.bind_rows(g)
    if touch:  # an in-place write the noted rows know nothing of
        g.add_(0.5)
    await rt.synchronize()
    assert g.numpy().any()
    made = _row_support.MAPPINGS_MADE[0]
    del g
    gc.collect()
    g2 = await _grad(rt, 1)
    fresh = g2.numpy().copy()
    # every row the second batch did not write is zero, whatever the first wrote
    rows = runtime.noted_rows(g2.numpy())
    assert rows is not None
    mask = np.ones(ROWS, dtype=bool)
    mask[rows] = False
    assert not fresh[mask].any()
    reused = _row_support.MAPPINGS_MADE[0] == made
    del g2
    gc.collect()
    return reused


async def test_a_bound_unwritten_gradient_is_reused_as_zeros(rt) -> None:
    with trio.fail_after(60):
        for _ in range(3):
            assert await _reused_after(rt, bind=True, touch=False)


async def test_a_written_or_unbound_gradient_is_not_reused(rt) -> None:
    with trio.fail_after(60):
        assert not await _reused_after(rt, bind=True, touch=True)
        assert not await _reused_after(rt, bind=False, touch=False)
        g = await _grad(rt, 2)
        runtime.bind_rows(g)
        runtime.unbind_rows(g)  # no longer trusted
        await rt.synchronize()
        made = _row_support.MAPPINGS_MADE[0]
        del g
        gc.collect()
        assert (await _grad(rt, 3)).shape == (ROWS, DIM)
        assert _row_support.MAPPINGS_MADE[0] == made + 1
