"""The layers, activations, losses and ``nn.functional`` (``nn/_layers.py``, ``nn/_loss.py``,
``nn/functional.py``, ``nn/init.py``): values and gradients against numpy, finite differences and PyTorch.
"""

from __future__ import annotations

import math
from contextlib import nullcontext as _nullcontext

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn import functional as F
from tests._util import state_from_torch

# ---- layers and losses -------------------------------------------------------------------------


def _fd_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    for i in range(x.size):
        xp, xm = x.copy(), x.copy()
        xp.flat[i] += eps
        xm.flat[i] -= eps
        g.flat[i] = (f(xp) - f(xm)) / (2 * eps)
    return g


async def test_dropout_eval_is_identity_and_train_scales() -> None:
    async with ag.open_runtime():
        ag.manual_seed(3)
        d = nn.Dropout(0.25)
        x = ag.tensor(np.ones((200, 50)))
        d.eval()
        assert d(x) is x  # exactly the input, like PyTorch
        assert F.dropout(x, 0.25, training=False) is x
        d.train()
        y = d(x).numpy()
        kept = y != 0
        assert 0.70 < kept.mean() < 0.80
        assert np.allclose(y[kept], 1 / 0.75)
        with pytest.raises(ValueError):
            nn.Dropout(1.5)


async def test_dropout_with_its_own_generator_is_reproducible_whatever_else_draws() -> None:
    # concurrent trainings share the thread's default generator; a module given its own generator draws
    # the same masks however the other draws interleave with it
    async with ag.open_runtime():
        x = ag.tensor(np.ones((64, 32)))
        runs = []
        for other_draws in (0, 3):
            d = nn.Dropout(0.5, generator=np.random.default_rng(11))
            masks = []
            for _ in range(3):
                for _ in range(other_draws):
                    F.dropout(x, 0.5)  # another training drawing from the default generator
                masks.append(d(x).numpy() != 0)
            runs.append(masks)
        for a, b in zip(*runs):
            assert np.array_equal(a, b)
        assert not np.array_equal(runs[0][0], runs[0][1])  # a new mask per call
        # and the mask is the one F.dropout draws from a generator in the same state
        ref = F.dropout(x, 0.5, generator=np.random.default_rng(11)).numpy() != 0
        assert np.array_equal(ref, runs[0][0])


# ---- initialisation ----------------------------------------------------------------------------


async def test_default_init_matches_pytorch_bounds() -> None:
    async with ag.open_runtime():
        ag.manual_seed(0)
        lin = nn.Linear(400, 300)
        bound = 1 / math.sqrt(400)  # kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        w = lin.weight.numpy()
        b = lin.bias.numpy()
        assert w.dtype == np.float32 and w.shape == (300, 400)
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
        assert abs(w.mean()) < 0.01 * bound
        assert abs(w.var() - bound**2 / 3) < 0.02 * bound**2  # variance of U(-a, a) is a^2 / 3
        assert np.abs(b).max() <= bound and b.std() > 0.4 * bound
        conv = nn.Conv2d(6, 8, (3, 5), groups=2)
        fan_in = 3 * 3 * 5
        cb = 1 / math.sqrt(fan_in)
        cw = conv.weight.numpy()
        assert cw.shape == (8, 3, 3, 5)
        assert np.abs(cw).max() <= cb and np.abs(cw).max() > 0.9 * cb
        assert np.abs(conv.bias.numpy()).max() <= cb
        emb = nn.Embedding(1000, 16, padding_idx=2)
        e = emb.weight.numpy()
        assert abs(e.std() - 1) < 0.05 and np.all(e[2] == 0)
        ln = nn.LayerNorm(7)
        assert np.all(ln.weight.numpy() == 1) and np.all(ln.bias.numpy() == 0)


async def test_init_is_reproducible_from_the_seed() -> None:
    async with ag.open_runtime():
        ag.manual_seed(42)
        a = nn.Linear(5, 4)
        ag.manual_seed(42)
        b = nn.Linear(5, 4)
        c = nn.Linear(5, 4)
        assert np.array_equal(a.weight.numpy(), b.weight.numpy())
        assert not np.array_equal(b.weight.numpy(), c.weight.numpy())
        g = np.random.default_rng(1)
        t = ag.empty(30, 20)
        nn.init.xavier_uniform_(t, generator=g)
        assert np.abs(t.numpy()).max() <= math.sqrt(6 / 50)
        nn.init.kaiming_normal_(t, nonlinearity="relu", generator=g)
        assert abs(t.numpy().std() - math.sqrt(2 / 20)) < 0.03
        nn.init.trunc_normal_(t, std=0.5, a=-0.4, b=0.4, generator=g)
        assert np.abs(t.numpy()).max() <= 0.4
        nn.init.orthogonal_(t, generator=g)
        q = t.numpy().astype(np.float64)
        assert np.allclose(q.T @ q, np.eye(20), atol=1e-5)
        assert nn.init.calculate_gain("leaky_relu", math.sqrt(5)) == pytest.approx(math.sqrt(1 / 3))
        assert nn.init.calculate_gain("tanh") == pytest.approx(5 / 3)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
