"""asyncgrad.nn: the Module API, PyTorch's default initialisation, layers, losses, modes, and the demo."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.act = nn.ReLU()
        self.register_buffer("count", ag.zeros(1))
        self.register_buffer("scratch", ag.zeros(2), persistent=False)
        self.plain = ag.ones(2)  # a plain tensor attribute is not a parameter

    def forward(self, x: ag.Tensor) -> ag.Tensor:
        return self.act(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(3, 2, bias=False)
        self.scale = nn.Parameter(ag.ones(2))

    def forward(self, x: ag.Tensor) -> ag.Tensor:
        return self.head(self.block(x)) * self.scale


# ---- Module API --------------------------------------------------------------------------------


async def test_named_parameters_buffers_children_modules() -> None:
    async with ag.open_runtime():
        net = Net()
        names = [n for n, _ in net.named_parameters()]
        assert names == ["scale", "block.fc.weight", "block.fc.bias", "head.weight"]
        assert all(p.requires_grad and p.is_leaf and isinstance(p, nn.Parameter) for p in net.parameters())
        assert not isinstance(net.block.plain, nn.Parameter)
        assert [n for n, _ in net.named_buffers()] == ["block.count", "block.scratch"]
        assert list(net.state_dict()) == [
            "scale",
            "block.count",
            "block.fc.weight",
            "block.fc.bias",
            "head.weight",
        ]
        assert [type(m).__name__ for m in net.children()] == ["Block", "Linear"]
        assert [type(m).__name__ for m in net.modules()] == ["Net", "Block", "Linear", "ReLU", "Linear"]
        assert [n for n, _ in net.named_modules()] == ["", "block", "block.fc", "block.act", "head"]
        assert net.get_submodule("block.fc") is net.block.fc
        seen: list[str] = []
        assert net.apply(lambda m: seen.append(type(m).__name__)) is net
        assert seen == ["Linear", "ReLU", "Block", "Linear", "Net"]  # children first, like PyTorch
        # a shared parameter is listed once
        net.head2 = net.head
        assert len(list(net.parameters())) == 4
        # reassigning / removing
        net.head.bias = None
        with pytest.raises(TypeError, match="parameter 'weight'"):
            net.head.weight = ag.ones(2, 3)
        del net.head2
        assert "head2" not in dict(net.named_children())


async def test_forward_call_hooks_and_repr() -> None:
    async with ag.open_runtime():
        ag.manual_seed(0)
        net = Net()
        x = ag.tensor(np.ones((5, 4)), dtype="float32")
        y = net(x)
        assert y.shape == (5, 2) and y.requires_grad
        calls: list[str] = []
        h1 = net.register_forward_pre_hook(lambda m, args: calls.append("pre"))
        h2 = net.register_forward_hook(lambda m, args, out: out * 0)
        assert np.all(net(x).numpy() == 0) and calls == ["pre"]
        h1.remove()
        h2.remove()
        assert np.allclose(net(x).numpy(), y.numpy())
        assert calls == ["pre"]
        r = repr(nn.Sequential(nn.Linear(2, 3), nn.ReLU()))
        assert "(0): Linear(in_features=2, out_features=3, bias=True)" in r and "(1): ReLU()" in r
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            _ = net.nope
        with pytest.raises(NotImplementedError, match="forward"):
            nn.Module()(x)


async def test_sequential_and_modulelist() -> None:
    async with ag.open_runtime():
        seq = nn.Sequential(OrderedDict([("a", nn.Linear(3, 4)), ("r", nn.ReLU()), ("b", nn.Linear(4, 2))]))
        assert len(seq) == 3 and isinstance(seq[-1], nn.Linear) and seq[0] is seq.a
        assert [n for n, _ in seq.named_parameters()] == ["a.weight", "a.bias", "b.weight", "b.bias"]
        assert len(seq[:2]) == 2
        ml = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
        assert len(list(ml.parameters())) == 6 and [n for n, _ in ml.named_parameters()][-1] == "2.bias"
        out = seq(ag.tensor(np.ones((2, 3)), dtype="float32"))
        assert out.shape == (2, 2)


async def test_train_eval_and_zero_grad() -> None:
    async with ag.open_runtime():
        net = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Sequential(nn.Dropout(0.2)))
        assert all(m.training for m in net.modules())
        assert net.eval() is net and not any(m.training for m in net.modules())
        net.train()
        assert all(m.training for m in net.modules())
        loss = net(ag.tensor(np.ones((4, 3)), dtype="float32")).sum()
        await loss.backward()
        assert all(p.grad is not None for p in net.parameters())
        net.zero_grad(set_to_none=False)
        for p in net.parameters():
            assert p.grad is not None and np.all(p.grad.numpy() == 0)
        net.zero_grad()
        assert all(p.grad is None for p in net.parameters())


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


async def test_to_double_and_requires_grad() -> None:
    async with ag.open_runtime():
        lin = nn.Linear(3, 2)
        w = lin.weight.numpy().copy()
        lin.double()
        assert lin.weight.dtype == np.float64 and isinstance(lin.weight, nn.Parameter)
        assert np.array_equal(lin.weight.numpy(), w.astype(np.float64))
        lin.to("float32")
        assert lin.bias.dtype == np.float32
        lin.requires_grad_(False)
        assert not any(p.requires_grad for p in lin.parameters())


async def test_to_device_moves_parameters_and_buffers() -> None:
    async with ag.open_runtime(cpu_devices=2) as rt:
        net = Block()
        w = net.fc.weight.numpy().copy()
        assert net.to("cpu:1") is net
        assert all(p.device is rt.device("cpu:1") for p in net.parameters())
        assert net.count.device is rt.device("cpu:1") and isinstance(net.fc.weight, nn.Parameter)
        assert np.array_equal(net.fc.weight.numpy(), w)
        loss = net(ag.ones(2, 4).to("cpu:1")).sum()
        await loss.backward()
        assert net.fc.weight.grad.device is rt.device("cpu:1")


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


# ---- layers and losses -------------------------------------------------------------------------


def _fd_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    for i in range(x.size):
        xp, xm = x.copy(), x.copy()
        xp.flat[i] += eps
        xm.flat[i] -= eps
        g.flat[i] = (f(xp) - f(xm)) / (2 * eps)
    return g


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


# ---- the demo ----------------------------------------------------------------------------------


def test_train_many_quick_smoke(tmp_path) -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "train_many.py"),
            "--quick",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
        # this checkout's asyncgrad (the default mode starts worker processes, which import it too)
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "best:" in proc.stdout and "wall time" in proc.stdout
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
