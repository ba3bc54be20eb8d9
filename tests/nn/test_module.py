"""``nn.Module`` and the containers (``nn/_module.py``): parameters, buffers, children, hooks, train/eval,
dtype and device moves, Sequential/ModuleList/ModuleDict/ParameterList/ParameterDict, and a quick run of
examples/train_many.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


# ---- ModuleDict, ParameterList, ParameterDict -------------------------------------------------------


async def test_module_dict(rt, torch_ref) -> None:
    md = nn.ModuleDict({"fc": nn.Linear(2, 3), "act": nn.ReLU()})

    def reference(torch):
        tmd = torch.nn.ModuleDict({"fc": torch.nn.Linear(2, 3), "act": torch.nn.ReLU()})
        return {"keys": list(tmd), "state_keys": list(tmd.state_dict())}

    want = torch_ref("module_dict", reference)
    assert list(md) == want["keys"] == ["fc", "act"]
    assert list(md.state_dict()) == want["state_keys"] == ["fc.weight", "fc.bias"]
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


async def test_parameter_list(rt, torch_ref) -> None:
    pl = nn.ParameterList([nn.Parameter(ag.zeros(2, 3)), ag.ones(4)])

    def reference(torch):
        tpl = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2, 3)), torch.ones(4)])
        return list(tpl.state_dict())

    assert list(pl.state_dict()) == torch_ref("parameter_list_state_keys", reference) == ["0", "1"]
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


async def test_parameter_dict(rt, torch_ref) -> None:
    pd = nn.ParameterDict({"b": ag.zeros(2), "a": nn.Parameter(ag.ones(3))})

    def reference(torch):
        tpd = torch.nn.ParameterDict({"b": torch.zeros(2), "a": torch.nn.Parameter(torch.ones(3))})
        return {"keys": list(tpd), "state_keys": list(tpd.state_dict())}

    want = torch_ref("parameter_dict", reference)
    assert list(pd) == want["keys"] == ["a", "b"]  # a plain dict's keys are sorted, as torch
    assert list(pd.state_dict()) == want["state_keys"]
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