async def test_gelu_values_and_gradients(approximate: str) -> None:
    async with ag.open_runtime():
        xs = np.linspace(-4, 4, 17)

        def ref(a: np.ndarray) -> np.ndarray:
            if approximate == "tanh":
                return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
            return np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in a])

        x = ag.tensor(xs, dtype=np.float64, requires_grad=True)
        y = nn.GELU(approximate)(x)
        assert np.allclose(y.numpy(), ref(xs), rtol=1e-12, atol=1e-14)
        w = np.random.default_rng(0).standard_normal(xs.shape)
        (g,) = await ag.grad((y * ag.tensor(w)).sum(), [x], create_graph=True)
        assert np.allclose(g.numpy(), _fd_grad(lambda a: float((ref(a) * w).sum()), xs), rtol=1e-6, atol=1e-8)
        # second derivative through the recorded backward: d/dx sum(w * gelu'(x)) = w * gelu''(x)
        (gg,) = await ag.grad(g.sum(), [x])

        def dref(a: np.ndarray) -> np.ndarray:  # gelu' (checked against finite differences above)
            if approximate == "tanh":
                k = math.sqrt(2 / math.pi)
                t = np.tanh(k * (a + 0.044715 * a**3))
                return 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * k * (1 + 3 * 0.044715 * a * a)
            cdf = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in a])
            return cdf + a * np.exp(-a * a / 2) / math.sqrt(2 * math.pi)

        assert np.allclose(g.numpy(), w * dref(xs), rtol=1e-10, atol=1e-12)
        assert np.allclose(gg.numpy(), w * _fd_grad(lambda a: float(dref(a).sum()), xs), rtol=1e-6, atol=1e-8)
        assert nn.GELU(approximate)(ag.tensor(xs.astype(np.float32))).dtype == np.float32


@pytest.mark.parametrize("shape,bias", [((5, 4), True), ((2, 3, 4), True), ((4,), False)])
async def test_linear_op_gradients_and_double_backward(shape: tuple, bias: bool) -> None:
    rng = np.random.default_rng(4)
    x0, w0, b0 = rng.standard_normal(shape), rng.standard_normal((3, 4)), rng.standard_normal(3)
    wout = rng.standard_normal((*shape[:-1], 3))

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> float:
        return float((((x @ w.T) + (b if bias else 0)) * wout).sum())

    async with ag.open_runtime():
        x = ag.tensor(x0, requires_grad=True)
        w = ag.tensor(w0, requires_grad=True)
        b = ag.tensor(b0, requires_grad=True) if bias else None
        y = F.linear(x, w, b)
        assert y.shape == (*shape[:-1], 3)
        assert np.allclose(y.numpy(), x0 @ w0.T + (b0 if bias else 0))
        inputs = [x, w] + ([b] if bias else [])
        grads = await ag.grad((y * ag.tensor(wout)).sum(), inputs, create_graph=True)
        refs = [
            _fd_grad(lambda a: ref(a, w0, b0), x0),
            _fd_grad(lambda a: ref(x0, a, b0), w0),
            _fd_grad(lambda a: ref(x0, w0, a), b0),
        ]
        for g, r in zip(grads, refs):
            assert np.allclose(g.numpy(), r, rtol=1e-6, atol=1e-8)
        assert grads[1].numpy().flags.c_contiguous  # the weight's gradient needs no layout copy
        # second order: d/dw sum(dL/dx * v) = v^T-weighted wout, through the recorded backward
        v = rng.standard_normal(shape)
        (gw2,) = await ag.grad((grads[0] * ag.tensor(v)).sum(), [w])
        assert np.allclose(gw2.numpy(), wout.reshape(-1, 3).T @ v.reshape(-1, 4))


async def test_layers_forward_values() -> None:
    async with ag.open_runtime():
        rng = np.random.default_rng(0)
        x = rng.standard_normal((3, 5))
        lin = nn.Linear(5, 4).double()
        out = lin(ag.tensor(x))
        assert np.allclose(out.numpy(), x @ lin.weight.numpy().T + lin.bias.numpy())
        ln = nn.LayerNorm(5, dtype=np.float64)
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        assert np.allclose(ln(ag.tensor(x)).numpy(), (x - mu) / np.sqrt(var + 1e-5))
        emb = nn.Embedding(10, 3)
        idx = np.array([[1, 2], [9, 1]])
        assert np.array_equal(emb(idx).numpy(), emb.weight.numpy()[idx])
        fl = nn.Flatten()
        assert fl(ag.tensor(rng.standard_normal((2, 3, 4, 5)))).shape == (2, 60)
        assert np.allclose(nn.Tanh()(ag.tensor(x)).numpy(), np.tanh(x))
        assert np.allclose(nn.Sigmoid()(ag.tensor(x)).numpy(), 1 / (1 + np.exp(-x)))
        assert np.allclose(nn.Softmax(-1)(ag.tensor(x)).numpy().sum(-1), 1)
        assert np.allclose(nn.ReLU()(ag.tensor(x)).numpy(), np.maximum(x, 0))
        assert nn.Identity()(x) is x


