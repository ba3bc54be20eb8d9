"""The elementwise ops (``ops/_elementwise.py``): addcmul/addcdiv and the comparison methods against
PyTorch, gradients against central finite differences in float64.
"""

from __future__ import annotations

import numpy as np

import asyncgrad as ag

# ---- addcmul / addcdiv ---------------------------------------------------------------------------------------


async def test_addcmul_addcdiv_match_torch_and_finite_differences(rt: ag.Runtime, torch_ref) -> None:
    rng = np.random.default_rng(3)
    a, b, c = rng.standard_normal((3, 4)), rng.standard_normal((1, 4)), rng.uniform(1, 2, (3, 1))

    def reference(torch):
        tx, ty, tz = (torch.tensor(v, requires_grad=True) for v in (a, b, c))
        out = {}
        for name in ("addcmul", "addcdiv"):
            tout = getattr(torch, name)(tx, ty, tz, value=0.7)
            out[name] = (tout.detach(), torch.autograd.grad(tout.sum(), [tx, ty, tz]))
        out["method_addcmul"] = tx.addcmul(ty, tz).detach()
        out["method_addcdiv"] = tx.addcdiv(ty, tz, value=2).detach()
        return out

    want = torch_ref("addcmul_addcdiv", reference, a=a, b=b, c=c)
    x, y, z = (ag.tensor(v, dtype=ag.float64, requires_grad=True) for v in (a, b, c))
    for name in ("addcmul", "addcdiv"):
        out = getattr(ag, name)(x, y, z, value=0.7)
        tout, tgs = want[name]
        np.testing.assert_allclose(out.numpy(), tout, rtol=1e-15)
        gs = await ag.grad(out.sum(), [x, y, z])
        for g, tg in zip(gs, tgs):
            np.testing.assert_allclose(g.numpy(), tg, rtol=1e-14)
    np.testing.assert_allclose(x.addcmul(y, z).numpy(), want["method_addcmul"], rtol=1e-15)
    np.testing.assert_allclose(x.addcdiv(y, z, value=2).numpy(), want["method_addcdiv"], rtol=1e-15)
    assert await ag.autograd.gradcheck(lambda p, q, r: ag.addcmul(p, q, r, value=-1.5), [a, b, c], rtol=1e-4)
    assert await ag.autograd.gradcheck(lambda p, q, r: ag.addcdiv(p, q, r, value=0.5), [a, b, c], rtol=1e-4)
    assert await ag.autograd.gradgradcheck(lambda p, q, r: ag.addcdiv(p, q, r, value=0.5), [a, b, c], rtol=1e-4)


# ---- comparisons as methods and functions -----------------------------------------------------------------


async def test_comparison_methods_match_torch(rt: ag.Runtime, torch_ref) -> None:
    a = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    b = np.array([2.0, 2.0, 2.0])
    names = ("eq", "ne", "lt", "le", "gt", "ge", "greater", "greater_equal", "less", "less_equal", "not_equal")

    def reference(torch):
        tx, ty = torch.tensor(a), torch.tensor(b)
        return {
            name: [(getattr(tx, name)(tother), getattr(torch, name)(tx, tother)) for tother in (ty, 2.0)]
            for name in names
        }

    want = torch_ref("comparisons", reference, a=a, b=b)
    x, y = ag.tensor(a, dtype=ag.float64), ag.tensor(b, dtype=ag.float64)
    for name in names:
        for other, (method, function) in zip((y, 2.0), want[name]):
            got = getattr(x, name)(other)
            assert got.dtype == np.bool_
            np.testing.assert_array_equal(got.numpy(), method)
            np.testing.assert_array_equal(getattr(ag, name)(x, other).numpy(), function)
