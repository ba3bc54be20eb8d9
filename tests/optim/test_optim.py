"""asyncgrad.optim: SGD / Adam / AdamW formulas against hand-written numpy, stream order, layouts, state."""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn, optim
from tests._util import set_inline_limit


def _inline_limit(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """-1 sends every kernel (ops, rules, in-place updates) to the worker lanes."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("asyncgrad") and hasattr(mod, "INLINE_MAX_ELEMENTS"):
            monkeypatch.setattr(mod, "INLINE_MAX_ELEMENTS", limit)


@pytest.fixture(params=["inline", "queued"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "queued":
        _inline_limit(monkeypatch, -1)
    return str(request.param)


GRADS = [np.array([[0.5, -1.0, 2.0], [0.25, 0.0, -3.0]]), np.array([[1.0, 1.0, -0.5], [2.0, -2.0, 0.1]])]
P0 = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.5]])


async def _run(opt_fn, steps: int = 4) -> list[np.ndarray]:
    """Apply ``steps`` updates with known gradients; returns the parameter after each step."""
    p = ag.tensor(P0, dtype=np.float64, requires_grad=True)
    opt = opt_fn([p])
    out = []
    for i in range(steps):
        p.grad = ag.tensor(GRADS[i % 2], dtype=np.float64)
        opt.step()
        out.append(np.array(p.numpy(), copy=True))
    return out


def _sgd_ref(lr, momentum=0.0, dampening=0.0, wd=0.0, nesterov=False, maximize=False, steps=4):
    p, buf, out = P0.copy(), None, []
    for i in range(steps):
        g = GRADS[i % 2].copy()
        g = -g if maximize else g
        g = g + wd * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
        out.append(p.copy())
    return out


def _adam_ref(lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, amsgrad=False, decoupled=False, steps=4):
    p = P0.copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    vmax = np.zeros_like(p)
    out = []
    for t in range(1, steps + 1):
        g = GRADS[(t - 1) % 2].copy()
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = np.maximum(vmax, v)
        vhat = (vmax if amsgrad else v) / (1 - b2**t)
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(vhat) + eps)
        out.append(p.copy())
    return out


SGD_CASES = [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.8, "dampening": 0.3},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    {"lr": 0.1, "weight_decay": 0.1, "maximize": True},
]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
async def test_sgd_matches_formula(kw: dict, mode: str) -> None:
    async with ag.open_runtime():
        got = await _run(lambda ps: optim.SGD(ps, **kw))
    ref = _sgd_ref(
        kw["lr"],
        kw.get("momentum", 0.0),
        kw.get("dampening", 0.0),
        kw.get("weight_decay", 0.0),
        kw.get("nesterov", False),
        kw.get("maximize", False),
    )
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


ADAM_CASES = [
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}),
    ("adam", {"lr": 0.01, "amsgrad": True}),
    ("adamw", {"lr": 0.01}),
    ("adamw", {"lr": 0.02, "weight_decay": 0.1, "amsgrad": True}),
]


@pytest.mark.parametrize("kind,kw", ADAM_CASES, ids=lambda x: str(x))
async def test_adam_adamw_match_formula(kind: str, kw: dict, mode: str) -> None:
    cls = optim.Adam if kind == "adam" else optim.AdamW
    async with ag.open_runtime():
        got = await _run(lambda ps: cls(ps, **kw))
    b1, b2 = kw.get("betas", (0.9, 0.999))
    wd = kw.get("weight_decay", 0.0 if kind == "adam" else 1e-2)
    ref = _adam_ref(kw["lr"], b1, b2, kw.get("eps", 1e-8), wd, kw.get("amsgrad", False), kind == "adamw")
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


async def test_step_runs_after_backward_in_stream_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel queued: the update must see the gradient of the awaited backward, and the next
    forward must see the updated parameter."""
    _inline_limit(monkeypatch, -1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 30))
    w0 = rng.standard_normal((30, 20)) * 0.1
    async with ag.open_runtime():
        w = ag.tensor(w0, requires_grad=True)
        opt = optim.SGD([w], lr=0.05, momentum=0.9)
        xt = ag.tensor(x)
        losses = []
        for _ in range(5):
            loss = ((xt @ w) ** 2).mean()
            await loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        final = w.numpy().copy()
        vals = [t.item() for t in losses]
    wr, buf, ref = w0.copy(), None, []
    for _ in range(5):
        y = x @ wr
        ref.append((y**2).mean())
        g = x.T @ (2 * y / y.size)
        buf = g.copy() if buf is None else 0.9 * buf + g
        wr = wr - 0.05 * buf
    np.testing.assert_allclose(vals, ref, rtol=1e-12)
    np.testing.assert_allclose(final, wr, rtol=1e-12)


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
async def test_layouts_preserved_by_step(opt_name: str, mode: str) -> None:
    rng = np.random.default_rng(2)
    async with ag.open_runtime():
        pf = ag.from_numpy(np.asfortranarray(rng.standard_normal((70, 90)))).requires_grad_()
        base = np.ascontiguousarray(rng.standard_normal((2, 5, 5, 3)))  # NHWC memory
        pcl = ag.from_numpy(base.transpose(0, 3, 1, 2)).requires_grad_()  # channels-last (2, 3, 5, 5)
        f_strides, cl_strides = pf.strides, pcl.strides
        f_arr, cl_arr = pf.numpy(), pcl.numpy()
        if opt_name == "sgd":
            opt = optim.SGD([pf, pcl], lr=0.1, momentum=0.9)
        elif opt_name == "adam":
            opt = optim.Adam([pf, pcl], lr=0.1)
        else:
            opt = optim.AdamW([pf, pcl], lr=0.1)
        for _ in range(2):
            loss = (pf * pf).sum() + (ag.tanh(pcl) * pcl).sum()
            await loss.backward()
            assert pf.grad.strides == f_strides and pcl.grad.strides == cl_strides  # the layout contract
            opt.step()
            opt.zero_grad()
        assert pf.strides == f_strides and pcl.strides == cl_strides
        assert pf.numpy() is f_arr and pcl.numpy() is cl_arr  # updated in place, same arrays
        for p, st in ((pf, f_strides), (pcl, cl_strides)):
            for k, v in opt.state[p].items():
                if isinstance(v, ag.Tensor):
                    assert v.strides == st, k