async def test_losses_match_numpy() -> None:
    async with ag.open_runtime():
        rng = np.random.default_rng(1)
        logits = rng.standard_normal((6, 4))
        y = np.array([0, 3, 1, 1, 2, 3])
        lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        ce = -lp[np.arange(6), y]
        x = ag.tensor(logits, requires_grad=True)
        loss = nn.CrossEntropyLoss()(x, y)
        assert loss.item() == pytest.approx(ce.mean(), rel=1e-10)
        await loss.backward()
        p = np.exp(lp)
        onehot = np.eye(4)[y]
        assert np.allclose(x.grad.numpy(), (p - onehot) / 6)
        assert nn.CrossEntropyLoss(reduction="sum")(ag.tensor(logits), ag.tensor(y)).item() == pytest.approx(
            ce.sum()
        )
        yi = y.copy()
        yi[2] = -100
        assert F.cross_entropy(ag.tensor(logits), yi).item() == pytest.approx(np.delete(ce, 2).mean())
        eps = 0.1
        smooth = -lp.mean(1)
        assert nn.CrossEntropyLoss(label_smoothing=eps)(ag.tensor(logits), y).item() == pytest.approx(
            ((1 - eps) * ce + eps * smooth).mean()
        )
        assert nn.NLLLoss()(ag.tensor(lp), y).item() == pytest.approx(ce.mean())
        t = rng.standard_normal((6, 4))
        assert nn.MSELoss()(ag.tensor(logits), ag.tensor(t)).item() == pytest.approx(
            ((logits - t) ** 2).mean()
        )
        z = rng.integers(0, 2, (6, 4)).astype(np.float64)
        bce = np.maximum(logits, 0) - logits * z + np.log1p(np.exp(-np.abs(logits)))
        assert nn.BCEWithLogitsLoss()(ag.tensor(logits), ag.tensor(z)).item() == pytest.approx(bce.mean())


# ---- helpers for PyTorch comparisons ------------------------------------------------------------------


async def _compare(torch_ref, key, ag_fn, torch_fn, arrays, *, grad_idx=None, atol=1e-10, rtol=1e-8, **params):
    """Run ``ag_fn`` and ``torch_fn(torch, *tensors)`` on float64 copies of ``arrays``; compare values and
    gradients. The torch side is ``torch_ref``'s value ``key`` (live or recorded); ``params`` are the other
    values ``torch_fn`` depends on, recorded with the arrays."""
    grad_idx = list(range(len(arrays)) if grad_idx is None else grad_idx)

    def reference(torch):
        ts = [torch.tensor(a, dtype=torch.float64, requires_grad=i in grad_idx) for i, a in enumerate(arrays)]
        tout = torch_fn(torch, *ts)
        w = np.random.default_rng(7).standard_normal(tuple(tout.shape))
        tgrads = torch.autograd.grad((tout * torch.tensor(w)).sum(), [ts[i] for i in grad_idx], allow_unused=True)
        return tout.detach(), list(tgrads)

    xs = [ag.tensor(a, dtype=np.float64, requires_grad=i in grad_idx) for i, a in enumerate(arrays)]
    out = ag_fn(*xs)
    tout, tgrads = torch_ref(key, reference, arrays=list(arrays), grad_idx=grad_idx, **params)
    np.testing.assert_allclose(out.numpy(), tout, atol=atol, rtol=rtol)
    assert out.dtype == np.float64
    w = np.random.default_rng(7).standard_normal(tuple(out.shape))
    grads = await ag.grad((out * ag.tensor(w)).sum(), [xs[i] for i in grad_idx], allow_unused=True)
    for i, g, tg in zip(grad_idx, grads, tgrads):
        if tg is None:
            assert g is None or np.all(g.numpy() == 0), f"input {i}"
            continue
        assert g is not None, f"input {i} got no gradient"
        np.testing.assert_allclose(g.numpy(), tg, atol=atol, rtol=rtol, err_msg=f"input {i}")


def _x(rng, *shape, scale=3.0):
    x = rng.standard_normal(shape) * scale
    x.flat[:4] = [0.0, 6.0, -1.0, 1.0][: min(4, x.size)]  # the kinks
    return x


# ---- BatchNorm -------------------------------------------------------------------------------------------


