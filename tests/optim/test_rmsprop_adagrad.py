"""RMSprop and Adagrad (``optim/_rmsprop.py``, ``optim/_adagrad.py``) against their formulas and PyTorch,
inline and queued.
"""

from __future__ import annotations

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import optim
from tests._util import set_inline_limit


@pytest.fixture(params=["inline", "queued"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "queued":
        set_inline_limit(monkeypatch, -1)
    return str(request.param)


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


def _ag_pair(cls_name: str, kw: dict, fortran: bool):
    arr = np.asfortranarray(P0) if fortran else P0.copy()
    ap = ag.from_numpy(arr.copy(order="K")).requires_grad_()
    return ap, getattr(optim, cls_name)([ap], **kw)


def _torch_steps(torch, cls_name: str, kw: dict) -> dict:
    """PyTorch's parameter after each of 6 steps on GRADS, and its state dict's state after the third."""
    tp = torch.tensor(P0, dtype=torch.float64, requires_grad=True)
    topt = getattr(torch.optim, cls_name)([tp], **kw)
    params, state = [], {}
    for i in range(6):
        tp.grad = torch.tensor(GRADS[i % 3])
        topt.step()
        params.append(tp.detach().clone())
        if i == 2:
            state = {k: v.clone() for k, v in topt.state_dict()["state"][0].items()}
    return {"params": params, "state": state}


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


@pytest.mark.parametrize(
    "cls_name,kw", [("RMSprop", kw) for kw in RMS_CASES] + [("Adagrad", kw) for kw in ADAGRAD_CASES]
)
async def test_rmsprop_adagrad_match_torch(torch_ref, cls_name: str, kw: dict, mode: str) -> None:
    want = torch_ref(
        "steps", lambda torch: _torch_steps(torch, cls_name, kw), cls_name=cls_name, kw=kw, p0=P0, grads=GRADS
    )
    async with ag.open_runtime():
        ap, aopt = _ag_pair(cls_name, kw, fortran=mode == "queued")
        for i in range(6):
            g = GRADS[i % 3]
            ap.grad = ag.tensor(g)
            aopt.step()
            # PyTorch's CPU kernels fuse multiply-adds (addcmul, add with alpha) where the CPU has FMA;
            # numpy rounds twice, so the same formulas differ by an ulp here and there
            np.testing.assert_allclose(ap.numpy(), want["params"][i], rtol=1e-14, atol=1e-15)
            if i == 2:  # a state-dict round trip mid-way: continue with a fresh optimizer
                sd = aopt.state_dict()
                tsd_state = want["state"]
                assert set(sd["state"][0]) == set(tsd_state)
                for k, v in tsd_state.items():
                    np.testing.assert_allclose(np.asarray(sd["state"][0][k]), v, rtol=1e-14, atol=1e-15)
                aopt = getattr(optim, cls_name)([ap], **kw)
                aopt.load_state_dict(sd)
                for k, v in aopt.state[ap].items():
                    if isinstance(v, ag.Tensor):
                        assert v.strides == ap.strides, k
