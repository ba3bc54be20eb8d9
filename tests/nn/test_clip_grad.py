"""``nn.utils``: clip_grad_norm_/clip_grad_value_ (formula, layouts, pending backward, non-finite norms,
against PyTorch) and parameters_to_vector/vector_to_parameters.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn, optim
from tests._util import set_inline_limit

# ---- clip_grad_norm_, clip_grad_value_, parameter vectors ---------------------------------------------


def _params_with_grads(rng: np.random.Generator):
    """Three parameters (one Fortran-order, one without a grad) with preset gradients."""
    shapes = [(4, 5), (7,), (3, 2)]
    vals = [rng.standard_normal(s) for s in shapes]
    grads = [rng.standard_normal(s) * 3 for s in shapes]
    ps = [ag.from_numpy(np.asfortranarray(vals[0])).requires_grad_(), ag.tensor(vals[1], requires_grad=True)]
    ps.append(ag.tensor(vals[2], requires_grad=True))
    ps[0].grad = ag.from_numpy(np.asfortranarray(grads[0]))
    ps[1].grad = ag.tensor(grads[1])
    return ps, vals, grads


def _norm_ref(grads: list[np.ndarray], p: float) -> float:
    flat = np.concatenate([g.ravel() for g in grads])
    if p == math.inf:
        return float(np.abs(flat).max())
    return float((np.abs(flat) ** p).sum() ** (1 / p))


@pytest.mark.parametrize("norm_type", [2.0, 1, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
async def test_clip_grad_norm_formula_and_layout(rt, norm_type: float, max_norm: float) -> None:
    ps, _, grads = _params_with_grads(np.random.default_rng(3))
    f_strides = ps[0].strides
    total = nn.utils.clip_grad_norm_(ps, max_norm, norm_type=norm_type)
    assert isinstance(total, ag.Tensor) and total.shape == () and total.dtype == np.float64
    ref = _norm_ref(grads[:2], norm_type)
    assert total.item() == pytest.approx(ref, rel=1e-12)
    coef = min(1.0, max_norm / (ref + 1e-6))
    np.testing.assert_allclose(ps[0].grad.numpy(), grads[0] * coef, rtol=1e-12)
    np.testing.assert_allclose(ps[1].grad.numpy(), grads[1] * coef, rtol=1e-12)
    assert ps[0].grad.strides == f_strides and ps[0].grad.numpy().flags.f_contiguous  # the layout contract
    assert ps[2].grad is None


async def test_clip_grad_norm_hard_coded(rt) -> None:
    p = ag.tensor([0.0, 0.0], requires_grad=True)
    p.grad = ag.tensor([3.0, 4.0])
    total = ag.nn.utils.clip_grad_norm_(p, 1.0)
    assert total.item() == pytest.approx(5.0)
    np.testing.assert_allclose(p.grad.numpy(), [3 / (5 + 1e-6), 4 / (5 + 1e-6)], rtol=1e-6)
    assert ag.nn.utils.clip_grad_norm_([], 1.0).item() == 0.0
    with pytest.warns(UserWarning, match="empty generator"):
        ag.nn.utils.clip_grad_norm_((q for q in []), 1.0)
    q = ag.tensor([1.0, 2.0], requires_grad=True)
    q.grad = ag.tensor([-5.0, 0.25])
    ag.nn.utils.clip_grad_value_([q], 0.5)
    assert q.grad.tolist() == [-0.5, 0.25]


async def test_clip_grad_norm_after_pending_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel queued: clipping runs after the backward that produces the grads, and the update
    after the clipping, with no host sync in between."""
    set_inline_limit(monkeypatch, -1)
    rng = np.random.default_rng(4)
    x0 = rng.standard_normal((40, 30))
    w0 = np.asfortranarray(rng.standard_normal((30, 20)))
    async with ag.open_runtime():
        w = ag.from_numpy(w0.copy(order="F")).requires_grad_()
        x = ag.tensor(x0)
        loss = ((x @ w) ** 2).sum()
        await loss.backward()
        total = nn.utils.clip_grad_norm_([w], 0.1)
        opt = optim.SGD([w], lr=1.0)
        opt.step()
        assert w.grad.strides == w.strides
        got_total, got_w, got_g = total.item(), w.numpy().copy(), w.grad.numpy().copy()
    g = x0.T @ (2 * (x0 @ w0))
    n = np.linalg.norm(g)
    assert got_total == pytest.approx(n, rel=1e-12)
    np.testing.assert_allclose(got_g, g * (0.1 / (n + 1e-6)), rtol=1e-12)
    np.testing.assert_allclose(got_w, w0 - g * (0.1 / (n + 1e-6)), rtol=1e-12, atol=1e-15)