async def _bn_steps(rt, torch_ref, key, rng, make, tmake, shape, steps=3, **params) -> None:
    """``make()`` and ``tmake(torch)`` (the torch side: ``torch_ref``'s value ``key``; ``params`` are what
    ``tmake`` depends on) from the same state, through ``steps`` batches in train and in eval mode:
    outputs, gradients and the state dicts after each."""
    m = make()
    m_repr, m_keys = repr(m), list(m.state_dict())
    m.double()
    if m.weight is not None:  # non-trivial affine parameters, the same in both
        w = rng.uniform(0.5, 1.5, m.num_features)
        b = rng.standard_normal(m.num_features)
        with ag.no_grad():
            m.weight.copy_(w)
            if m.bias is not None:
                m.bias.copy_(b)
    state0 = {k: np.array(v) for k, v in m.state_dict().items()}
    xs = [rng.standard_normal(shape) * 2 + 1 for _ in range(steps)]
    modes = ("train", "eval")

    def reference(torch):
        tm = tmake(torch)
        got = {"repr": repr(tm), "state_keys": list(tm.state_dict())}
        tm.double()
        with torch.no_grad():
            for k, v in state0.items():
                tm.state_dict()[k].copy_(torch.from_numpy(np.array(v)))
        runs = []
        for step, x in enumerate(xs):
            for mode in modes:
                getattr(tm, mode)()
                xt = torch.tensor(x, requires_grad=True)
                tout = tm(xt)
                g = np.random.default_rng(step).standard_normal(shape)
                tgrads = torch.autograd.grad((tout * torch.tensor(g)).sum(), [xt, *tm.parameters()])
                runs.append({"out": tout.detach(), "grads": list(tgrads), "state": state_from_torch(tm)})
        got["runs"] = runs
        return got

    # a 0-d array (num_batches_tracked) as its Python scalar: tests/_reference.py stores 0-d arrays with
    # shape (1,) (np.ascontiguousarray), so a 0-d input would never match its recording
    recorded_state0 = {k: v.item() if v.ndim == 0 else v for k, v in state0.items()}
    want = torch_ref(key, reference, state0=recorded_state0, xs=xs, shape=shape, **params)
    assert m_repr == want["repr"]
    assert m_keys == want["state_keys"]
    runs = iter(want["runs"])
    for step, x in enumerate(xs):
        for mode in modes:
            run = next(runs)
            getattr(m, mode)()
            xa = ag.tensor(x, requires_grad=True)
            out = m(xa)
            np.testing.assert_allclose(out.numpy(), run["out"], atol=1e-10, rtol=1e-8)
            g = np.random.default_rng(step).standard_normal(shape)
            leaves = [xa, *m.parameters()]
            grads = await ag.grad((out * ag.tensor(g)).sum(), leaves)
            assert len(grads) == len(run["grads"])
            for a, t in zip(grads, run["grads"]):
                np.testing.assert_allclose(a.numpy(), t, atol=1e-10, rtol=1e-8)
            sd, tsd = m.state_dict(), run["state"]
            for k in tsd:
                np.testing.assert_allclose(sd[k], tsd[k], atol=1e-12, rtol=1e-10, err_msg=f"{k} {mode}")
                assert sd[k].dtype == tsd[k].dtype, k


# ---- activations -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, ag_fn, t_fn",
    [
        ("leaky_relu", lambda x: F.leaky_relu(x), "F.leaky_relu(x)"),
        ("leaky_relu_slope", lambda x: F.leaky_relu(x, 0.2), "F.leaky_relu(x, 0.2)"),
        ("silu", lambda x: F.silu(x), "F.silu(x)"),
        ("elu", lambda x: F.elu(x), "F.elu(x)"),
        ("elu_alpha", lambda x: F.elu(x, alpha=0.5), "F.elu(x, alpha=0.5)"),
        ("softplus", lambda x: F.softplus(x), "F.softplus(x)"),
        ("softplus_beta", lambda x: F.softplus(x, beta=2.0, threshold=3.0), "F.softplus(x, beta=2.0, threshold=3.0)"),
        ("relu6", lambda x: F.relu6(x), "F.relu6(x)"),
        ("hardtanh", lambda x: F.hardtanh(x), "F.hardtanh(x)"),
        ("hardtanh_range", lambda x: F.hardtanh(x, -2.0, 6.0), "F.hardtanh(x, -2.0, 6.0)"),
    ],
)
async def test_activation_functionals_vs_torch(rt, rng, torch_ref, name, ag_fn, t_fn) -> None:
    x = _x(rng, 5, 7)
    x[0, 4:7] = [40.0, -40.0, 1000.0]  # large values: no overflow, no NaN gradient
    await _compare(
        torch_ref, "functional", ag_fn, lambda torch, t: eval(t_fn, {"F": torch.nn.functional, "x": t}), [x], t_fn=t_fn
    )