async def test_zero_grad_set_to_none_and_zero_fill() -> None:
    async with ag.open_runtime():
        lin = nn.Linear(3, 2)
        opt = optim.SGD(lin.parameters(), lr=0.1)
        await lin(ag.ones(4, 3)).sum().backward()
        g = lin.weight.grad
        opt.zero_grad(set_to_none=False)
        assert lin.weight.grad is g and np.all(g.numpy() == 0)
        opt.zero_grad()
        assert lin.weight.grad is None and lin.bias.grad is None
        opt.step()  # no grads: nothing to do
        # a parameter without grad is skipped; its state stays empty
        assert opt.state.get(lin.weight, {}) == {}


async def test_param_groups_and_validation() -> None:
    async with ag.open_runtime():
        a = ag.tensor([1.0, 2.0], dtype=np.float64, requires_grad=True)
        b = ag.tensor([3.0], dtype=np.float64, requires_grad=True)
        opt = optim.SGD([{"params": [a]}, {"params": [b], "lr": 1.0}], lr=0.1)
        assert [g["lr"] for g in opt.param_groups] == [0.1, 1.0]
        a.grad = ag.tensor([1.0, 1.0], dtype=np.float64)
        b.grad = ag.tensor([1.0], dtype=np.float64)
        opt.step()
        assert np.allclose(a.numpy(), [0.9, 1.9]) and np.allclose(b.numpy(), [2.0])
        opt.param_groups[0]["lr"] = 0.5  # schedulers change lr between steps
        opt.step()
        assert np.allclose(a.numpy(), [0.4, 1.4])
        with pytest.raises(ValueError, match="learning rate"):
            optim.SGD([a], lr=-1)
        with pytest.raises(ValueError, match="Nesterov"):
            optim.SGD([a], lr=0.1, nesterov=True)
        with pytest.raises(ValueError, match="beta"):
            optim.Adam([a], betas=(1.0, 0.9))
        with pytest.raises(ValueError, match="empty"):
            optim.Adam([])
        with pytest.raises(ValueError, match="more than one"):
            optim.SGD([{"params": [a]}, {"params": [a]}], lr=0.1)
        with pytest.raises(ValueError, match="non-leaf"):
            optim.SGD([a * 2], lr=0.1)


