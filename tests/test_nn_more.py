"""asyncgrad.nn against PyTorch: Module fixes (names, train, containers, dtype casts, load_state_dict)
and the added activations, losses, functionals, containers and BatchNorm."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext as _nullcontext

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn import functional as F

# ---- fixes: registration names -----------------------------------------------------------------


async def test_register_existing_name_raises_keyerror(rt) -> None:
    m = nn.Linear(2, 2)
    with pytest.raises(KeyError, match="attribute 'weight' already exists"):
        m.register_buffer("weight", ag.zeros(1))
    assert list(m.state_dict()) == ["weight", "bias"]
    with pytest.raises(KeyError, match="already exists"):
        m.add_module("bias", nn.ReLU())
    m.register_buffer("buf", ag.zeros(1))
    with pytest.raises(KeyError, match="attribute 'buf' already exists"):
        m.register_parameter("buf", nn.Parameter(ag.zeros(1)))
    with pytest.raises(KeyError, match="already exists"):
        m.register_buffer("forward", ag.zeros(1))  # a method
    m.plain = 3
    with pytest.raises(KeyError, match="already exists"):
        m.register_buffer("plain", ag.zeros(1))
    s = nn.Sequential(nn.ReLU())
    with pytest.raises(KeyError, match="already exists"):
        s.register_parameter("0", nn.Parameter(ag.zeros(1)))
    # the same kind may be registered again (replaced), as in PyTorch
    m.register_buffer("buf", ag.ones(2))
    assert m.buf.shape == (2,)
    m.register_parameter("bias", None)
    assert m.bias is None


# ---- fixes: train() calls the children's train() --------------------------------------------------


async def test_train_calls_children_train(rt) -> None:
    calls = []

    class Frozen(nn.Module):
        def train(self, mode: bool = True) -> nn.Module:
            calls.append(mode)
            return super().train(False)  # always stays in eval mode

    inner = Frozen()
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(inner, nn.Dropout()))
    net.train()
    assert calls == [True]
    assert net.training and net[0].training and net[1].training and not inner.training
    assert net[1][1].training
    net.eval()
    assert calls == [True, False]
    assert not net.training and not net[1][1].training and not inner.training
    with pytest.raises(ValueError):
        net.train("yes")  # type: ignore[arg-type]


# ---- fixes: ModuleList / Sequential as lists --------------------------------------------------------


async def test_modulelist_list_api(rt) -> None:
    a, b, c, d = nn.ReLU(), nn.Tanh(), nn.Sigmoid(), nn.Identity()
    ml = nn.ModuleList([a, b, c])
    tail = ml[1:]
    assert isinstance(tail, nn.ModuleList) and list(tail) == [b, c]
    assert ml[-1] is c
    with pytest.raises(IndexError, match="out of range"):
        ml[3]
    ml.insert(1, d)
    assert list(ml) == [a, d, b, c] and list(ml._modules) == ["0", "1", "2", "3"]
    assert ml.pop(1) is d
    assert list(ml) == [a, b, c] and list(ml._modules) == ["0", "1", "2"]
    ml[0] = d
    assert list(ml) == [d, b, c]
    del ml[0]
    assert list(ml) == [b, c] and list(ml._modules) == ["0", "1"]
    del ml[:1]
    assert list(ml) == [c]
    ml.extend([a, b])
    assert list(ml) == [c, a, b]
    both = ml + nn.ModuleList([d])
    assert isinstance(both, nn.ModuleList) and list(both) == [c, a, b, d]
    ml += [d]
    assert list(ml) == [c, a, b, d]
    with pytest.raises(TypeError):
        ml.extend(3)  # type: ignore[arg-type]
    lin = nn.ModuleList([nn.Linear(2, 3), nn.Linear(3, 1)])
    assert list(lin.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]


async def test_sequential_list_api(rt) -> None:
    a, b, c, d = nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1), nn.Identity()
    s = nn.Sequential(a, b, c)
    tail = s[1:]
    assert isinstance(tail, nn.Sequential) and list(tail) == [b, c]
    assert list(tail._modules) == ["1", "2"]  # PyTorch keeps the keys of a slice
    named = nn.Sequential(OrderedDict([("fc", a), ("act", b)]))
    assert list(named[:1]._modules) == ["fc"]
    s.insert(1, d)
    assert list(s) == [a, d, b, c] and list(s._modules) == ["0", "1", "2", "3"]
    assert s.pop(1) is d
    assert list(s) == [a, b, c]
    s[1] = d
    assert list(s) == [a, d, c]
    del s[1]
    assert list(s) == [a, c] and list(s._modules) == ["0", "1"]
    s.append(b)
    s.extend([d])
    assert list(s) == [a, c, b, d]
    s2 = nn.Sequential(a) + nn.Sequential(b)
    assert list(s2) == [a, b]
    with pytest.raises(IndexError):
        s.insert(9, d)
    with pytest.raises(IndexError):
        s[4]
    x = ag.randn(3, 2)
    out = nn.Sequential(a, b, c)(x)
    assert out.shape == (3, 1)


# ---- fixes: dtype casts keep the Parameter objects ---------------------------------------------------


async def test_to_dtype_keeps_parameters_and_casts_grads(rt) -> None:
    ag.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    params = list(model.parameters())
    opt = ag.optim.SGD(model.parameters(), lr=0.1)
    x = ag.randn(5, 3)
    await model(x).sum().backward()
    model.double()
    assert list(model.parameters()) == params  # the same objects
    assert all(p is q for p, q in zip(model.parameters(), params))
    for p in model.parameters():
        assert p.dtype == np.float64 and p.grad is not None and p.grad.dtype == np.float64
        assert isinstance(p, nn.Parameter) and p.requires_grad and p.is_leaf
    before = [p.numpy().copy() for p in params]
    opt.step()  # the optimizer built before .double() still updates the model
    for p, b in zip(params, before):
        assert p.dtype == np.float64
        assert not np.allclose(p.numpy(), b)
    opt.zero_grad()
    loss = model(x.double()).sum()
    assert loss.dtype == np.float64
    await loss.backward()
    assert params[0].grad is not None and params[0].grad.dtype == np.float64
    model.float()
    assert all(p.dtype == np.float32 and p is q for p, q in zip(model.parameters(), params))
    model.half()
    assert params[0].dtype == np.float16
    model.to(ag.float32)
    assert params[0].dtype == np.float32
    model.type(ag.float64)
    assert params[0].dtype == np.float64
    assert model.cpu() is model
    with pytest.raises(TypeError):
        model.to(ag.int64)


async def test_to_dtype_casts_buffers_and_get_parameter_buffer(rt) -> None:
    m = nn.Module()
    m.fc = nn.Linear(2, 2)
    m.fc.register_buffer("count", ag.zeros(1, dtype="int64"))
    m.register_buffer("stat", ag.zeros(2))
    m.double()
    assert m.stat.dtype == np.float64 and m.fc.count.dtype == np.int64
    assert m.get_parameter("fc.weight") is m.fc.weight
    assert m.get_buffer("fc.count") is m.fc.count
    assert m.get_buffer("stat") is m.stat
    assert m.get_submodule("fc") is m.fc
    with pytest.raises(AttributeError):
        m.get_parameter("fc.count")
    with pytest.raises(AttributeError):
        m.get_buffer("fc.weight")
    with pytest.raises(AttributeError):
        m.get_parameter("fc.nothing")
    with pytest.raises(AttributeError):
        m.get_submodule("nothing")


# ---- fixes: load_state_dict's result ------------------------------------------------------------------


async def test_load_state_dict_result_repr(rt) -> None:
    m = nn.Linear(2, 2)
    r = m.load_state_dict(m.state_dict())
    assert repr(r) == "<All keys matched successfully>"
    assert r.missing_keys == [] and r.unexpected_keys == []
    r2 = m.load_state_dict({"weight": np.zeros((2, 2), np.float32)}, strict=False)
    assert repr(r2) == "_IncompatibleKeys(missing_keys=['bias'], unexpected_keys=[])"


# ---- helpers for PyTorch comparisons ------------------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


async def _compare(ag_fn, torch_fn, arrays, *, grad_idx=None, atol=1e-10, rtol=1e-8):
    """Run ``ag_fn`` and ``torch_fn`` on float64 copies of ``arrays``; compare values and gradients."""
    torch = _torch()
    grad_idx = range(len(arrays)) if grad_idx is None else grad_idx
    xs = [ag.tensor(a, dtype=np.float64, requires_grad=i in grad_idx) for i, a in enumerate(arrays)]
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=i in grad_idx) for i, a in enumerate(arrays)]
    out = ag_fn(*xs)
    tout = torch_fn(*ts)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), atol=atol, rtol=rtol)
    assert out.dtype == np.float64
    w = np.random.default_rng(7).standard_normal(tuple(out.shape))
    grads = await ag.grad((out * ag.tensor(w)).sum(), [xs[i] for i in grad_idx], allow_unused=True)
    tgrads = torch.autograd.grad((tout * torch.tensor(w)).sum(), [ts[i] for i in grad_idx], allow_unused=True)
    for i, g, tg in zip(grad_idx, grads, tgrads):
        if tg is None:
            assert g is None or np.all(g.numpy() == 0), f"input {i}"
            continue
        assert g is not None, f"input {i} got no gradient"
        np.testing.assert_allclose(g.numpy(), tg.numpy(), atol=atol, rtol=rtol, err_msg=f"input {i}")


def _x(rng, *shape, scale=3.0):
    x = rng.standard_normal(shape) * scale
    x.flat[:4] = [0.0, 6.0, -1.0, 1.0][: min(4, x.size)]  # the kinks
    return x


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
async def test_activation_functionals_vs_torch(rt, rng, name, ag_fn, t_fn) -> None:
    torch = _torch()
    tF = torch.nn.functional
    x = _x(rng, 5, 7)
    x[0, 4:7] = [40.0, -40.0, 1000.0]  # large values: no overflow, no NaN gradient
    await _compare(ag_fn, lambda t: eval(t_fn, {"F": tF, "x": t}), [x])


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
async def test_activation_modules_vs_torch(rt, rng, make, tmake) -> None:
    torch = _torch()
    m = eval(make, {"nn": nn})
    tm = eval(tmake, {"nn": torch.nn})
    assert repr(m) == repr(tm)
    await _compare(m, tm, [_x(rng, 4, 6)])


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


async def test_activation_grad_at_kinks_and_dtype(rt) -> None:
    torch = _torch()
    x = np.array([-1.0, 0.0, 1.0, 6.0, -6.0, 3.0])
    for name in ("leaky_relu", "elu", "relu6", "hardtanh", "silu", "softplus"):
        await _compare(getattr(F, name), getattr(torch.nn.functional, name), [x])
    h = ag.tensor([-1.0, 2.0], dtype="float32")
    for f in (F.leaky_relu, F.silu, F.elu, F.softplus, F.relu6, F.hardtanh):
        assert f(h).dtype == np.float32


# ---- losses -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_regression_losses_vs_torch(rt, rng, reduction) -> None:
    torch = _torch()
    tF = torch.nn.functional
    a = rng.standard_normal((4, 5)) * 2
    b = rng.standard_normal((4, 5))
    b[0, 0] = a[0, 0] + 0.5  # inside beta / delta
    await _compare(
        lambda x, y: F.l1_loss(x, y, reduction=reduction), lambda x, y: tF.l1_loss(x, y, reduction=reduction), [a, b]
    )
    for beta in (1.0, 0.5, 0.0):
        await _compare(
            lambda x, y, beta=beta: F.smooth_l1_loss(x, y, reduction=reduction, beta=beta),
            lambda x, y, beta=beta: tF.smooth_l1_loss(x, y, reduction=reduction, beta=beta),
            [a, b],
        )
    for delta in (1.0, 2.5):
        await _compare(
            lambda x, y, delta=delta: F.huber_loss(x, y, reduction=reduction, delta=delta),
            lambda x, y, delta=delta: tF.huber_loss(x, y, reduction=reduction, delta=delta),
            [a, b],
        )
    w = rng.uniform(0.1, 2.0, (4, 5))
    await _compare(
        lambda x, y, ww: F.l1_loss(x, y, reduction=reduction, weight=ww),
        lambda x, y, ww: tF.l1_loss(x, y, reduction=reduction, weight=ww),
        [a, b, w],
        grad_idx=[0, 1],
    )
    await _compare(
        lambda x, y, ww: F.huber_loss(x, y, reduction=reduction, delta=0.7, weight=ww),
        lambda x, y, ww: tF.huber_loss(x, y, reduction=reduction, delta=0.7, weight=ww),
        [a, b, w],
        grad_idx=[0, 1],
    )
    for m, tm in (
        (nn.L1Loss(reduction=reduction), torch.nn.L1Loss(reduction=reduction)),
        (nn.SmoothL1Loss(reduction=reduction, beta=0.3), torch.nn.SmoothL1Loss(reduction=reduction, beta=0.3)),
        (nn.HuberLoss(reduction=reduction, delta=0.4), torch.nn.HuberLoss(reduction=reduction, delta=0.4)),
    ):
        await _compare(m, tm, [a, b])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_bce_vs_torch(rt, rng, reduction) -> None:
    torch = _torch()
    tF = torch.nn.functional
    p = rng.uniform(0.02, 0.98, (4, 3))
    t = rng.uniform(0.0, 1.0, (4, 3))
    t[0, 0], t[0, 1] = 0.0, 1.0
    await _compare(
        lambda x, y: F.binary_cross_entropy(x, y, reduction=reduction),
        lambda x, y: tF.binary_cross_entropy(x, y, reduction=reduction),
        [p, t],
    )
    w = rng.uniform(0.5, 2.0, (3,))  # broadcast over the batch
    await _compare(
        lambda x, y, ww: F.binary_cross_entropy(x, y, weight=ww, reduction=reduction),
        lambda x, y, ww: tF.binary_cross_entropy(x, y, weight=ww, reduction=reduction),
        [p, t, w],
        grad_idx=[0, 1],
    )
    tw = torch.tensor(w)
    m = nn.BCELoss(weight=ag.tensor(w), reduction=reduction)
    assert list(m.state_dict()) == list(torch.nn.BCELoss(weight=tw).state_dict()) == ["weight"]
    await _compare(m, torch.nn.BCELoss(weight=tw, reduction=reduction), [p, t])


async def test_bce_clamps_log_at_minus_100(rt) -> None:
    torch = _torch()
    p = np.array([0.0, 1.0, 0.0, 1.0, 0.5])
    t = np.array([1.0, 0.0, 0.0, 1.0, 1.0])
    out = F.binary_cross_entropy(ag.tensor(p), ag.tensor(t), reduction="none")
    want = torch.nn.functional.binary_cross_entropy(torch.tensor(p), torch.tensor(t), reduction="none")
    np.testing.assert_allclose(out.numpy(), want.numpy())
    assert out.numpy()[0] == 100.0
    x = ag.tensor(p, requires_grad=True)
    (g,) = await ag.grad(F.binary_cross_entropy(x, ag.tensor(t), reduction="sum"), [x])
    tx = torch.tensor(p, requires_grad=True)
    (tg,) = torch.autograd.grad(torch.nn.functional.binary_cross_entropy(tx, torch.tensor(t), reduction="sum"), [tx])
    np.testing.assert_allclose(g.numpy(), tg.numpy())
    with pytest.raises(ValueError, match="target size"):
        F.binary_cross_entropy(ag.tensor(p), ag.tensor(t[:2]))
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        F.binary_cross_entropy(ag.tensor([1.5]), ag.tensor([1.0])).item()


@pytest.mark.parametrize("reduction", ["mean", "batchmean", "sum", "none"])
@pytest.mark.parametrize("log_target", [False, True])
async def test_kl_div_vs_torch(rt, rng, reduction, log_target) -> None:
    torch = _torch()
    tF = torch.nn.functional
    logits = rng.standard_normal((3, 5))
    inp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    q = rng.dirichlet(np.ones(5), size=3)
    q[0, 0] = 0.0 if not log_target else q[0, 0]  # xlogy(0, 0) = 0
    tgt = np.log(q) if log_target else q
    grad_idx = [0, 1] if log_target else [0]  # torch's target gradient at 0 is -inf
    with pytest.warns(UserWarning) if reduction == "mean" else _nullcontext():
        await _compare(
            lambda x, y: F.kl_div(x, y, reduction=reduction, log_target=log_target),
            lambda x, y: tF.kl_div(x, y, reduction=reduction, log_target=log_target),
            [inp, tgt],
            grad_idx=grad_idx,
        )
    m = nn.KLDivLoss(reduction=reduction, log_target=log_target)
    tm = torch.nn.KLDivLoss(reduction=reduction, log_target=log_target)
    with pytest.warns(UserWarning) if reduction == "mean" else _nullcontext():
        await _compare(m, tm, [inp, tgt], grad_idx=grad_idx)


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


async def test_loss_modules_reductions_and_legacy(rt) -> None:
    with pytest.raises(ValueError):
        nn.L1Loss(reduction="batchmean")
    assert nn.L1Loss(size_average=False).reduction == "sum"
    assert nn.KLDivLoss(reduction="batchmean").reduction == "batchmean"
    assert nn.NLLLoss().reduction == "mean" and nn.BCEWithLogitsLoss().reduction == "mean"
    torch = _torch()
    for m, tm in ((nn.HuberLoss(), torch.nn.HuberLoss()), (nn.KLDivLoss(), torch.nn.KLDivLoss())):
        assert repr(m) == repr(tm)


# ---- one_hot, pad, normalize ------------------------------------------------------------------------


async def test_one_hot_vs_torch(rt) -> None:
    torch = _torch()
    idx = np.array([[0, 3], [2, 1]], dtype=np.int64)
    out = F.one_hot(ag.tensor(idx))
    want = torch.nn.functional.one_hot(torch.tensor(idx))
    assert out.dtype == np.int64 and out.shape == tuple(want.shape) == (2, 2, 4)
    np.testing.assert_array_equal(out.numpy(), want.numpy())
    out6 = F.one_hot(ag.tensor(idx), num_classes=6)
    np.testing.assert_array_equal(out6.numpy(), torch.nn.functional.one_hot(torch.tensor(idx), 6).numpy())
    with pytest.raises(RuntimeError, match="smaller than num_classes"):
        F.one_hot(ag.tensor(idx), num_classes=3)
    with pytest.raises(RuntimeError, match="non-negative"):
        F.one_hot(ag.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="LongTensor"):
        F.one_hot(ag.tensor([0.0, 1.0]))


@pytest.mark.parametrize(
    "pad", [(1, 2), (0, 1, 2, 0), (1, 1, 1, 1, 1, 1), (-1, 2), (2, -1, -1, 0), (0, 0)]
)
async def test_pad_vs_torch(rt, rng, pad) -> None:
    torch = _torch()
    x = rng.standard_normal((2, 3, 4))
    await _compare(lambda t: F.pad(t, pad), lambda t: torch.nn.functional.pad(t, pad), [x])
    await _compare(
        lambda t: F.pad(t, pad, value=-2.5), lambda t: torch.nn.functional.pad(t, pad, value=-2.5), [x]
    )
    with pytest.raises(ValueError):
        F.pad(ag.tensor(x), (1,))
    with pytest.raises(NotImplementedError):
        F.pad(ag.tensor(x), (1, 1), mode="reflect")


@pytest.mark.parametrize("p, dim", [(2.0, 1), (1.0, 0), (3.0, -1), (2.0, 2)])
async def test_normalize_vs_torch(rt, rng, p, dim) -> None:
    torch = _torch()
    x = rng.standard_normal((3, 4, 2))
    x[0, :, 0] = 0.0  # a zero vector: the eps clamp
    await _compare(
        lambda t: F.normalize(t, p=p, dim=dim), lambda t: torch.nn.functional.normalize(t, p=p, dim=dim), [x]
    )


# ---- ModuleDict, ParameterList, ParameterDict -------------------------------------------------------


async def test_module_dict(rt) -> None:
    torch = _torch()
    md = nn.ModuleDict({"fc": nn.Linear(2, 3), "act": nn.ReLU()})
    tmd = torch.nn.ModuleDict({"fc": torch.nn.Linear(2, 3), "act": torch.nn.ReLU()})
    assert list(md) == list(tmd) == ["fc", "act"]
    assert list(md.state_dict()) == list(tmd.state_dict()) == ["fc.weight", "fc.bias"]
    assert "fc" in md and len(md) == 2 and isinstance(md["act"], nn.ReLU)
    md["out"] = nn.Linear(3, 1)
    assert list(md.keys()) == ["fc", "act", "out"]
    assert [n for n, _ in md.named_parameters()] == ["fc.weight", "fc.bias", "out.weight", "out.bias"]
    md.update([("extra", nn.Tanh())])
    assert isinstance(md.pop("extra"), nn.Tanh) and "extra" not in md
    del md["act"]
    assert list(md) == ["fc", "out"]
    assert [k for k, _ in md.items()] == ["fc", "out"] and len(list(md.values())) == 2
    with pytest.raises(KeyError):
        md["nothing"]
    md.clear()
    assert len(md) == 0 and list(md.parameters()) == []

    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleDict({"a": nn.Linear(2, 1)})

    assert list(Owner().state_dict()) == ["heads.a.weight", "heads.a.bias"]


async def test_parameter_list(rt) -> None:
    torch = _torch()
    pl = nn.ParameterList([nn.Parameter(ag.zeros(2, 3)), ag.ones(4)])
    tpl = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2, 3)), torch.ones(4)])
    assert list(pl.state_dict()) == list(tpl.state_dict()) == ["0", "1"]
    assert len(pl) == 2 and all(isinstance(p, nn.Parameter) and p.requires_grad for p in pl)
    assert pl[1].shape == (4,) and pl[-1] is pl[1]
    pl.append(ag.zeros(1))
    pl.extend([nn.Parameter(ag.zeros(5))])
    assert [tuple(p.shape) for p in pl] == [(2, 3), (4,), (1,), (5,)]
    assert [n for n, _ in pl.named_parameters()] == ["0", "1", "2", "3"]
    sl = pl[1:3]
    assert isinstance(sl, nn.ParameterList) and [tuple(p.shape) for p in sl] == [(4,), (1,)]
    assert sl[0] is pl[1]
    new = nn.Parameter(ag.ones(7))
    pl[0] = new
    assert pl[0] is new and pl.state_dict()["0"].shape == (7,)
    with pytest.raises(IndexError):
        pl[4]

    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = nn.ParameterList([ag.zeros(2), ag.zeros(3)])

        def forward(self, x: ag.Tensor) -> ag.Tensor:
            return x * self.ps[0] + self.ps[1].sum()

    o = Owner()
    assert list(o.state_dict()) == ["ps.0", "ps.1"]
    await o(ag.ones(2)).sum().backward()
    assert o.ps[0].grad is not None and o.ps[1].grad is not None
    assert "Parameter containing" in repr(pl)


async def test_parameter_dict(rt) -> None:
    torch = _torch()
    pd = nn.ParameterDict({"b": ag.zeros(2), "a": nn.Parameter(ag.ones(3))})
    tpd = torch.nn.ParameterDict({"b": torch.zeros(2), "a": torch.nn.Parameter(torch.ones(3))})
    assert list(pd) == list(tpd) == ["a", "b"]  # a plain dict's keys are sorted, as torch
    assert list(pd.state_dict()) == list(tpd.state_dict())
    assert all(isinstance(v, nn.Parameter) for v in pd.values())
    od = nn.ParameterDict(OrderedDict([("z", ag.zeros(1)), ("y", ag.zeros(1))]))
    assert list(od.keys()) == ["z", "y"]
    pd["c"] = ag.zeros(4)
    assert list(pd) == ["a", "b", "c"] and pd["c"].requires_grad and "c" in pd and len(pd) == 3
    assert [n for n, _ in pd.named_parameters()] == ["a", "b", "c"]
    assert pd.pop("b").shape == (2,) and "b" not in pd and list(pd.state_dict()) == ["a", "c"]
    assert pd.get("nothing") is None and pd.get("a") is pd["a"]
    pd.update([("d", ag.zeros(1))])
    assert [k for k, _ in pd.items()] == ["a", "c", "d"]
    pd.clear()
    assert len(pd) == 0 and list(pd.parameters()) == []


# ---- BatchNorm -------------------------------------------------------------------------------------------


def _copy_to_torch(m, tm) -> None:
    torch = _torch()
    with torch.no_grad():
        for k, v in m.state_dict().items():
            tm.state_dict()[k].copy_(torch.from_numpy(np.array(v)))


async def _bn_steps(rt, rng, make, tmake, shape, steps=3) -> None:
    torch = _torch()
    m = make()
    tm = tmake()
    assert repr(m) == repr(tm)
    assert list(m.state_dict()) == list(tm.state_dict())
    m.double()
    tm.double()
    if m.weight is not None:  # non-trivial affine parameters, the same in both
        w = rng.uniform(0.5, 1.5, m.num_features)
        b = rng.standard_normal(m.num_features)
        with ag.no_grad():
            m.weight.copy_(w)
            if m.bias is not None:
                m.bias.copy_(b)
    _copy_to_torch(m, tm)
    for step in range(steps):
        x = rng.standard_normal(shape) * 2 + 1
        for mode in ("train", "eval"):
            getattr(m, mode)()
            getattr(tm, mode)()
            xa = ag.tensor(x, requires_grad=True)
            xt = torch.tensor(x, requires_grad=True)
            out, tout = m(xa), tm(xt)
            np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), atol=1e-10, rtol=1e-8)
            g = np.random.default_rng(step).standard_normal(shape)
            params = [xa, *m.parameters()]
            tparams = [xt, *tm.parameters()]
            grads = await ag.grad((out * ag.tensor(g)).sum(), params)
            tgrads = torch.autograd.grad((tout * torch.tensor(g)).sum(), tparams)
            for a, t in zip(grads, tgrads):
                np.testing.assert_allclose(a.numpy(), t.numpy(), atol=1e-10, rtol=1e-8)
            sd, tsd = m.state_dict(), tm.state_dict()
            for k in tsd:
                np.testing.assert_allclose(sd[k], tsd[k].numpy(), atol=1e-12, rtol=1e-10, err_msg=f"{k} {mode}")
                assert sd[k].dtype == tsd[k].numpy().dtype, k


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
async def test_batchnorm1d_vs_torch(rt, rng, kw) -> None:
    torch = _torch()
    await _bn_steps(rt, rng, lambda: nn.BatchNorm1d(3, **kw), lambda: torch.nn.BatchNorm1d(3, **kw), (5, 3))
    await _bn_steps(rt, rng, lambda: nn.BatchNorm1d(3, **kw), lambda: torch.nn.BatchNorm1d(3, **kw), (4, 3, 6))


@pytest.mark.parametrize("kw", [{}, {"momentum": None}, {"track_running_stats": False}])
async def test_batchnorm2d_vs_torch(rt, rng, kw) -> None:
    torch = _torch()
    await _bn_steps(rt, rng, lambda: nn.BatchNorm2d(2, **kw), lambda: torch.nn.BatchNorm2d(2, **kw), (3, 2, 4, 5))


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
    with pytest.raises(ValueError, match="padding='same' needs stride 1"):
        nn.Conv2d(1, 1, 3, stride=2, padding="same")
