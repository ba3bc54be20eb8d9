"""The fused scaled-dot-product attention op: central-difference gradient checks in float64."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.ops import scaled_dot_product_attention as sdpa


@pytest.mark.parametrize("case", ["plain", "causal", "float_mask", "bool_mask", "dropout", "broadcast", "scale"])
async def test_sdpa_gradcheck(rt, rng, case) -> None:
    q = rng.standard_normal((2, 3, 4))
    k = rng.standard_normal((1 if case == "broadcast" else 2, 5, 4))
    v = rng.standard_normal((k.shape[0], 5, 3))
    inputs = [q, k, v]
    bool_mask = ag.tensor(rng.random((3, 5)) < 0.7) if case == "bool_mask" else None

    def fn(q, k, v, *mask):
        kw: dict = {}
        if case == "causal":
            kw["is_causal"] = True
        if case == "float_mask":
            kw["attn_mask"] = mask[0]
        if case == "bool_mask":
            kw["attn_mask"] = bool_mask
        if case == "scale":
            kw["scale"] = 0.3
        if case == "dropout":
            ag.manual_seed(7)  # the same dropout mask on every evaluation
            kw["dropout_p"] = 0.4
        return sdpa(q, k, v, **kw)

    if case == "float_mask":
        inputs.append(rng.standard_normal((3, 5)))
    with trio.fail_after(60):
        assert await ag.autograd.gradcheck(fn, inputs, atol=1e-7, rtol=1e-6)


async def test_sdpa_fully_masked_row_gives_zeros(rt, rng) -> None:
    with trio.fail_after(30):
        q = ag.tensor(rng.standard_normal((3, 4)), requires_grad=True)
        m = np.ones((3, 3), bool)
        m[1] = False
        out = sdpa(q, q, q, attn_mask=ag.tensor(m))
        assert np.all(out.numpy()[1] == 0) and np.all(np.isfinite(out.numpy()))
        (g,) = await ag.grad(out.sum(), [q])
        assert np.all(np.isfinite(g.numpy()))


@pytest.mark.parametrize("case", ["plain", "causal_dropout", "float_mask", "dead_row"])
async def test_sdpa_second_derivatives(rt, rng, case) -> None:
    q = rng.standard_normal((2, 3, 4))
    k = rng.standard_normal((2, 4, 4))
    v = rng.standard_normal((2, 4, 2))
    inputs = [q, k, v]
    dead = np.ones((3, 4), bool)
    dead[1] = False

    def fn(q, k, v, *m):
        if case == "causal_dropout":
            ag.manual_seed(3)
            return sdpa(q, k, v, is_causal=True, dropout_p=0.3)
        if case == "float_mask":
            return sdpa(q, k, v, attn_mask=m[0])
        if case == "dead_row":
            return sdpa(q, k, v, attn_mask=ag.tensor(dead))
        return sdpa(q, k, v, scale=0.7)

    if case == "float_mask":
        inputs.append(rng.standard_normal((3, 4)))
    with trio.fail_after(120):
        assert await ag.autograd.gradgradcheck(fn, inputs, atol=1e-6, rtol=1e-5)
