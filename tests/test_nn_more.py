"""asyncgrad.nn against PyTorch: Module fixes (names, train, containers, dtype casts, load_state_dict)
and the added activations, losses, functionals, containers and BatchNorm."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn import functional as F

from gradcheck import gradcheck

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
