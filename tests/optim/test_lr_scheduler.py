"""The learning-rate schedulers (``optim/lr_scheduler.py``): hard-coded sequences, state dicts, warnings,
and every scheduler's sequence against PyTorch's.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import optim
from asyncgrad.optim import lr_scheduler

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


def _groups(ps):
    return [{"params": [ps[0]]}, {"params": [ps[1]], "lr": 0.05}]


def _ag_opt(kind: str):
    """A two-group optimizer (lr 0.1 and 0.05); ``_torch_opt`` is the same in PyTorch."""
    ap = [ag.zeros(3, dtype=np.float64, requires_grad=True) for _ in range(2)]
    if kind == "sgd":
        return optim.SGD(_groups(ap), lr=0.1, momentum=0.9)
    return optim.Adam(_groups(ap), lr=0.1)


def _torch_opt(torch, kind: str):
    tp = [torch.zeros(3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    if kind == "sgd":
        return torch.optim.SGD(_groups(tp), lr=0.1, momentum=0.9)
    return torch.optim.Adam(_groups(tp), lr=0.1)


def _hyper(opt) -> list[tuple]:
    return [(g["lr"], g.get("momentum"), tuple(g["betas"]) if "betas" in g else None) for g in opt.param_groups]


# PyTorch's step() computes these schedules in closed form too, so they agree exactly; the others it
# computes by a recurrence (lr_t from lr_{t-1}), which rounds differently from our closed forms: they
# agree to an ulp or a few (cosine's recurrence drifts to ~1e-14), hence rel=1e-12 there.
TORCH_CLOSED_FORM = {"lambda", "lambda_list", "warm_restarts", "warm_restarts_mult", "cyclic", "cyclic_exp"}


def _flat(rows: list[tuple]) -> list[float | None]:
    return [x for row in rows for v in row for x in (v if isinstance(v, tuple) else (v,))]


def _same(ours: list, theirs: list, exact: bool) -> bool:
    if exact:
        return ours == theirs
    # None (a hyper-parameter the optimizer lacks) compares exactly: pytest >= 9.2's approx rejects it
    return len(ours) == len(theirs) and all(
        o == t if o is None or t is None else o == pytest.approx(t, rel=1e-12) for o, t in zip(ours, theirs)
    )


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


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
async def test_scheduler_sequences_match_torch(rt, torch_ref, name: str, kind: str) -> None:
    make = SCHEDULERS[name]

    def reference(torch):
        topt = _torch_opt(torch, kind)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ts = make(torch.optim.lr_scheduler, topt)
            steps = [(ts.get_last_lr(), _flat(_hyper(topt)), None)]
            for _ in range(30):
                topt.step()
                ts.step()
                steps.append((ts.get_last_lr(), _flat(_hyper(topt)), getattr(ts, "last_epoch", None)))
        return {
            "steps": steps,
            "base_lrs": ts.base_lrs if hasattr(ts, "base_lrs") else None,
            "initial_lrs": [g["initial_lr"] for g in topt.param_groups],
        }

    want = torch_ref("sequence", reference, name=name, kind=kind)
    aopt = _ag_opt(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ag_s = make(lr_scheduler, aopt)
        exact = name in TORCH_CLOSED_FORM
        (lrs, hyper, _), *steps = want["steps"]
        assert _same(ag_s.get_last_lr(), lrs, exact)
        assert _same(_flat(_hyper(aopt)), hyper, exact)
        assert len(steps) == 30
        for lrs, hyper, last_epoch in steps:
            aopt.step()
            ag_s.step()
            assert _same(ag_s.get_last_lr(), lrs, exact)
            assert _same(_flat(_hyper(aopt)), hyper, exact)
            assert getattr(ag_s, "last_epoch", None) == last_epoch
        if want["base_lrs"] is not None:
            assert ag_s.base_lrs == want["base_lrs"]
        assert [g["initial_lr"] for g in aopt.param_groups] == want["initial_lrs"]


STEP_EPOCHS = [3, 1, 8, 8, 20, 4]


@pytest.mark.parametrize("name", ["step", "multistep", "exponential", "cosine", "linear", "constant", "polynomial"])
async def test_scheduler_closed_form_step_epoch_matches_torch(rt, torch_ref, name: str) -> None:
    def reference(torch):
        topt = _torch_opt(torch, "sgd")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ts = SCHEDULERS[name](torch.optim.lr_scheduler, topt)
            lrs = []
            for e in STEP_EPOCHS:
                ts.step(e)
                lrs.append(ts.get_last_lr())
        return lrs

    want = torch_ref("step_epoch", reference, name=name, epochs=STEP_EPOCHS)
    aopt = _ag_opt("sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ag_s = SCHEDULERS[name](lr_scheduler, aopt)
        for e, lrs in zip(STEP_EPOCHS, want, strict=True):
            ag_s.step(e)
            assert ag_s.get_last_lr() == lrs
    w = ag_s
    with pytest.warns(UserWarning, match="epoch parameter"):
        w.step(2)


WARM_EPOCHS = [0.5, 1.25, 2.9, 3.0, 7.5, 10.1, 21.0, 4.0]


async def test_warm_restarts_fractional_epochs_match_torch(rt, torch_ref) -> None:
    def reference(torch):
        topt = _torch_opt(torch, "sgd")
        ts = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(topt, T_0=3, T_mult=2)
        out = []
        for e in WARM_EPOCHS:
            ts.step(e)
            out.append((ts.get_last_lr(), ts.T_cur, ts.T_i))
        return out

    want = torch_ref("warm_restarts", reference, epochs=WARM_EPOCHS)
    ag_s = lr_scheduler.CosineAnnealingWarmRestarts(_ag_opt("sgd"), T_0=3, T_mult=2)
    for e, (lrs, t_cur, t_i) in zip(WARM_EPOCHS, want, strict=True):
        ag_s.step(e)
        assert ag_s.get_last_lr() == lrs
        assert ag_s.T_cur == t_cur and ag_s.T_i == t_i


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
async def test_reduce_lr_on_plateau_matches_torch(rt, torch_ref, kw: dict) -> None:
    rng = np.random.default_rng(5)
    metrics = np.concatenate([np.linspace(3, 1, 8), np.full(10, 1.0), 1 + 0.04 * rng.standard_normal(30)])

    def reference(torch):
        ts = torch.optim.lr_scheduler.ReduceLROnPlateau(_torch_opt(torch, "sgd"), **kw)
        out = []
        for m in metrics:
            ts.step(float(m))
            out.append((ts.get_last_lr(), ts.num_bad_epochs, ts.cooldown_counter, ts.best))
        return out

    want = torch_ref("plateau", reference, kw=kw, metrics=metrics)
    ag_s = lr_scheduler.ReduceLROnPlateau(_ag_opt("sgd"), **kw)
    for m, (lrs, bad, cooldown, best) in zip(metrics, want, strict=True):
        ag_s.step(float(m))
        assert ag_s.get_last_lr() == lrs
        assert (ag_s.num_bad_epochs, ag_s.cooldown_counter) == (bad, cooldown)
        assert ag_s.best == best
