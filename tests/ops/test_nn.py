"""The nn ops (``ops/_nn.py``): embedding, layer_norm, dropout; gradients against central finite differences
in float64 (``ag.autograd.gradcheck``), values and gradients against PyTorch (recorded, see tests/_reference.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import INDEX_ERRORS, vs_torch

# ---- embedding ----------------------------------------------------------------------------------------


async def test_embedding(rng: np.random.Generator, torch_ref: Any) -> None:
    async with ag.open_runtime():
        w = rng.standard_normal((6, 3))
        idx = np.array([[0, 2, 2], [5, 1, 2]])
        await ag.autograd.gradcheck(lambda w: ag.embedding(idx, w), [w], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        # padding_idx and scale_grad_by_freq change the gradient on purpose (no longer the true one)
        for i, kw in enumerate([
            {},
            {"padding_idx": 2},
            {"scale_grad_by_freq": True},
            {"padding_idx": 5, "scale_grad_by_freq": True},
        ]):
            await vs_torch(
                torch_ref,
                f"embedding-{i}",
                lambda w, kw=kw: ag.embedding(ag.tensor(idx), w, **kw),
                lambda torch, w, kw=kw: torch.nn.functional.embedding(torch.tensor(idx), w, **kw),
                w,
            )

        # max_norm renormalises the looked-up rows in place, like PyTorch
        def reference(torch: Any) -> Any:
            wt = torch.tensor(w * 3)
            tout = torch.nn.functional.embedding(torch.tensor(idx), wt, max_norm=1.5)
            return tout, wt

        tout, wt = torch_ref("embedding_max_norm", reference, w=w, idx=idx)
        wa = ag.tensor(w * 3)
        out = ag.embedding(idx, wa, max_norm=1.5)
        np.testing.assert_allclose(out.numpy(), tout, rtol=1e-12)
        np.testing.assert_allclose(wa.numpy(), wt, rtol=1e-12)
        with pytest.raises(INDEX_ERRORS, match="out of range"):
            ag.embedding(np.array([6]), ag.tensor(w)).numpy()


# ---- layer_norm --------------------------------------------------------------------------------------


async def test_layer_norm(rng: np.random.Generator, torch_ref: Any) -> None:
    async with ag.open_runtime():
        x = rng.standard_normal((3, 2, 5))
        w, b = rng.standard_normal(5), rng.standard_normal(5)
        await ag.autograd.gradcheck(
            lambda x, w, b: ag.layer_norm(x, (5,), w, b), [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
        )
        w2, b2 = rng.standard_normal((2, 5)), rng.standard_normal((2, 5))
        await ag.autograd.gradcheck(
            lambda x, w, b: ag.layer_norm(x, (2, 5), w, b, eps=1e-3),
            [x, w2, b2],
            eps=1e-6,
            atol=1e-7,
            rtol=1e-5,
            seed=7,
        )
        await ag.autograd.gradcheck(lambda x: ag.layer_norm(x, 5), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await vs_torch(
            torch_ref,
            "layer_norm",
            lambda x, w, b: ag.layer_norm(x, (2, 5), w, b),
            lambda torch, x, w, b: torch.nn.functional.layer_norm(x, (2, 5), w, b),
            x,
            w2,
            b2,
        )
        big = rng.standard_normal((64, 128)).astype(np.float32)  # float32, on a lane
        out = ag.layer_norm(ag.tensor(big), (128,))
        ref = torch_ref(
            "layer_norm_float32", lambda torch: torch.nn.functional.layer_norm(torch.tensor(big), (128,)), big=big
        )
        assert out.dtype == np.float32
        np.testing.assert_allclose(out.numpy(), ref, atol=1e-5)


# ---- dropout ---------------------------------------------------------------------------------------------


async def test_dropout(rng: np.random.Generator) -> None:
    async with ag.open_runtime():
        x = ag.ones(200, 300, dtype=np.float64, requires_grad=True)
        y1 = ag.dropout(x, 0.3, generator=np.random.default_rng(5))
        y2 = ag.dropout(x, 0.3, generator=np.random.default_rng(5))
        y3 = ag.dropout(x, 0.3, generator=np.random.default_rng(6))
        np.testing.assert_array_equal(y1.numpy(), y2.numpy())  # deterministic for a given generator
        assert not np.array_equal(y1.numpy(), y3.numpy())
        kept = y1.numpy() != 0
        assert abs(kept.mean() - 0.7) < 0.01
        np.testing.assert_allclose(y1.numpy()[kept], 1 / 0.7)
        await y1.sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), y1.numpy())  # gradient = the same mask, scaled
        assert ag.dropout(x, 0.3, training=False) is x
        assert not ag.dropout(x, 1.0).numpy().any()
        with pytest.raises(ValueError, match="between 0 and 1"):
            ag.dropout(x, 1.5)
        # a fixed seed makes it a deterministic function: FD applies
        xs = rng.standard_normal((4, 5))
        await ag.autograd.gradcheck(
            lambda x: ag.dropout(x, 0.4, generator=np.random.default_rng(3)),
            [xs],
            eps=1e-6,
            atol=1e-7,
            rtol=1e-5,
            seed=7,
        )
        ag.manual_seed(9)
        d1 = ag.dropout(x, 0.5).numpy()
        ag.manual_seed(9)
        np.testing.assert_array_equal(d1, ag.dropout(x, 0.5).numpy())


async def test_embedding_rejects_negative_indices(rt: Any) -> None:
    w = ag.tensor(np.ones((4, 2)))
    with pytest.raises(IndexError, match=r"embedding: index out of range in self: indices must be in \[0, 4\)"):
        ag.embedding(ag.tensor([0, -1]), w).numpy()
