"""The elementwise ops (``ops/_elementwise.py``): addcmul/addcdiv and the comparison methods against
PyTorch, gradients against central finite differences in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import torch_pair

torch = pytest.importorskip("torch")


# ---- addcmul / addcdiv ---------------------------------------------------------------------------------------


async def test_addcmul_addcdiv_match_torch_and_finite_differences(rt: ag.Runtime) -> None:
    rng = np.random.default_rng(3)
    a, b, c = rng.standard_normal((3, 4)), rng.standard_normal((1, 4)), rng.uniform(1, 2, (3, 1))
    (x, tx), (y, ty), (z, tz) = torch_pair(a, True), torch_pair(b, True), torch_pair(c, True)
    for ours, theirs in ((ag.addcmul, torch.addcmul), (ag.addcdiv, torch.addcdiv)):
        out, tout = ours(x, y, z, value=0.7), theirs(tx, ty, tz, value=0.7)
        np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-15)
        gs = await ag.grad(out.sum(), [x, y, z])
        tgs = torch.autograd.grad(tout.sum(), [tx, ty, tz])
        for g, tg in zip(gs, tgs):
            np.testing.assert_allclose(g.numpy(), tg.numpy(), rtol=1e-14)
    np.testing.assert_allclose(x.addcmul(y, z).numpy(), tx.addcmul(ty, tz).detach().numpy(), rtol=1e-15)
    np.testing.assert_allclose(x.addcdiv(y, z, value=2).numpy(), tx.addcdiv(ty, tz, value=2).detach().numpy(),
                               rtol=1e-15)
    assert await ag.autograd.gradcheck(lambda p, q, r: ag.addcmul(p, q, r, value=-1.5), [a, b, c], rtol=1e-4)
    assert await ag.autograd.gradcheck(lambda p, q, r: ag.addcdiv(p, q, r, value=0.5), [a, b, c], rtol=1e-4)
    assert await ag.autograd.gradgradcheck(lambda p, q, r: ag.addcdiv(p, q, r, value=0.5), [a, b, c], rtol=1e-4)


# ---- comparisons as methods and functions -----------------------------------------------------------------


async def test_comparison_methods_match_torch(rt: ag.Runtime) -> None:
    a = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    b = np.array([2.0, 2.0, 2.0])
    x, tx = torch_pair(a)
    y, ty = torch_pair(b)
    for name in ("eq", "ne", "lt", "le", "gt", "ge", "greater", "greater_equal", "less", "less_equal", "not_equal"):
        for other, tother in ((y, ty), (2.0, 2.0)):
            got = getattr(x, name)(other)
            want = getattr(tx, name)(tother)
            assert got.dtype == np.bool_
            np.testing.assert_array_equal(got.numpy(), want.numpy())
            np.testing.assert_array_equal(getattr(ag, name)(x, other).numpy(), getattr(torch, name)(tx, tother).numpy())