@pytest.mark.parametrize(
    "make, tmake",
    [
        ("nn.LeakyReLU()", "nn.LeakyReLU()"),
        ("nn.LeakyReLU(0.3)", "nn.LeakyReLU(0.3)"),
        ("nn.SiLU()", "nn.SiLU()"),
        ("nn.ELU(alpha=2.0)", "nn.ELU(alpha=2.0)"),
        ("nn.Softplus(beta=0.5, threshold=10.0)", "nn.Softplus(beta=0.5, threshold=10.0)"),
        ("nn.ReLU6()", "nn.ReLU6()"),
        ("nn.Hardtanh(-0.5, 2.0)", "nn.Hardtanh(-0.5, 2.0)"),
        ("nn.Sigmoid()", "nn.Sigmoid()"),
        ("nn.Tanh()", "nn.Tanh()"),
        ("nn.Softmax(dim=1)", "nn.Softmax(dim=1)"),
        ("nn.LogSoftmax(dim=0)", "nn.LogSoftmax(dim=0)"),
        ("nn.Identity()", "nn.Identity()"),
    ],
)
async def test_activation_modules_vs_torch(rt, rng, torch_ref, make, tmake) -> None:
    m = eval(make, {"nn": nn})
    assert repr(m) == torch_ref("repr", lambda torch: repr(eval(tmake, {"nn": torch.nn})), tmake=tmake)
    await _compare(torch_ref, "module", m, lambda torch, t: eval(tmake, {"nn": torch.nn})(t), [_x(rng, 4, 6)],
                   tmake=tmake)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.leaky_relu(x, 0.1),
        F.silu,
        lambda x: F.elu(x, 1.5),
        lambda x: F.softplus(x, beta=2.0, threshold=5.0),
        F.relu6,
        lambda x: F.hardtanh(x, -1.5, 1.5),
        lambda x: F.normalize(x, dim=1),
        lambda x: F.normalize(x, p=1.0, dim=0),
        lambda x: F.pad(x, (1, 2, 0, 1), value=0.5),
        lambda x: F.pad(x, (-1, 1)),
    ],
)
async def test_new_functionals_gradcheck(rt, rng, fn) -> None:
    x = rng.standard_normal((3, 4)) * 2
    x[np.abs(x) < 0.05] += 0.2  # keep away from the kinks at 0
    x[np.abs(np.abs(x) - 1.5) < 0.05] += 0.2
    await ag.autograd.gradcheck(fn, [x], rtol=1e-4)


async def test_activation_grad_at_kinks_and_dtype(rt, torch_ref) -> None:
    x = np.array([-1.0, 0.0, 1.0, 6.0, -6.0, 3.0])
    for name in ("leaky_relu", "elu", "relu6", "hardtanh", "silu", "softplus"):
        await _compare(
            torch_ref, name, getattr(F, name), lambda torch, t, name=name: getattr(torch.nn.functional, name)(t), [x]
        )
    h = ag.tensor([-1.0, 2.0], dtype="float32")
    for f in (F.leaky_relu, F.silu, F.elu, F.softplus, F.relu6, F.hardtanh):
        assert f(h).dtype == np.float32


# ---- losses -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_regression_losses_vs_torch(rt, rng, torch_ref, reduction) -> None:
    a = rng.standard_normal((4, 5)) * 2
    b = rng.standard_normal((4, 5))
    b[0, 0] = a[0, 0] + 0.5  # inside beta / delta
    await _compare(
        torch_ref,
        "l1_loss",
        lambda x, y: F.l1_loss(x, y, reduction=reduction),
        lambda torch, x, y: torch.nn.functional.l1_loss(x, y, reduction=reduction),
        [a, b],
        reduction=reduction,
    )
    for beta in (1.0, 0.5, 0.0):
        await _compare(
            torch_ref,
            f"smooth_l1_loss_beta{beta}",
            lambda x, y, beta=beta: F.smooth_l1_loss(x, y, reduction=reduction, beta=beta),
            lambda torch, x, y, beta=beta: torch.nn.functional.smooth_l1_loss(x, y, reduction=reduction, beta=beta),
            [a, b],
            reduction=reduction,
            beta=beta,
        )
    for delta in (1.0, 2.5):
        await _compare(
            torch_ref,
            f"huber_loss_delta{delta}",
            lambda x, y, delta=delta: F.huber_loss(x, y, reduction=reduction, delta=delta),
            lambda torch, x, y, delta=delta: torch.nn.functional.huber_loss(x, y, reduction=reduction, delta=delta),
            [a, b],
            reduction=reduction,
            delta=delta,
        )
    w = rng.uniform(0.1, 2.0, (4, 5))
    await _compare(
        torch_ref,
        "l1_loss_weight",
        lambda x, y, ww: F.l1_loss(x, y, reduction=reduction, weight=ww),
        lambda torch, x, y, ww: torch.nn.functional.l1_loss(x, y, reduction=reduction, weight=ww),
        [a, b, w],
        grad_idx=[0, 1],
        reduction=reduction,
    )
    await _compare(
        torch_ref,
        "huber_loss_weight",
        lambda x, y, ww: F.huber_loss(x, y, reduction=reduction, delta=0.7, weight=ww),
        lambda torch, x, y, ww: torch.nn.functional.huber_loss(x, y, reduction=reduction, delta=0.7, weight=ww),
        [a, b, w],
        grad_idx=[0, 1],
        reduction=reduction,
    )
    for key, m, tmake in (
        ("L1Loss", nn.L1Loss(reduction=reduction), lambda torch: torch.nn.L1Loss(reduction=reduction)),
        (
            "SmoothL1Loss",
            nn.SmoothL1Loss(reduction=reduction, beta=0.3),
            lambda torch: torch.nn.SmoothL1Loss(reduction=reduction, beta=0.3),
        ),
        (
            "HuberLoss",
            nn.HuberLoss(reduction=reduction, delta=0.4),
            lambda torch: torch.nn.HuberLoss(reduction=reduction, delta=0.4),
        ),
    ):
        await _compare(
            torch_ref, key, m, lambda torch, x, y, tmake=tmake: tmake(torch)(x, y), [a, b], reduction=reduction
        )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_bce_vs_torch(rt, rng, torch_ref, reduction) -> None:
    p = rng.uniform(0.02, 0.98, (4, 3))
    t = rng.uniform(0.0, 1.0, (4, 3))
    t[0, 0], t[0, 1] = 0.0, 1.0
    await _compare(
        torch_ref,
        "bce",
        lambda x, y: F.binary_cross_entropy(x, y, reduction=reduction),
        lambda torch, x, y: torch.nn.functional.binary_cross_entropy(x, y, reduction=reduction),
        [p, t],
        reduction=reduction,
    )
    w = rng.uniform(0.5, 2.0, (3,))  # broadcast over the batch
    await _compare(
        torch_ref,
        "bce_weight",
        lambda x, y, ww: F.binary_cross_entropy(x, y, weight=ww, reduction=reduction),
        lambda torch, x, y, ww: torch.nn.functional.binary_cross_entropy(x, y, weight=ww, reduction=reduction),
        [p, t, w],
        grad_idx=[0, 1],
        reduction=reduction,
    )
    m = nn.BCELoss(weight=ag.tensor(w), reduction=reduction)
    want_keys = torch_ref(
        "BCELoss_state_keys", lambda torch: list(torch.nn.BCELoss(weight=torch.tensor(w)).state_dict()), w=w
    )
    assert list(m.state_dict()) == want_keys == ["weight"]
    await _compare(
        torch_ref,
        "BCELoss",
        m,
        lambda torch, x, y: torch.nn.BCELoss(weight=torch.tensor(w), reduction=reduction)(x, y),
        [p, t],
        w=w,
        reduction=reduction,
    )