async def test_clip_grad_norm_nonfinite(rt) -> None:
    p = ag.tensor([1.0, 2.0], requires_grad=True)
    p.grad = ag.tensor([np.nan, 1.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert np.isnan(nn.utils.clip_grad_norm_([p], 1.0).item())  # scaled by nan, as PyTorch
    assert np.isnan(p.grad.numpy()).all()


async def test_clip_grad_float32(rt) -> None:
    p = ag.tensor(np.ones((3, 3), np.float32), requires_grad=True)
    p.grad = ag.tensor(np.full((3, 3), 2.0, np.float32))
    total = nn.utils.clip_grad_norm_([p], 1.0)
    assert total.dtype == np.float32 and p.grad.dtype == np.float32
    assert total.item() == pytest.approx(6.0)
    np.testing.assert_allclose(p.grad.numpy(), np.float32(2.0) * np.float32(1.0 / (6.0 + 1e-6)), rtol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 0.5, math.inf])
async def test_clip_grad_matches_torch(rt, torch_ref, norm_type: float) -> None:
    ps, vals, grads = _params_with_grads(np.random.default_rng(6))

    def reference(torch):
        tps = [torch.tensor(v, requires_grad=True) for v in vals]
        for tp, g in zip(tps[:2], grads[:2]):
            tp.grad = torch.tensor(g)
        tt = torch.nn.utils.clip_grad_norm_(tps, 2.0, norm_type=norm_type)
        norm_grads = [tp.grad.clone() for tp in tps[:2]]
        torch.nn.utils.clip_grad_value_(tps, 0.3)
        return {"total": tt.item(), "norm_grads": norm_grads, "value_grads": [tp.grad for tp in tps[:2]]}

    want = torch_ref("clip", reference, vals=vals, grads=grads, norm_type=norm_type)
    at = nn.utils.clip_grad_norm_(ps, 2.0, norm_type=norm_type)
    assert at.item() == pytest.approx(want["total"], rel=1e-13)
    for p, tg in zip(ps[:2], want["norm_grads"]):
        np.testing.assert_allclose(p.grad.numpy(), tg, rtol=1e-13)
    nn.utils.clip_grad_value_(ps, 0.3)
    for p, tg in zip(ps[:2], want["value_grads"]):
        np.testing.assert_array_equal(p.grad.numpy(), tg)


async def test_parameters_to_vector_round_trip(rt) -> None:
    rng = np.random.default_rng(7)
    a = ag.from_numpy(np.asfortranarray(rng.standard_normal((3, 4)))).requires_grad_()
    b = ag.tensor(rng.standard_normal(5), requires_grad=True)
    vec = nn.utils.parameters_to_vector([a, b])
    assert vec.shape == (17,)
    np.testing.assert_array_equal(vec.numpy(), np.concatenate([a.numpy().ravel(), b.numpy()]))
    f_strides = a.strides
    new = np.arange(17.0)
    nn.utils.vector_to_parameters(ag.tensor(new), [a, b])
    np.testing.assert_array_equal(a.numpy(), new[:12].reshape(3, 4))
    np.testing.assert_array_equal(b.numpy(), new[12:])
    assert a.strides == f_strides and a.requires_grad
    # differentiable, as PyTorch's
    await (nn.utils.parameters_to_vector([a, b]) ** 2).sum().backward()
    np.testing.assert_array_equal(b.grad.numpy(), 2 * new[12:])
    with pytest.raises(TypeError):
        nn.utils.vector_to_parameters(new, [a])  # type: ignore[arg-type]


async def test_nn_utils_importable() -> None:
    import asyncgrad.nn.utils as u

    assert u.clip_grad_norm_ is ag.nn.utils.clip_grad_norm_
    assert "clip_grad_norm_" in u.__all__ and "utils" in ag.nn.__all__
