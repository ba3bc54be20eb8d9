"""The optimizers ported from torch.optim, 20 steps against torch on the same parameters and gradients
(float64: max relative difference 1e-10), L-BFGS with sync and async closures, and argument errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag

STEPS = 20
RTOL = 1e-10

CASES = [
    ("Adadelta", {}),
    ("Adadelta", {"lr": 0.5, "rho": 0.8, "eps": 1e-5, "weight_decay": 0.1, "maximize": True}),
    ("Adamax", {}),
    ("Adamax", {"lr": 0.05, "betas": (0.8, 0.99), "weight_decay": 0.05, "maximize": True}),
    ("NAdam", {}),
    ("NAdam", {"lr": 0.01, "weight_decay": 0.1, "momentum_decay": 0.01}),
    ("NAdam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True}),
    ("RAdam", {}),
    ("RAdam", {"lr": 0.01, "betas": (0.9, 0.9), "weight_decay": 0.1}),  # rho_t > 5 from step 6: both branches
    ("RAdam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True}),
    ("ASGD", {}),
    ("ASGD", {"lr": 0.05, "lambd": 1e-3, "alpha": 0.5, "t0": 5, "weight_decay": 0.01}),  # averaging from 6
    ("ASGD", {"lr": 0.05, "t0": 3, "maximize": True}),
    ("Rprop", {}),
    ("Rprop", {"lr": 0.1, "etas": (0.3, 1.5), "step_sizes": (1e-3, 0.2), "maximize": True}),
]


def _params(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal((3, 4)), rng.standard_normal(5), np.asfortranarray(rng.standard_normal((4, 2)))]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.fixture
def float64_defaults():  # type: ignore[no-untyped-def]
    # asyncgrad's default here; torch's is set inside the recorded function (_run_both's float64)
    ag.set_default_dtype(ag.float64)
    yield
    ag.set_default_dtype(ag.float32)


def _draws(seed: int) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """The initial parameters and each step's gradients, drawn in the order the steps use them."""
    rng = np.random.default_rng(seed)
    init = _params(rng)
    grads = []
    for _ in range(STEPS):
        step = []
        for a in init:
            g = rng.standard_normal(a.shape)
            if rng.random() < 0.3:
                g = -g  # sign flips: Rprop's both branches
            step.append(g)
        grads.append(step)
    return init, grads


def _torch_steps(torch: Any, name: str, kw: dict, init: list, grads: list, float64: bool) -> dict:
    """torch.optim's parameters after each step, and its final state (tensors and scalars) per parameter."""
    torch.set_default_dtype(torch.float64 if float64 else torch.float32)
    theirs = [torch.tensor(a, requires_grad=True) for a in init]
    topt = getattr(torch.optim, name)(theirs, foreach=False, **kw)
    params = []
    for step in grads:
        for tp, g in zip(theirs, step):
            tp.grad = torch.tensor(g)
        topt.step()
        params.append([tp.detach().clone() for tp in theirs])
    state = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in topt.state[tp].items()} for tp in theirs
    ]
    return {"params": params, "state": state}


def _run_both(torch_ref: Any, name: str, kw: dict, seed: int, float64: bool) -> float:
    init, grads = _draws(seed)
    want = torch_ref(
        "steps",
        lambda torch: _torch_steps(torch, name, kw, init, grads, float64),
        name=name, kw=kw, seed=seed, float64=float64, init=init, grads=grads,
    )
    ours = [ag.tensor(a, requires_grad=True) for a in init]
    opt = getattr(ag.optim, name)(ours, **kw)
    worst = 0.0
    for step, tparams in zip(grads, want["params"], strict=True):
        for p, g in zip(ours, step):
            p.grad = ag.tensor(g)
        opt.step()
        for p, tp in zip(ours, tparams):
            worst = max(worst, _rel(p.numpy(), tp))
    for p, tstate in zip(ours, want["state"]):
        for k, v in tstate.items():
            mine = opt.state[p][k]
            if isinstance(v, np.ndarray) and v.ndim > 0:
                worst = max(worst, _rel(np.asarray(mine), v))
            else:
                assert float(mine) == pytest.approx(float(v), rel=1e-12), (k, mine, v)
    return worst