async def test_optimizer_state_dict_round_trip() -> None:
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((16, 4))
    ys = rng.standard_normal((16, 1))

    async def train(model, opt, n):
        for _ in range(n):
            loss = ((model(ag.tensor(xs, dtype=np.float64)) - ag.tensor(ys, dtype=np.float64)) ** 2).mean()
            await loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.item()

    async with ag.open_runtime():
        for make in (
            lambda ps: optim.Adam(ps, lr=0.01, amsgrad=True),
            lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        ):
            ag.manual_seed(0)
            m1 = nn.Linear(4, 1, dtype=np.float64)
            o1 = make(m1.parameters())
            await train(m1, o1, 3)
            sd_m, sd_o = m1.state_dict(), o1.state_dict()
            assert set(sd_o) == {"state", "param_groups"} and sd_o["param_groups"][0]["params"] == [0, 1]
            assert all(
                isinstance(v, (np.ndarray, int, float)) for st in sd_o["state"].values() for v in st.values()
            )
            m2 = nn.Linear(4, 1, dtype=np.float64)
            m2.load_state_dict(sd_m)
            o2 = make(m2.parameters())
            o2.load_state_dict(sd_o)
            l1 = await train(m1, o1, 3)
            l2 = await train(m2, o2, 3)
            assert l1 == l2
            assert np.array_equal(m1.weight.numpy(), m2.weight.numpy())
        with pytest.raises(ValueError, match="parameter groups"):
            o2.load_state_dict({"state": {}, "param_groups": []})


async def test_concurrent_trainings_equal_sequential() -> None:
    """Trainings in concurrent trio tasks (each on its own stream) give exactly the sequential results."""
    rng = np.random.default_rng(9)
    xs = rng.standard_normal((128, 32)).astype(np.float32)
    ys = rng.integers(0, 10, 128)

    async def train(i: int, model: nn.Module, out: dict) -> None:
        opt = optim.Adam(model.parameters(), lr=1e-2) if i % 2 else optim.SGD(model.parameters(), 0.1, 0.9)
        for _ in range(8):
            loss = nn.functional.cross_entropy(model(ag.tensor(xs)), ys)
            await loss.backward()
            opt.step()
            opt.zero_grad()
        await loss.ready()
        out[i] = (loss.item(), model.state_dict())

    def build(n: int) -> list[nn.Module]:
        ag.manual_seed(1)
        return [nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)) for _ in range(n)]

    async with ag.open_runtime():
        seq: dict = {}
        for i, m in enumerate(build(4)):
            await train(i, m, seq)
        conc: dict = {}
        async with trio.open_nursery() as nursery:
            for i, m in enumerate(build(4)):
                nursery.start_soon(train, i, m, conc)
    for i in range(4):
        assert seq[i][0] == conc[i][0] and math.isfinite(seq[i][0])
        for k in seq[i][1]:
            assert np.array_equal(seq[i][1][k], conc[i][1][k])