async def test_bce_clamps_log_at_minus_100(rt, torch_ref) -> None:
    p = np.array([0.0, 1.0, 0.0, 1.0, 0.5])
    t = np.array([1.0, 0.0, 0.0, 1.0, 1.0])

    def reference(torch):
        tF = torch.nn.functional
        values = tF.binary_cross_entropy(torch.tensor(p), torch.tensor(t), reduction="none")
        tx = torch.tensor(p, requires_grad=True)
        (tg,) = torch.autograd.grad(tF.binary_cross_entropy(tx, torch.tensor(t), reduction="sum"), [tx])
        return values, tg

    want, tg = torch_ref("bce_clamped", reference, p=p, t=t)
    out = F.binary_cross_entropy(ag.tensor(p), ag.tensor(t), reduction="none")
    np.testing.assert_allclose(out.numpy(), want)
    assert out.numpy()[0] == 100.0
    x = ag.tensor(p, requires_grad=True)
    (g,) = await ag.grad(F.binary_cross_entropy(x, ag.tensor(t), reduction="sum"), [x])
    np.testing.assert_allclose(g.numpy(), tg)
    with pytest.raises(ValueError, match="target size"):
        F.binary_cross_entropy(ag.tensor(p), ag.tensor(t[:2]))
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        F.binary_cross_entropy(ag.tensor([1.5]), ag.tensor([1.0])).item()


@pytest.mark.parametrize("reduction", ["mean", "batchmean", "sum", "none"])
@pytest.mark.parametrize("log_target", [False, True])
async def test_kl_div_vs_torch(rt, rng, torch_ref, reduction, log_target) -> None:
    logits = rng.standard_normal((3, 5))
    inp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    q = rng.dirichlet(np.ones(5), size=3)
    q[0, 0] = 0.0 if not log_target else q[0, 0]  # xlogy(0, 0) = 0
    tgt = np.log(q) if log_target else q
    grad_idx = [0, 1] if log_target else [0]  # torch's target gradient at 0 is -inf
    with pytest.warns(UserWarning) if reduction == "mean" else _nullcontext():
        await _compare(
            torch_ref,
            "kl_div",
            lambda x, y: F.kl_div(x, y, reduction=reduction, log_target=log_target),
            lambda torch, x, y: torch.nn.functional.kl_div(x, y, reduction=reduction, log_target=log_target),
            [inp, tgt],
            grad_idx=grad_idx,
            reduction=reduction,
            log_target=log_target,
        )
    m = nn.KLDivLoss(reduction=reduction, log_target=log_target)
    with pytest.warns(UserWarning) if reduction == "mean" else _nullcontext():
        await _compare(
            torch_ref,
            "KLDivLoss",
            m,
            lambda torch, x, y: torch.nn.KLDivLoss(reduction=reduction, log_target=log_target)(x, y),
            [inp, tgt],
            grad_idx=grad_idx,
            reduction=reduction,
            log_target=log_target,
        )


