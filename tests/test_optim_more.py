"""Learning-rate schedulers, gradient clipping, parameter vectors, RMSprop / Adagrad and named
parameters: hard-coded values and formulas here, exact sequences and updates against PyTorch."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn, optim
from asyncgrad.optim import lr_scheduler
from tests._util import set_inline_limit


@pytest.fixture(params=["inline", "queued"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "queued":
        set_inline_limit(monkeypatch, -1)
    return str(request.param)


# ---- schedulers: hard-coded sequences ---------------------------------------------------------------


def _sgd(lr: float = 1.0, **kw: object) -> optim.SGD:
    return optim.SGD([ag.zeros(2, requires_grad=True)], lr=lr, **kw)


def _lrs(sched: lr_scheduler.LRScheduler, n: int) -> list[float]:
    out = [sched.get_last_lr()[0]]
    for _ in range(n):
        sched.optimizer.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


async def test_scheduler_hard_coded_values(rt) -> None:
    o = _sgd()
    s = lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
    assert o.param_groups[0]["initial_lr"] == 1.0 and s.base_lrs == [1.0] and s.last_epoch == 0
    assert _lrs(s, 5) == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    assert s.last_epoch == 5 and o.param_groups[0]["lr"] == 0.25

    assert _lrs(lr_scheduler.MultiStepLR(_sgd(), [1, 3, 3], gamma=0.1), 4) == pytest.approx(
        [1.0, 0.1, 0.1, 0.001, 0.001], rel=1e-15
    )
    assert _lrs(lr_scheduler.ExponentialLR(_sgd(), 0.5), 3) == [1.0, 0.5, 0.25, 0.125]
    cos = _lrs(lr_scheduler.CosineAnnealingLR(_sgd(), T_max=4, eta_min=0.0), 8)
    ref = [(1 + math.cos(math.pi * t / 4)) / 2 for t in range(9)]
    np.testing.assert_allclose(cos, ref, rtol=1e-12, atol=1e-15)
    assert _lrs(lr_scheduler.LambdaLR(_sgd(2.0), lambda e: 1 / (e + 1)), 3) == [2.0, 1.0, 2 / 3, 0.5]
    assert _lrs(lr_scheduler.MultiplicativeLR(_sgd(), lambda e: 0.5), 2) == [1.0, 0.5, 0.25]
    assert _lrs(lr_scheduler.ConstantLR(_sgd(), factor=0.5, total_iters=2), 3) == [0.5, 0.5, 1.0, 1.0]
    lin = _lrs(lr_scheduler.LinearLR(_sgd(), start_factor=0.25, end_factor=1.0, total_iters=3), 4)
    np.testing.assert_allclose(lin, [0.25, 0.5, 0.75, 1.0, 1.0], rtol=1e-15)
    warm = _lrs(lr_scheduler.CosineAnnealingWarmRestarts(_sgd(), T_0=2, T_mult=2), 6)
    np.testing.assert_allclose(warm, [1.0, 0.5, 1.0, 0.8535533905932737, 0.5, 0.14644660940672627, 1.0])
    o = _sgd(momentum=0.9)
    oc = lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=10, anneal_strategy="linear")
    assert o.param_groups[0]["momentum"] == 0.95 and oc.get_last_lr() == [0.04]
    lrs = _lrs(oc, 9)
    np.testing.assert_allclose(lrs[:3], [0.04, 0.52, 1.0], rtol=1e-12)
    assert lrs[-1] == pytest.approx(4e-6) and o.param_groups[0]["momentum"] == pytest.approx(0.95)
    seq = lr_scheduler.SequentialLR(
        o2 := _sgd(), [lr_scheduler.ConstantLR(o2, 0.1, total_iters=2), lr_scheduler.ExponentialLR(o2, 0.5)], [2]
    )
    np.testing.assert_allclose(_lrs(seq, 4), [0.1, 0.1, 1.0, 0.5, 0.25], rtol=1e-15)


async def test_reduce_lr_on_plateau_hard_coded(rt) -> None:
    o = _sgd()
    s = lr_scheduler.ReduceLROnPlateau(o, patience=1, factor=0.5, cooldown=1, min_lr=0.2)
    lrs = []
    for m in [5.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 3.0]:
        s.step(m)
        lrs.append(s.get_last_lr()[0])
    assert lrs == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25]
    s.step(ag.tensor(4.0))  # a one-element tensor is accepted
    with pytest.raises(ValueError):
        lr_scheduler.ReduceLROnPlateau(o, factor=1.0)
    with pytest.raises(ValueError):
        lr_scheduler.ReduceLROnPlateau(o, mode="avg")


async def test_scheduler_warns_when_stepped_before_optimizer(rt) -> None:
    o = _sgd()
    s = lr_scheduler.StepLR(o, 1)
    with pytest.warns(UserWarning, match="before `optimizer.step"):
        s.step()
    o2 = _sgd()
    s2 = lr_scheduler.StepLR(o2, 1)
    o2.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s2.step()
    with pytest.raises(KeyError):
        lr_scheduler.StepLR(_sgd(), 1, last_epoch=3)  # resuming needs initial_lr in the groups
    with pytest.raises(TypeError):
        lr_scheduler.StepLR(object(), 1)  # type: ignore[arg-type]


async def test_scheduler_state_dict_round_trip(rt) -> None:
    o = _sgd(momentum=0.9)
    s = lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=20)
    for _ in range(7):
        o.step()
        s.step()
    sd = s.state_dict()
    assert "optimizer" not in sd and sd["last_epoch"] == 7
    o2 = _sgd(momentum=0.9)
    o2.load_state_dict(o.state_dict())
    s2 = lr_scheduler.OneCycleLR(o2, max_lr=0.5, total_steps=20)
    s2.load_state_dict(sd)
    for _ in range(10):
        o.step()
        s.step()
        o2.step()
        s2.step()
        assert s.get_last_lr() == s2.get_last_lr()
        assert o.param_groups[0]["momentum"] == o2.param_groups[0]["momentum"]


# ---- schedulers against PyTorch -----------------------------------------------------------------------

SCHEDULERS = {
    "step": lambda m, o: m.StepLR(o, step_size=3, gamma=0.5),
    "step_default": lambda m, o: m.StepLR(o, step_size=7),
    "multistep": lambda m, o: m.MultiStepLR(o, milestones=[2, 5, 5, 11], gamma=0.3),
    "exponential": lambda m, o: m.ExponentialLR(o, gamma=0.87),
    "cosine": lambda m, o: m.CosineAnnealingLR(o, T_max=7, eta_min=0.001),
    "cosine_long": lambda m, o: m.CosineAnnealingLR(o, T_max=10),
    "lambda": lambda m, o: m.LambdaLR(o, lambda e: 0.95**e),
    "lambda_list": lambda m, o: m.LambdaLR(o, [lambda e: 1 / (1 + e), lambda e: 0.9 ** (e // 2)]),
    "multiplicative": lambda m, o: m.MultiplicativeLR(o, lambda e: 0.9 if e % 2 else 0.99),
    "linear": lambda m, o: m.LinearLR(o, start_factor=0.1, total_iters=8),
    "linear_down": lambda m, o: m.LinearLR(o, start_factor=1.0, end_factor=0.05, total_iters=13),
    "constant": lambda m, o: m.ConstantLR(o, factor=0.3, total_iters=4),
    "polynomial": lambda m, o: m.PolynomialLR(o, total_iters=12, power=2.0),
    "onecycle_cos": lambda m, o: m.OneCycleLR(o, max_lr=[0.5, 0.2], total_steps=30),
    "onecycle_linear": lambda m, o: m.OneCycleLR(
        o, max_lr=0.4, epochs=3, steps_per_epoch=10, pct_start=0.25, anneal_strategy="linear"
    ),
    "onecycle_three": lambda m, o: m.OneCycleLR(
        o, max_lr=1.0, total_steps=31, three_phase=True, div_factor=10.0, final_div_factor=100.0
    ),
    "onecycle_nomom": lambda m, o: m.OneCycleLR(o, max_lr=0.3, total_steps=30, cycle_momentum=False),
    "warm_restarts": lambda m, o: m.CosineAnnealingWarmRestarts(o, T_0=4),
    "warm_restarts_mult": lambda m, o: m.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=0.01),
    "sequential": lambda m, o: m.SequentialLR(
        o, [m.LinearLR(o, start_factor=0.2, total_iters=5), m.CosineAnnealingLR(o, T_max=12)], milestones=[6]
    ),
    "sequential3": lambda m, o: m.SequentialLR(
        o,
        [m.ConstantLR(o, factor=0.5, total_iters=3), m.ExponentialLR(o, 0.9), m.StepLR(o, 4, 0.5)],
        milestones=[4, 15],
    ),
    "chained": lambda m, o: m.ChainedScheduler([m.ConstantLR(o, 0.5, total_iters=4), m.ExponentialLR(o, 0.9)]),
    "cyclic": lambda m, o: m.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=4, mode="triangular2"),
    "cyclic_exp": lambda m, o: m.CyclicLR(
        o, 0.01, [0.2, 0.1], step_size_up=3, step_size_down=5, mode="exp_range", gamma=0.97
    ),
}


def _opt_pair(torch, kind: str):
    """The same two-group optimizer in PyTorch and here (lr 0.1 and 0.05)."""
    tp = [torch.zeros(3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    ap = [ag.zeros(3, dtype=np.float64, requires_grad=True) for _ in range(2)]

    def groups(ps):
        return [{"params": [ps[0]]}, {"params": [ps[1]], "lr": 0.05}]

    if kind == "sgd":
        return torch.optim.SGD(groups(tp), lr=0.1, momentum=0.9), optim.SGD(groups(ap), lr=0.1, momentum=0.9)
    return torch.optim.Adam(groups(tp), lr=0.1), optim.Adam(groups(ap), lr=0.1)


def _hyper(opt) -> list[tuple]:
    return [(g["lr"], g.get("momentum"), tuple(g["betas"]) if "betas" in g else None) for g in opt.param_groups]


# PyTorch's step() computes these schedules in closed form too, so they agree exactly; the others it
# computes by a recurrence (lr_t from lr_{t-1}), which rounds differently from our closed forms: they
# agree to an ulp or a few (cosine's recurrence drifts to ~1e-14), hence rel=1e-12 there.
TORCH_CLOSED_FORM = {"lambda", "lambda_list", "warm_restarts", "warm_restarts_mult", "cyclic", "cyclic_exp"}
TORCH_CLOSED_FORM |= {n for n in SCHEDULERS if n.startswith("onecycle")}


def _flat(rows: list[tuple]) -> list[float | None]:
    return [x for row in rows for v in row for x in (v if isinstance(v, tuple) else (v,))]


def _same(ours: list, theirs: list, exact: bool) -> bool:
    return ours == theirs if exact else ours == pytest.approx(theirs, rel=1e-12)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
async def test_scheduler_sequences_match_torch(rt, name: str, kind: str) -> None:
    torch = pytest.importorskip("torch")
    make = SCHEDULERS[name]
    topt, aopt = _opt_pair(torch, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = make(torch.optim.lr_scheduler, topt)
        ag_s = make(lr_scheduler, aopt)
        exact = name in TORCH_CLOSED_FORM
        assert _same(ag_s.get_last_lr(), ts.get_last_lr(), exact)
        assert _same(_flat(_hyper(aopt)), _flat(_hyper(topt)), exact)
        for _ in range(30):
            topt.step()
            aopt.step()
            ts.step()
            ag_s.step()
            assert _same(ag_s.get_last_lr(), ts.get_last_lr(), exact)
            assert _same(_flat(_hyper(aopt)), _flat(_hyper(topt)), exact)
            assert getattr(ag_s, "last_epoch", None) == getattr(ts, "last_epoch", None)
        if hasattr(ts, "base_lrs"):
            assert ag_s.base_lrs == ts.base_lrs
        assert [g["initial_lr"] for g in aopt.param_groups] == [g["initial_lr"] for g in topt.param_groups]


@pytest.mark.parametrize("name", ["step", "multistep", "exponential", "cosine", "linear", "constant", "polynomial"])
async def test_scheduler_closed_form_step_epoch_matches_torch(rt, name: str) -> None:
    torch = pytest.importorskip("torch")
    topt, aopt = _opt_pair(torch, "sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = SCHEDULERS[name](torch.optim.lr_scheduler, topt)
        ag_s = SCHEDULERS[name](lr_scheduler, aopt)
        for e in [3, 1, 8, 8, 20, 4]:
            ts.step(e)
            ag_s.step(e)
            assert ag_s.get_last_lr() == ts.get_last_lr()
    w = ag_s
    with pytest.warns(UserWarning, match="epoch parameter"):
        w.step(2)


async def test_warm_restarts_fractional_epochs_match_torch(rt) -> None:
    torch = pytest.importorskip("torch")
    topt, aopt = _opt_pair(torch, "sgd")
    ts = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(topt, T_0=3, T_mult=2)
    ag_s = lr_scheduler.CosineAnnealingWarmRestarts(aopt, T_0=3, T_mult=2)
    for e in [0.5, 1.25, 2.9, 3.0, 7.5, 10.1, 21.0, 4.0]:
        ts.step(e)
        ag_s.step(e)
        assert ag_s.get_last_lr() == ts.get_last_lr()
        assert ag_s.T_cur == ts.T_cur and ag_s.T_i == ts.T_i


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"mode": "max", "patience": 2, "factor": 0.5},
        {"threshold_mode": "abs", "threshold": 0.05, "patience": 0, "cooldown": 2},
        {"mode": "max", "threshold_mode": "abs", "threshold": 0.1, "patience": 1, "min_lr": [0.02, 0.01]},
        {"patience": 1, "factor": 0.5, "min_lr": 0.03, "eps": 0.02},
    ],
)
async def test_reduce_lr_on_plateau_matches_torch(rt, kw: dict) -> None:
    torch = pytest.importorskip("torch")
    topt, aopt = _opt_pair(torch, "sgd")
    ts = torch.optim.lr_scheduler.ReduceLROnPlateau(topt, **kw)
    ag_s = lr_scheduler.ReduceLROnPlateau(aopt, **kw)
    rng = np.random.default_rng(5)
    metrics = np.concatenate([np.linspace(3, 1, 8), np.full(10, 1.0), 1 + 0.04 * rng.standard_normal(30)])
    for m in metrics:
        ts.step(float(m))
        ag_s.step(float(m))
        assert ag_s.get_last_lr() == ts.get_last_lr()
        assert (ag_s.num_bad_epochs, ag_s.cooldown_counter) == (ts.num_bad_epochs, ts.cooldown_counter)
        assert ag_s.best == ts.best


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
async def test_clip_grad_matches_torch(rt, norm_type: float) -> None:
    torch = pytest.importorskip("torch")
    ps, vals, grads = _params_with_grads(np.random.default_rng(6))
    tps = [torch.tensor(v, requires_grad=True) for v in vals]
    for tp, g in zip(tps[:2], grads[:2]):
        tp.grad = torch.tensor(g)
    tt = torch.nn.utils.clip_grad_norm_(tps, 2.0, norm_type=norm_type)
    at = nn.utils.clip_grad_norm_(ps, 2.0, norm_type=norm_type)
    assert at.item() == pytest.approx(tt.item(), rel=1e-13)
    for p, tp in zip(ps[:2], tps[:2]):
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), rtol=1e-13)
    torch.nn.utils.clip_grad_value_(tps, 0.3)
    nn.utils.clip_grad_value_(ps, 0.3)
    for p, tp in zip(ps[:2], tps[:2]):
        np.testing.assert_array_equal(p.grad.numpy(), tp.grad.numpy())


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


# ---- RMSprop and Adagrad --------------------------------------------------------------------------

P0 = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.5]])
GRADS = [
    np.array([[0.5, -1.0, 2.0], [0.25, 0.0, -3.0]]),
    np.array([[1.0, 1.0, -0.5], [2.0, -2.0, 0.1]]),
    np.array([[-0.3, 0.7, 0.0], [1.5, 0.2, -0.9]]),
]


def _rmsprop_ref(lr=1e-2, alpha=0.99, eps=1e-8, wd=0.0, momentum=0.0, centered=False, maximize=False, steps=5):
    p, v, m, b, out = P0.copy(), np.zeros_like(P0), np.zeros_like(P0), np.zeros_like(P0), []
    for i in range(steps):
        g = -GRADS[i % 3] if maximize else GRADS[i % 3]
        g = g + wd * p
        v = alpha * v + (1 - alpha) * g * g
        if centered:
            m = alpha * m + (1 - alpha) * g
            avg = np.sqrt(v - m * m) + eps
        else:
            avg = np.sqrt(v) + eps
        if momentum > 0:
            b = momentum * b + g / avg
            p = p - lr * b
        else:
            p = p - lr * g / avg
        out.append(p.copy())
    return out


def _adagrad_ref(lr=1e-2, lr_decay=0.0, wd=0.0, init=0.0, eps=1e-10, maximize=False, steps=5):
    p, s, out = P0.copy(), np.full_like(P0, init), []
    for t in range(1, steps + 1):
        g = -GRADS[(t - 1) % 3] if maximize else GRADS[(t - 1) % 3]
        g = g + wd * p
        s = s + g * g
        p = p - lr / (1 + (t - 1) * lr_decay) * g / (np.sqrt(s) + eps)
        out.append(p.copy())
    return out


async def _run(opt_fn, steps: int = 5, fortran: bool = False) -> list[np.ndarray]:
    arr = np.asfortranarray(P0) if fortran else P0.copy()
    p = ag.from_numpy(arr).requires_grad_()
    opt = opt_fn([p])
    out = []
    for i in range(steps):
        p.grad = ag.from_numpy(np.asfortranarray(GRADS[i % 3]) if fortran else GRADS[i % 3].copy())
        opt.step()
        out.append(np.array(p.numpy(), copy=True))
    if fortran:
        assert p.numpy().flags.f_contiguous
        for v in opt.state[p].values():
            if isinstance(v, ag.Tensor):
                assert v.strides == p.strides
    return out


RMS_CASES = [
    {},
    {"lr": 0.05, "alpha": 0.9},
    {"lr": 0.01, "weight_decay": 0.1},
    {"lr": 0.02, "momentum": 0.9},
    {"lr": 0.02, "centered": True},
    {"lr": 0.03, "alpha": 0.8, "eps": 1e-3, "momentum": 0.5, "centered": True, "weight_decay": 0.05},
    {"lr": 0.01, "maximize": True, "momentum": 0.3},
]
ADAGRAD_CASES = [
    {},
    {"lr": 0.1, "lr_decay": 0.05},
    {"lr": 0.05, "weight_decay": 0.1, "initial_accumulator_value": 0.5},
    {"lr": 0.2, "eps": 1e-3, "maximize": True},
]


def _ref_kw(kw: dict, names: dict) -> dict:
    return {names.get(k, k): v for k, v in kw.items()}


@pytest.mark.parametrize("kw", RMS_CASES)
async def test_rmsprop_matches_formula(kw: dict, mode: str) -> None:
    async with ag.open_runtime():
        got = await _run(lambda ps: optim.RMSprop(ps, **kw), fortran=mode == "queued")
    ref = _rmsprop_ref(**_ref_kw(kw, {"weight_decay": "wd"}))
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kw", ADAGRAD_CASES)
async def test_adagrad_matches_formula(kw: dict, mode: str) -> None:
    async with ag.open_runtime():
        got = await _run(lambda ps: optim.Adagrad(ps, **kw), fortran=mode == "queued")
    ref = _adagrad_ref(**_ref_kw(kw, {"weight_decay": "wd", "initial_accumulator_value": "init"}))
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


async def test_rmsprop_adagrad_hard_coded(rt) -> None:
    # first step of RMSprop: v = (1 - alpha) g^2, p -= lr g / (sqrt(v) + eps) = lr sign(g) / sqrt(1 - alpha)
    p = ag.tensor([1.0, -1.0], dtype=np.float64, requires_grad=True)
    opt = optim.RMSprop([p], lr=0.01, alpha=0.75, eps=0.0)
    p.grad = ag.tensor([2.0, -8.0], dtype=np.float64)
    opt.step()
    np.testing.assert_allclose(p.numpy(), [0.98, -0.98], rtol=1e-15)
    # Adagrad: s = init + g^2, p -= lr g / sqrt(s)
    q = ag.tensor([0.0], dtype=np.float64, requires_grad=True)
    opt2 = optim.Adagrad([q], lr=0.5, initial_accumulator_value=7.0, eps=0.0)
    assert opt2.state_dict()["state"][0]["step"] == 0  # state exists before the first step, as PyTorch
    q.grad = ag.tensor([3.0], dtype=np.float64)
    opt2.step()
    assert q.item() == pytest.approx(-0.5 * 3 / 4)
    with pytest.raises(ValueError):
        optim.RMSprop([p], alpha=-0.1)
    with pytest.raises(ValueError):
        optim.Adagrad([p], lr_decay=-1.0)
    with pytest.raises(ValueError):
        optim.Adagrad([p], initial_accumulator_value=-1.0)


def _torch_pair(torch, cls_name: str, kw: dict, fortran: bool):
    arr = np.asfortranarray(P0) if fortran else P0.copy()
    ap = ag.from_numpy(arr.copy(order="K")).requires_grad_()
    tp = torch.tensor(P0, dtype=torch.float64, requires_grad=True)
    return ap, tp, getattr(optim, cls_name)([ap], **kw), getattr(torch.optim, cls_name)([tp], **kw)


@pytest.mark.parametrize(
    "cls_name,kw", [("RMSprop", kw) for kw in RMS_CASES] + [("Adagrad", kw) for kw in ADAGRAD_CASES]
)
async def test_rmsprop_adagrad_match_torch(cls_name: str, kw: dict, mode: str) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        ap, tp, aopt, topt = _torch_pair(torch, cls_name, kw, fortran=mode == "queued")
        for i in range(6):
            g = GRADS[i % 3]
            ap.grad = ag.tensor(g)
            tp.grad = torch.tensor(g)
            aopt.step()
            topt.step()
            # PyTorch's CPU kernels fuse multiply-adds (addcmul, add with alpha) where the CPU has FMA;
            # numpy rounds twice, so the same formulas differ by an ulp here and there
            np.testing.assert_allclose(ap.numpy(), tp.detach().numpy(), rtol=1e-14, atol=1e-15)
            if i == 2:  # a state-dict round trip mid-way: continue with a fresh optimizer
                sd = aopt.state_dict()
                tsd = topt.state_dict()
                assert set(sd["state"][0]) == set(tsd["state"][0])
                for k, v in tsd["state"][0].items():
                    np.testing.assert_allclose(np.asarray(sd["state"][0][k]), v.numpy(), rtol=1e-14, atol=1e-15)
                aopt = getattr(optim, cls_name)([ap], **kw)
                aopt.load_state_dict(sd)
                for k, v in aopt.state[ap].items():
                    if isinstance(v, ag.Tensor):
                        assert v.strides == ap.strides, k


# ---- named parameters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cls_name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad"])
async def test_optimizers_accept_named_parameters(rt, cls_name: str) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    names = [n for n, _ in model.named_parameters()]
    opt = getattr(optim, cls_name)(model.named_parameters(), lr=0.01)
    assert opt.param_groups[0]["param_names"] == names
    assert opt.param_groups[0]["params"] == list(model.parameters())
    x = ag.tensor(np.ones((5, 3)), dtype="float32")
    await model(x).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == names
    opt2 = getattr(optim, cls_name)(model.named_parameters(), lr=0.01)
    opt2.load_state_dict(sd)
    # groups of named parameters, and mixing named / unnamed is an error (as PyTorch)
    named = list(model.named_parameters())
    opt3 = optim.SGD([{"params": named[:2]}, {"params": named[2:], "lr": 0.5}], lr=0.1)
    assert opt3.param_groups[1]["param_names"] == names[2:]
    with pytest.raises(ValueError, match="with/without names"):
        optim.SGD([named[0], named[1][1]], lr=0.1)
    with pytest.raises(ValueError, match="with/without names"):
        optim.SGD([{"params": named[:2]}, {"params": [named[2][1]]}], lr=0.1)


async def test_named_parameters_match_torch_state_dict(rt) -> None:
    torch = pytest.importorskip("torch")
    tm = torch.nn.Linear(3, 2)
    ts = torch.optim.SGD(tm.named_parameters(), lr=0.1).state_dict()
    m = nn.Linear(3, 2)
    s = optim.SGD(m.named_parameters(), lr=0.1).state_dict()
    assert s["param_groups"][0]["param_names"] == ts["param_groups"][0]["param_names"] == ["weight", "bias"]
    assert s["param_groups"][0]["params"] == ts["param_groups"][0]["params"]