@pytest.mark.parametrize(("name", "kw"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
async def test_twenty_steps_match_torch(
    rt: ag.Runtime, torch_ref: Any, float64_defaults: None, name: str, kw: dict
) -> None:
    worst = _run_both(torch_ref, name, kw, seed=len(name) + len(kw), float64=True)
    assert worst <= RTOL, f"{name}{kw}: max relative difference {worst:.3g}"


@pytest.mark.parametrize("name", ["ASGD", "NAdam"])
async def test_scalar_state_rounding_as_torch_with_float32_default(rt: ag.Runtime, torch_ref: Any, name: str) -> None:
    # PyTorch keeps ASGD's eta/mu and NAdam's mu_product as float32 scalars under the float32 default
    kw = {"lr": 0.05, "t0": 3} if name == "ASGD" else {"lr": 0.01}
    assert _run_both(torch_ref, name, kw, seed=3, float64=False) <= RTOL


async def test_state_is_a_defaultdict_and_defaults_match_torch(rt: ag.Runtime, torch_ref: Any) -> None:
    names = ("Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "LBFGS")

    def reference(torch: Any) -> dict:
        tp = torch.zeros(2, requires_grad=True)
        return {name: dict(getattr(torch.optim, name)([tp]).defaults) for name in names}

    tdefaults = torch_ref("defaults", reference, names=names)
    p = ag.zeros(2, requires_grad=True)
    for name in names:
        opt = getattr(ag.optim, name)([p])
        for k, v in tdefaults[name].items():
            if k in opt.defaults and k not in ("foreach", "differentiable", "capturable", "fused"):
                assert opt.defaults[k] == (tuple(v) if isinstance(v, list) else v), (name, k)
        q = ag.zeros(3, requires_grad=True)
        assert opt.state[q] == {}  # a new parameter: an empty dict, as PyTorch's defaultdict
    assert isinstance(ag.optim.SGD([p], lr=0.1).state[q], dict)


async def test_bad_arguments(rt: ag.Runtime) -> None:
    p = [ag.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match=r"Invalid rho value: 1\.5"):
        ag.optim.Adadelta(p, rho=1.5)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        ag.optim.Adamax(p, lr=-1)
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: 1\.0"):
        ag.optim.NAdam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid epsilon value"):
        ag.optim.RAdam(p, eps=-1)
    with pytest.raises(ValueError, match="Invalid weight_decay value"):
        ag.optim.ASGD(p, weight_decay=-1)
    with pytest.raises(ValueError, match=r"Invalid eta values: 1\.5, 1\.2"):
        ag.optim.Rprop(p, etas=(1.5, 1.2))
    with pytest.raises(ValueError, match="Invalid momentum_decay value"):
        ag.optim.NAdam(p, momentum_decay=-1)
    with pytest.raises(ValueError, match="capturable=True is not supported"):
        ag.optim.Adadelta(p, capturable=True)
    with pytest.raises(ValueError, match="line_search_fn must be None or 'strong_wolfe'"):
        ag.optim.LBFGS(p, line_search_fn="armijo")
    with pytest.raises(ValueError, match="doesn't support per-parameter options"):
        ag.optim.LBFGS([{"params": p}, {"params": [ag.zeros(1, requires_grad=True)]}])
    with pytest.raises(RuntimeError, match="requires a closure"):
        await ag.optim.LBFGS(p).step()


def _rosen_np(x: np.ndarray) -> float:
    return float(np.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2))


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
@pytest.mark.parametrize("async_closure", [True, False])
async def test_lbfgs_matches_torch(
    rt: ag.Runtime, torch_ref: Any, line_search: str | None, async_closure: bool
) -> None:
    x0 = np.array([-1.2, 1.0, -0.5, 0.8, 1.3])
    w0 = np.array([[0.3, -0.2], [0.1, 0.4]])
    a = ag.tensor(x0, dtype=ag.float64, requires_grad=True)
    w = ag.tensor(w0, dtype=ag.float64, requires_grad=True)
    kw: dict[str, Any] = {"lr": 1, "max_iter": 10, "history_size": 5, "line_search_fn": line_search}
    if line_search is None:
        kw["lr"] = 0.05
    calls = 0

    def f(x, m, lib):  # type: ignore[no-untyped-def]
        r = (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()
        return r + ((m @ m.T) ** 2).sum() + (m.sum() - 1) ** 2

    def reference(torch):  # type: ignore[no-untyped-def]
        ta = torch.tensor(x0, requires_grad=True)
        tw = torch.tensor(w0, requires_grad=True)
        topt = torch.optim.LBFGS([ta, tw], **kw)

        def tclosure():  # type: ignore[no-untyped-def]
            topt.zero_grad()
            loss = f(ta, tw, torch)
            loss.backward()
            return loss

        tlosses = [float(topt.step(tclosure)) for _ in range(4)]
        return {"losses": tlosses, "func_evals": topt.state[ta]["func_evals"], "a": ta.detach(), "w": tw.detach()}

    want = torch_ref("lbfgs", reference, x0=x0, w0=w0, kw=kw)
    opt = ag.optim.LBFGS([a, w], **kw)

    async def aclosure():  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        opt.zero_grad()
        loss = f(a, w, ag)
        await loss.backward()
        return loss

    pending: list = []

    def sclosure():  # type: ignore[no-untyped-def]
        # a plain closure: grads computed by a backward the test awaited just before (a trio-friendly way
        # to use a sync closure is not needed; it can return an awaitable too)
        nonlocal calls
        calls += 1
        opt.zero_grad()
        loss = f(a, w, ag)
        pending.append(loss)
        return _Awaitable(loss)

    losses = []
    with trio.fail_after(60):
        for _ in range(4):
            losses.append(float(await opt.step(aclosure if async_closure else sclosure)))
    assert calls == want["func_evals"] == opt.state[a]["func_evals"]
    np.testing.assert_allclose(losses, want["losses"], rtol=1e-9)
    worst = max(_rel(a.numpy(), want["a"]), _rel(w.numpy(), want["w"]))
    print(f"LBFGS line_search={line_search} async={async_closure}: {calls} closure calls, params rel diff {worst:.3g}")
    assert worst <= RTOL
    assert losses[-1] < losses[0]


class _Awaitable:
    """What a plain closure may return: something to await that runs the backward."""

    def __init__(self, loss: ag.Tensor) -> None:
        self.loss = loss

    def __await__(self):  # type: ignore[no-untyped-def]
        yield from self.loss.backward().__await__()
        return self.loss


async def test_lbfgs_state_dict_roundtrip(rt: ag.Runtime) -> None:
    x = ag.tensor([1.5, -0.5], dtype=ag.float64, requires_grad=True)
    opt = ag.optim.LBFGS([x], max_iter=3)

    async def closure():  # type: ignore[no-untyped-def]
        opt.zero_grad()
        loss = ((x - 1) ** 4).sum() + (x**2).sum()
        await loss.backward()
        return loss

    with trio.fail_after(30):
        await opt.step(closure)
        sd = opt.state_dict()
        y = ag.tensor(x.numpy().copy(), requires_grad=True)
        opt2 = ag.optim.LBFGS([y], max_iter=3)
        opt2.load_state_dict(sd)
        await opt.step(closure)
        x_after = x.numpy().copy()

        async def closure2():  # type: ignore[no-untyped-def]
            opt2.zero_grad()
            loss = ((y - 1) ** 4).sum() + (y**2).sum()
            await loss.backward()
            return loss

        await opt2.step(closure2)
    np.testing.assert_allclose(y.numpy(), x_after, rtol=1e-14)