# ---- `p -= lr * g` in one pass ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
async def test_update_by_a_scaled_temporary_is_fused_and_exact(dtype: str, monkeypatch: Any) -> None:
    """``p -= k * g`` / ``p += k * g`` (a hand-written SGD step) updates p in one pass when ``k * g`` is used
    nowhere else, and gives what the two ops give (to within the one rounding a fused multiply-add saves)."""
    from asyncgrad.runtime import _inplace

    set_inline_limit(monkeypatch, -1)  # every kernel queued, as for real parameters
    fused: list[bool] = []
    real = _inplace.scaled_update
    monkeypatch.setattr(_inplace, "scaled_update", lambda *a: fused.append(True) or real(*a))
    rng = np.random.default_rng(0)
    k = 3 if dtype == "int64" else 0.01
    async with ag.open_runtime():
        for shape in [(784, 512), (512,), (3, 1, 5)]:
            p0, g0 = (rng.integers(-50, 50, shape) for _ in range(2)) if dtype == "int64" else (
                rng.standard_normal(shape) for _ in range(2))
            p0, g0 = p0.astype(dtype), g0.astype(dtype)
            p, g = ag.tensor(p0), ag.tensor(g0)
            # hold the lane so each `k * g` is still queued when the update reads it: the fusion takes over
            # only a kernel that has not run yet (a lane that ran it first is the unfused path, also exact)
            gate = threading.Event()
            ag.current_stream().submit(lambda gate=gate: gate.wait(30))
            with ag.no_grad():
                p -= k * g
                p += g * k
                p -= ag.mul(g, 2 * k)
            gate.set()
            want = p0 - (k * g0)
            want = want + (g0 * k)
            want = want - (g0 * (2 * k))
            tol = 0 if dtype == "int64" else 8 * np.finfo(dtype).eps
            np.testing.assert_allclose(p.numpy(), want, rtol=tol, atol=tol)
    assert len(fused) == 9


async def test_a_scaled_temporary_used_elsewhere_still_gets_its_value(rt: Any, monkeypatch: Any) -> None:
    set_inline_limit(monkeypatch, -1)
    p = ag.tensor(np.ones(1000, np.float32))
    g = ag.tensor(np.full(1000, 2.0, np.float32))
    t = 0.5 * g  # held by the caller
    p -= t
    np.testing.assert_array_equal(t.numpy(), np.ones(1000, np.float32))
    np.testing.assert_array_equal(p.numpy(), np.zeros(1000, np.float32))
    x = ag.tensor(np.ones(1000, np.float32))
    x += 2 * x  # the temporary reads x itself
    np.testing.assert_array_equal(x.numpy(), np.full(1000, 3.0, np.float32))
    y = ag.tensor(np.ones((4, 1000), np.float32))
    y -= 0.5 * g  # broadcast: not the fused form, same result
    np.testing.assert_array_equal(y.numpy(), np.zeros((4, 1000), np.float32))
    w = ag.tensor(np.ones(1000, np.float32))
    u = 0.5 * g
    v = u + 1  # a kernel queued after u reads it: no fusion
    w -= u
    np.testing.assert_array_equal(v.numpy(), np.full(1000, 2.0, np.float32))
    np.testing.assert_array_equal(w.numpy(), np.zeros(1000, np.float32))


async def test_add_with_alpha_matches_numpy(rt: Any, monkeypatch: Any) -> None:
    set_inline_limit(monkeypatch, -1)
    rng = np.random.default_rng(1)
    for dtype in ("float32", "float64"):
        a0, b0 = rng.standard_normal((2, 300, 7)).astype(dtype)
        a, b = ag.tensor(a0), ag.tensor(b0)
        a.add_(b, alpha=-0.1)
        a.sub_(b, alpha=0.2)
        eps = 8 * np.finfo(dtype).eps
        np.testing.assert_allclose(a.numpy(), a0 - 0.1 * b0 - 0.2 * b0, rtol=eps, atol=eps)
        a.add_(a, alpha=0.5)  # x and y the same memory: numpy's form
        np.testing.assert_allclose(a.numpy(), 1.5 * (a0 - 0.1 * b0 - 0.2 * b0), rtol=eps, atol=eps)


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


async def test_named_parameters_match_torch_state_dict(rt, torch_ref) -> None:
    def reference(torch):
        tm = torch.nn.Linear(3, 2)
        group = torch.optim.SGD(tm.named_parameters(), lr=0.1).state_dict()["param_groups"][0]
        return {"param_names": group["param_names"], "params": group["params"]}

    ts = torch_ref("sgd_state_dict", reference)
    m = nn.Linear(3, 2)
    s = optim.SGD(m.named_parameters(), lr=0.1).state_dict()
    assert s["param_groups"][0]["param_names"] == ts["param_names"] == ["weight", "bias"]
    assert s["param_groups"][0]["params"] == ts["params"]