async def test_kl_div_target_grad_gradcheck(rt, rng) -> None:
    q = rng.dirichlet(np.ones(4), size=2)
    inp = rng.standard_normal((2, 4))
    await ag.autograd.gradcheck(lambda x, y: F.kl_div(x, y, reduction="batchmean"), [inp, q], rtol=1e-4)
    await ag.autograd.gradcheck(
        lambda x, y: F.kl_div(x, y, reduction="sum", log_target=True), [inp, np.log(q)], rtol=1e-4
    )


async def test_loss_gradchecks(rt, rng) -> None:
    a = rng.standard_normal((3, 4)) * 2
    b = rng.standard_normal((3, 4))
    await ag.autograd.gradcheck(lambda x, y: F.l1_loss(x, y), [a, b], rtol=1e-4)
    await ag.autograd.gradcheck(lambda x, y: F.smooth_l1_loss(x, y, beta=0.7), [a, b], rtol=1e-4)
    await ag.autograd.gradcheck(lambda x, y: F.huber_loss(x, y, delta=0.7, reduction="sum"), [a, b], rtol=1e-4)
    p = rng.uniform(0.05, 0.95, (3, 4))
    t = rng.uniform(0.0, 1.0, (3, 4))
    await ag.autograd.gradcheck(lambda x, y: F.binary_cross_entropy(x, y), [p, t], rtol=1e-4)


async def test_loss_modules_reductions_and_legacy(rt, torch_ref) -> None:
    with pytest.raises(ValueError):
        nn.L1Loss(reduction="batchmean")
    assert nn.L1Loss(size_average=False).reduction == "sum"
    assert nn.KLDivLoss(reduction="batchmean").reduction == "batchmean"
    assert nn.NLLLoss().reduction == "mean" and nn.BCEWithLogitsLoss().reduction == "mean"
    want = torch_ref("reprs", lambda torch: [repr(torch.nn.HuberLoss()), repr(torch.nn.KLDivLoss())])
    assert len(want) == 2
    for m, tm_repr in zip((nn.HuberLoss(), nn.KLDivLoss()), want):
        assert repr(m) == tm_repr


# ---- one_hot, pad, normalize ------------------------------------------------------------------------


async def test_one_hot_vs_torch(rt, torch_ref) -> None:
    idx = np.array([[0, 3], [2, 1]], dtype=np.int64)

    def reference(torch):
        return {
            "default": torch.nn.functional.one_hot(torch.tensor(idx)),
            "six": torch.nn.functional.one_hot(torch.tensor(idx), 6),
        }

    want = torch_ref("one_hot", reference, idx=idx)
    out = F.one_hot(ag.tensor(idx))
    assert out.dtype == np.int64 and out.shape == tuple(want["default"].shape) == (2, 2, 4)
    np.testing.assert_array_equal(out.numpy(), want["default"])
    out6 = F.one_hot(ag.tensor(idx), num_classes=6)
    np.testing.assert_array_equal(out6.numpy(), want["six"])
    with pytest.raises(RuntimeError, match="smaller than num_classes"):
        F.one_hot(ag.tensor(idx), num_classes=3)
    with pytest.raises(RuntimeError, match="non-negative"):
        F.one_hot(ag.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="LongTensor"):
        F.one_hot(ag.tensor([0.0, 1.0]))


@pytest.mark.parametrize(
    "pad", [(1, 2), (0, 1, 2, 0), (1, 1, 1, 1, 1, 1), (-1, 2), (2, -1, -1, 0), (0, 0)]
)
async def test_pad_vs_torch(rt, rng, torch_ref, pad) -> None:
    x = rng.standard_normal((2, 3, 4))
    await _compare(
        torch_ref, "pad", lambda t: F.pad(t, pad), lambda torch, t: torch.nn.functional.pad(t, pad), [x], pad=pad
    )
    await _compare(
        torch_ref,
        "pad_value",
        lambda t: F.pad(t, pad, value=-2.5),
        lambda torch, t: torch.nn.functional.pad(t, pad, value=-2.5),
        [x],
        pad=pad,
    )
    with pytest.raises(ValueError):
        F.pad(ag.tensor(x), (1,))
    with pytest.raises(NotImplementedError):
        F.pad(ag.tensor(x), (1, 1), mode="reflect")


@pytest.mark.parametrize("p, dim", [(2.0, 1), (1.0, 0), (3.0, -1), (2.0, 2)])
async def test_normalize_vs_torch(rt, rng, torch_ref, p, dim) -> None:
    x = rng.standard_normal((3, 4, 2))
    x[0, :, 0] = 0.0  # a zero vector: the eps clamp
    await _compare(
        torch_ref,
        "normalize",
        lambda t: F.normalize(t, p=p, dim=dim),
        lambda torch, t: torch.nn.functional.normalize(t, p=p, dim=dim),
        [x],
        p=p,
        dim=dim,
    )


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"momentum": None},
        {"momentum": 0.3, "eps": 1e-3},
        {"affine": False},
        {"track_running_stats": False},
        {"bias": False},
    ],
)
async def test_batchnorm1d_vs_torch(rt, rng, torch_ref, kw) -> None:
    for key, shape in (("2d_input", (5, 3)), ("3d_input", (4, 3, 6))):
        await _bn_steps(
            rt, torch_ref, key, rng, lambda: nn.BatchNorm1d(3, **kw), lambda torch: torch.nn.BatchNorm1d(3, **kw),
            shape, kw=kw,
        )


