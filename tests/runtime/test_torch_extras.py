"""Small ops PyTorch programs use: unfold, addcmul/addcdiv (+ in place), multinomial, comparison methods,
and state_dict values as Tensors (issue 20, part 2). Values against torch in float64, gradients against
central differences."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn

torch = pytest.importorskip("torch")


def _t(a: np.ndarray, rg: bool = False) -> tuple[ag.Tensor, Any]:
    return ag.tensor(a, dtype=ag.float64, requires_grad=rg), torch.tensor(a, dtype=torch.float64, requires_grad=rg)


# ---- unfold --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dim", "size", "step"),
    [((10,), 0, 3, 2), ((4, 7), 1, 3, 1), ((4, 7), 0, 2, 3), ((2, 5, 6), -1, 6, 1), ((2, 5, 6), 1, 1, 2),
     ((3, 4), 1, 0, 1)],
)
async def test_unfold_matches_torch(rt: ag.Runtime, shape: tuple, dim: int, size: int, step: int) -> None:
    a = np.random.default_rng(0).standard_normal(shape)
    x, tx = _t(a, True)
    y, ty = x.unfold(dim, size, step), tx.unfold(dim, size, step)
    assert y.shape == tuple(ty.shape)
    np.testing.assert_array_equal(y.numpy(), ty.detach().numpy())
    w = np.random.default_rng(1).standard_normal(y.shape)
    (g,) = await ag.grad((y * ag.tensor(w)).sum(), [x])
    (tg,) = torch.autograd.grad((ty * torch.tensor(w)).sum(), [tx])
    np.testing.assert_allclose(g.numpy(), tg.numpy(), rtol=1e-14, atol=1e-14)


async def test_unfold_gradients_by_finite_differences(rt: ag.Runtime) -> None:
    a = np.random.default_rng(2).standard_normal((3, 8))
    assert await ag.autograd.gradcheck(lambda x: x.unfold(1, 3, 2) ** 2, [a], rtol=1e-4)
    assert await ag.autograd.gradgradcheck(lambda x: x.unfold(1, 3, 2) ** 2, [a], rtol=1e-4)
    assert await ag.autograd.gradgradcheck(lambda x: ag.unfold(x * x, 0, 2, 1), [a], rtol=1e-4)


async def test_unfold_errors(rt: ag.Runtime) -> None:
    x = ag.zeros(2, 5)
    with pytest.raises(ag.OpError, match="maximum size for tensor at dimension 1 is 5 but size is 6"):
        x.unfold(1, 6, 1)
    with pytest.raises(ag.OpError, match="step is 0 but must be > 0"):
        x.unfold(1, 2, 0)
    with pytest.raises(ag.OpError, match="dim 2 is out of range"):
        x.unfold(2, 2, 1)


# ---- addcmul / addcdiv ---------------------------------------------------------------------------------------


async def test_addcmul_addcdiv_match_torch_and_finite_differences(rt: ag.Runtime) -> None:
    rng = np.random.default_rng(3)
    a, b, c = rng.standard_normal((3, 4)), rng.standard_normal((1, 4)), rng.uniform(1, 2, (3, 1))
    (x, tx), (y, ty), (z, tz) = _t(a, True), _t(b, True), _t(c, True)
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


async def test_inplace_addcmul_addcdiv(rt: ag.Runtime) -> None:
    rng = np.random.default_rng(4)
    a, b, c = rng.standard_normal((3, 4)), rng.standard_normal(4), rng.uniform(1, 2, (3, 4))
    (x, tx), (y, ty), (z, tz) = _t(a), _t(b), _t(c)
    assert x.addcmul_(y, z, value=0.3) is x
    tx.addcmul_(ty, tz, value=0.3)
    x.addcdiv_(y, z, value=-2)
    tx.addcdiv_(ty, tz, value=-2)
    np.testing.assert_allclose(x.numpy(), tx.numpy(), rtol=1e-15)
    p = ag.tensor(a, requires_grad=True)
    with pytest.raises(RuntimeError, match="in-place addcmul_ on a tensor that requires grad"):
        p.addcmul_(y, z)
    with pytest.raises(RuntimeError, match="integer division with addcdiv is no longer supported"):
        ag.addcdiv(x, ag.ones(4, dtype=ag.int64), ag.ones(4, dtype=ag.int64))


# ---- comparisons as methods and functions -----------------------------------------------------------------


async def test_comparison_methods_match_torch(rt: ag.Runtime) -> None:
    a = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    b = np.array([2.0, 2.0, 2.0])
    x, tx = _t(a)
    y, ty = _t(b)
    for name in ("eq", "ne", "lt", "le", "gt", "ge", "greater", "greater_equal", "less", "less_equal", "not_equal"):
        for other, tother in ((y, ty), (2.0, 2.0)):
            got = getattr(x, name)(other)
            want = getattr(tx, name)(tother)
            assert got.dtype == np.bool_
            np.testing.assert_array_equal(got.numpy(), want.numpy())
            np.testing.assert_array_equal(getattr(ag, name)(x, other).numpy(), getattr(torch, name)(tx, tother).numpy())


# ---- multinomial ---------------------------------------------------------------------------------------------


async def test_multinomial_semantics(rt: ag.Runtime) -> None:
    w = ag.tensor([0.0, 1.0, 3.0, 0.0, 6.0], dtype=ag.float64)
    g = np.random.default_rng(0)
    s = ag.multinomial(w, 20000, replacement=True, generator=g)
    assert s.dtype == np.int64 and s.shape == (20000,)
    counts = np.bincount(s.numpy(), minlength=5) / 20000
    assert counts[0] == 0 and counts[3] == 0  # zero weight: never drawn (as in torch)
    np.testing.assert_allclose(counts, [0, 0.1, 0.3, 0, 0.6], atol=0.015)
    tw = torch.tensor([0.0, 1.0, 3.0, 0.0, 6.0], dtype=torch.float64)
    assert tuple(torch.multinomial(tw, 3).shape) == ag.multinomial(w, 3, generator=g).shape
    rows = ag.tensor(np.random.default_rng(1).uniform(0.1, 1, (4, 6)))
    no_rep = rows.multinomial(6, generator=g)
    assert no_rep.shape == (4, 6)
    assert all(sorted(r) == list(range(6)) for r in no_rep.numpy().tolist())  # a permutation per row
    a1 = ag.multinomial(rows, 3, generator=np.random.default_rng(7)).numpy()
    a2 = ag.multinomial(rows, 3, generator=np.random.default_rng(7)).numpy()
    np.testing.assert_array_equal(a1, a2)  # a seeded generator reproduces
    # without replacement, first draws follow the weights too: P(first = 2) = 3/10
    firsts = [int(ag.multinomial(w, 2, generator=g)[0].item()) for _ in range(3000)]
    assert abs(firsts.count(2) / 3000 - 0.3) < 0.04


async def test_multinomial_errors_as_torch(rt: ag.Runtime) -> None:
    for bad, msg in [
        (ag.tensor([1.0, -1.0]), "element < 0"),
        (ag.tensor([1.0, float("nan")]), "`inf`, `nan` or element < 0"),
        (ag.tensor([0.0, 0.0]), "sum of probabilities <= 0"),
        (ag.zeros(2, 2, 2) + 1, "prob_dist must be 1 or 2 dim"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            ag.multinomial(bad, 1)
    with pytest.raises(RuntimeError, match=r"cannot sample n_sample > prob_dist\.size"):
        ag.multinomial(ag.ones(3), 4)
    with pytest.raises(RuntimeError, match="not enough non-negative category"):
        ag.multinomial(ag.tensor([1.0, 0.0, 0.0]), 2)
    with pytest.raises(RuntimeError, match="only supports floating-point dtypes"):
        ag.multinomial(ag.tensor([1, 2]), 1)
    with pytest.raises(RuntimeError, match="n_sample <= 0"):
        ag.multinomial(ag.ones(3), 0)


# ---- state_dict values ---------------------------------------------------------------------------------------


async def test_state_dict_values_behave_as_torch(rt: ag.Runtime) -> None:
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    tm = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sd, tsd = m.state_dict(), tm.state_dict()
    assert list(sd) == list(tsd)
    for k in sd:
        v, tv = sd[k], tsd[k]
        assert isinstance(v, ag.Tensor) and not v.requires_grad and v.is_leaf
        assert tuple(v.size()) == tuple(tv.size()) and v.dim() == tv.dim()
        c = v.clone()
        assert c is not v and c.shape == v.shape
    w0 = sd["0.weight"].numpy().copy()
    with ag.no_grad():
        m[0].weight.add_(1.0)  # a copy: later updates do not show through
    np.testing.assert_array_equal(sd["0.weight"].numpy(), w0)
    # torch-format state dicts load: plain values, and parameters that require grad (keep_vars=True)
    m.load_state_dict(tm.state_dict())
    m.load_state_dict(tm.state_dict(keep_vars=True))
    np.testing.assert_array_equal(m[0].weight.numpy(), tm[0].weight.detach().numpy())
    # and our values load into torch
    tm.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in m.state_dict().items()})
    # channels-last parameter layouts survive state_dict
    conv = nn.Conv2d(2, 3, 3)
    with ag.no_grad():
        cl = ag.tensor(np.ascontiguousarray(conv.weight.numpy().transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2))
    conv.weight = nn.Parameter(cl)
    assert conv.state_dict()["weight"].stride() == cl.stride()