@pytest.mark.parametrize("kw", [{}, {"momentum": None}, {"track_running_stats": False}])
async def test_batchnorm2d_vs_torch(rt, rng, torch_ref, kw) -> None:
    await _bn_steps(
        rt, torch_ref, "batchnorm2d", rng, lambda: nn.BatchNorm2d(2, **kw), lambda torch: torch.nn.BatchNorm2d(2, **kw),
        (3, 2, 4, 5), kw=kw,
    )


async def test_batchnorm_buffers_errors_and_gradcheck(rt, rng) -> None:
    bn = nn.BatchNorm2d(4)
    assert list(bn.state_dict()) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert bn.num_batches_tracked.dtype == np.int64 and bn.running_mean.dtype == np.float32
    assert [n for n, _ in bn.named_buffers()] == ["running_mean", "running_var", "num_batches_tracked"]
    bn(ag.randn(2, 4, 3, 3))
    bn(ag.randn(2, 4, 3, 3))
    assert bn.num_batches_tracked.item() == 2
    bn.eval()
    bn(ag.randn(2, 4, 3, 3))
    assert bn.num_batches_tracked.item() == 2  # eval does not count
    bn.reset_running_stats()
    assert bn.num_batches_tracked.item() == 0 and np.all(bn.running_var.numpy() == 1)
    with pytest.raises(ValueError, match="expected 4D input"):
        bn(ag.randn(2, 4))
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        nn.BatchNorm1d(4)(ag.randn(2, 4, 3, 3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nn.BatchNorm1d(4)(ag.randn(1, 4))
    nn.BatchNorm1d(4).eval()(ag.randn(1, 4))  # fine in eval
    no_stats = nn.BatchNorm1d(3, track_running_stats=False)
    assert list(no_stats.state_dict()) == ["weight", "bias"]
    # gradients of the training forward (input, weight, bias), against finite differences
    x = rng.standard_normal((4, 3, 2))
    w = rng.uniform(0.5, 1.5, 3)
    b = rng.standard_normal(3)
    await ag.autograd.gradcheck(
        lambda xx, ww, bb: F.batch_norm(xx, None, None, ww, bb, training=True), [x, w, b], rtol=1e-4
    )
    rm, rv = ag.tensor(rng.standard_normal(3)), ag.tensor(rng.uniform(0.5, 2.0, 3))
    await ag.autograd.gradcheck(
        lambda xx, ww, bb: F.batch_norm(xx, rm, rv, ww, bb, training=False), [x, w, b], rtol=1e-4
    )


async def test_batchnorm_in_a_model_trains_and_loads(rt, rng) -> None:
    ag.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt = ag.optim.SGD(model.parameters(), lr=0.05)
    x = ag.tensor(rng.standard_normal((16, 4)).astype(np.float32))
    y = ag.tensor(rng.standard_normal((16, 1)).astype(np.float32))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        await loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    sd = model.state_dict()
    assert "1.running_mean" in sd and sd["1.num_batches_tracked"] == 5
    clone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    assert repr(clone.load_state_dict(sd)) == "<All keys matched successfully>"
    model.eval()
    clone.eval()
    np.testing.assert_allclose(model(x).numpy(), clone(x).numpy(), rtol=1e-6)


async def test_softmax_without_dim_uses_pytorchs_legacy_choice_and_warns(rt) -> None:
    x = ag.tensor(np.arange(24.0).reshape(2, 3, 4))
    with pytest.warns(UserWarning, match="softmax\\(\\) without dim"):
        y = F.softmax(x)
    np.testing.assert_allclose(y.numpy(), F.softmax(x, 0).numpy())  # 3-dim: dim 0
    with pytest.warns(UserWarning, match="log_softmax\\(\\) without dim"):
        z = nn.LogSoftmax()(ag.tensor(np.zeros((2, 5))))
    np.testing.assert_allclose(z.numpy(), np.full((2, 5), -np.log(5.0)))  # 2-dim: dim 1


async def test_linear_refuses_an_input_of_another_dtype(rt) -> None:
    lin = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="linear: input has dtype float64 but the weight has float32"):
        lin(ag.tensor(np.ones((4, 3))))
    assert lin(ag.tensor(np.ones((4, 3)), dtype="float32")).dtype == np.float32
    assert lin.double()(ag.tensor(np.ones((4, 3)))).dtype == np.float64


def test_conv2d_same_padding_with_stride_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^padding='same' is not supported for strided convolutions$"):
        nn.Conv2d(1, 1, 3, stride=2, padding="same")
