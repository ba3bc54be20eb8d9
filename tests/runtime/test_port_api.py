"""Issue 20 (part 2): the device, copy and construction names PyTorch programs use."""

from __future__ import annotations

import copy
import gc
import warnings
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn

# ---- ag.device and ag.cuda -------------------------------------------------------------------------


def test_device_object_parses_and_compares() -> None:
    d = ag.device("cpu")
    assert (d.type, d.index, str(d), repr(d)) == ("cpu", None, "cpu", "device(type='cpu')")
    d1 = ag.device("cuda", 1)
    assert (d1.type, d1.index, str(d1)) == ("cuda", 1, "cuda:1")
    assert ag.device("cuda:1") == d1 and hash(ag.device("cuda:1")) == hash(d1)
    assert ag.device(d1) == d1 and d != d1
    assert ag.device("cpu") == "cpu" and ag.device("cpu") != "cuda"
    assert copy.deepcopy(d) is d
    with pytest.raises(RuntimeError, match="device type at start of device string: gpu"):
        ag.device("gpu")
    with pytest.raises(RuntimeError, match="must not include an index"):
        ag.device("cuda:0", 1)
    with pytest.raises(RuntimeError, match="Invalid device string"):
        ag.device("cuda:x")
    with pytest.raises(RuntimeError, match="negative"):
        ag.device("cuda", -1)
    with pytest.raises(TypeError, match="expects a string"):
        ag.device(3.0)


def test_cuda_names_without_a_gpu() -> None:
    # the devices layer has no CUDA device yet, so no program may choose one (whatever cupy says)
    assert ag.cuda.is_available() is False
    assert ag.cuda.device_count() == 0
    ag.cuda.manual_seed(0)
    ag.cuda.manual_seed_all(0)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        ag.cuda.synchronize()


async def test_tensor_device_equals_device_object(rt: ag.Runtime) -> None:
    t = ag.zeros(2, device=ag.device("cpu"))
    assert t.device == ag.device("cpu") and ag.device("cpu") == t.device
    assert t.device == "cpu"
    assert ag.device(t.device) == ag.device("cpu", 0)


async def test_factories_take_device_objects(rt: ag.Runtime) -> None:
    dev = ag.device("cpu")
    made = [
        ag.tensor([1.0], device=dev), ag.zeros(2, device=dev), ag.ones(2, device=dev), ag.empty(2, device=dev),
        ag.full((2,), 3.0, device=dev), ag.arange(3, device=dev), ag.randn(2, device=dev),
        ag.rand(2, device=dev), ag.randint(0, 3, (2,), device=dev), ag.eye(2, device=dev),
        ag.linspace(0, 1, 3, device=dev), ag.normal(0.0, 1.0, (2,), device=dev),
    ]
    x = made[1]
    made += [
        ag.zeros_like(x, device=dev), ag.ones_like(x, device=dev), ag.empty_like(x, device=dev),
        ag.full_like(x, 2.0, device=dev), ag.randn_like(x, device=dev), ag.rand_like(x, device=dev),
        nn.Parameter(np.zeros(2), device=dev), nn.Linear(2, 3, device=dev).weight,
        x.new_zeros(2, device=dev), x.new_ones(2, device=dev), x.new_empty(2, device=dev),
        x.new_full((2,), 1.0, device=dev), x.new_tensor([1.0], device=dev),
    ]
    assert all(t.device == dev for t in made)
    with pytest.raises(RuntimeError, match="CUDA device needs cupy and a GPU"):
        ag.zeros(2, device=ag.device("cuda"))


async def test_tensor_to_forms(rt: ag.Runtime) -> None:
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    assert x.to(ag.device("cpu")) is x
    assert x.to("cpu", non_blocking=True) is x
    assert x.to(rt.device("cpu")) is x
    y = x.to(ag.float64)
    assert y.dtype == np.float64 and y.grad_fn is not None
    assert x.to("cpu", ag.float64).dtype == np.float64
    assert x.to(device="cpu", dtype="float64").dtype == np.float64
    assert x.to("float64").dtype == np.float64
    other = ag.zeros(1, dtype=ag.float64)
    assert x.to(other).dtype == np.float64
    c = x.to("cpu", copy=True)
    assert c is not x and np.array_equal(c.numpy(), x.numpy())
    c2 = x.to(ag.float32, False, True)  # positional non_blocking, copy
    assert c2 is not x
    (g,) = await ag.grad(y.sum(), [x])
    np.testing.assert_array_equal(g.numpy(), [1.0, 1.0])
    with pytest.raises(TypeError, match="unexpected keyword"):
        x.to("cpu", blocking=True)
    with pytest.raises(TypeError, match="neither a device nor a dtype"):
        x.to("nonsense")
    with pytest.raises(TypeError, match="invalid combination"):
        x.to("cpu", ag.float64, 3)


async def test_cuda_and_pinned_memory_without_a_gpu(rt: ag.Runtime) -> None:
    x = ag.ones(2)
    with pytest.raises(RuntimeError, match=r"CUDA device needs cupy and a GPU.*use device='cpu'"):
        x.cuda()
    with pytest.raises(RuntimeError, match="CUDA device needs cupy and a GPU"):
        x.to("cuda:0")
    m = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="CUDA device needs cupy and a GPU"):
        m.cuda()
    with pytest.raises(RuntimeError, match="CUDA device needs cupy and a GPU"):
        m.to(ag.device("cuda", 0))
    assert x.pin_memory() is x and x.is_pinned() is False


async def test_module_to_forms(rt: ag.Runtime) -> None:
    m = nn.Linear(2, 3)
    w = m.weight
    assert m.to(ag.device("cpu")) is m and m.weight is w
    m.to("cpu", non_blocking=True)
    m.to(ag.device("cpu"), ag.float64)
    assert m.weight.dtype == np.float64 and m.weight is w
    m.to(ag.zeros(1, dtype=ag.float32))
    assert m.weight.dtype == np.float32
    m.to(dtype=ag.float64)
    assert m.weight.dtype == np.float64
    with pytest.raises(TypeError, match="unexpected keyword"):
        m.to(devise="cpu")


# ---- Tensor(...) construction ----------------------------------------------------------------------


async def test_legacy_constructor(rt: ag.Runtime, torch_ref) -> None:
    cases = [(2, 3), ([1.0, 2.0],), ([[1, 2], [3, 4]],), (), (np.arange(3),)]

    def reference(torch: Any) -> list[Any]:
        out = []
        for args in cases:
            r = torch.Tensor(*args)
            # torch.Tensor(2, 3) is uninitialised memory: only the values built from data are compared
            out.append((r.shape, r.dtype, r if args and not isinstance(args[0], int) else None))
        return out

    wants = torch_ref("legacy_constructor", reference, cases=cases)
    assert len(wants) == len(cases)
    for args, (r_shape, r_dtype, r_values) in zip(cases, wants):
        t = ag.Tensor(*args)
        assert t.shape == r_shape and str(t.dtype) == r_dtype.replace("torch.", "")
        if args and not isinstance(args[0], int):
            np.testing.assert_array_equal(t.numpy(), r_values)
    assert isinstance(ag.Tensor(2), ag.Tensor) and ag.Tensor(2).requires_grad is False
    with pytest.raises(TypeError, match=r"new\(\): data must be a sequence \(got float\)"):
        ag.Tensor(2.5)
    with pytest.raises(TypeError, match="default dtype"):
        ag.Tensor(ag.zeros(2, dtype=ag.float64))
    ag.set_default_dtype(ag.float64)
    try:
        assert ag.Tensor(2).dtype == np.float64
    finally:
        ag.set_default_dtype(ag.float32)


# ---- copy.copy / copy.deepcopy ---------------------------------------------------------------------


async def test_deepcopy_tensor(rt: ag.Runtime) -> None:
    x = ag.tensor(np.arange(24.0).reshape(2, 3, 4).transpose(0, 2, 1), requires_grad=True)
    await (x * x).sum().backward()
    y = copy.deepcopy(x)
    assert y is not x and y.is_leaf and y.requires_grad
    assert y.stride() == x.stride()  # the layout is kept
    np.testing.assert_array_equal(y.numpy(), x.numpy())
    assert y.grad is not None and y.grad is not x.grad
    assert x.grad is not None
    np.testing.assert_array_equal(y.grad.numpy(), x.grad.numpy())
    with ag.no_grad():
        y.add_(1.0)
        y.grad.zero_()  # type: ignore[union-attr]
    np.testing.assert_array_equal(x.grad.numpy(), 2 * x.numpy())  # independent memory
    assert x.numpy()[0, 0, 0] == 0.0
    # deepcopy keeps aliasing within one copy
    a, b = copy.deepcopy([x, x])
    assert a is b
    with pytest.raises(RuntimeError, match=r"Only Tensors created explicitly by the user \(graph leaves\)"):
        copy.deepcopy(x * 2)


async def test_copy_tensor_shares_memory(rt: ag.Runtime) -> None:
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    await (x * 3).sum().backward()
    c = copy.copy(x)
    assert c is not x and c.requires_grad and c.is_leaf and c.grad is None  # as PyTorch's
    assert np.shares_memory(c.numpy(), x.numpy())
    nl = copy.copy(x * 2)  # PyTorch allows copy.copy of a non-leaf: a leaf on the same memory
    assert nl.is_leaf and nl.requires_grad


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 3)
        self.fc2.weight = nn.Parameter(self.fc1.weight.detach().T.clone())  # a separate parameter
        self.tied = self.fc1  # the same submodule twice: shared in the copy too
        self.register_buffer("steps", ag.zeros(1))
        self.note = {"kind": "net"}

    def forward(self, x: ag.Tensor) -> ag.Tensor:
        return self.fc2(ag.relu(self.tied(x)))


async def test_deepcopy_module_is_independent_and_shares_correctly(rt: ag.Runtime) -> None:
    net = _Net()
    x = ag.tensor(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32))
    target = copy.deepcopy(net)
    assert target.tied is target.fc1 and target.fc1 is not net.fc1
    assert target.fc1.weight is not net.fc1.weight
    assert isinstance(target.fc1.weight, nn.Parameter) and target.fc1.weight.requires_grad
    assert [n for n, _ in target.named_parameters()] == [n for n, _ in net.named_parameters()]
    assert target.note == net.note and target.note is not net.note
    np.testing.assert_array_equal(target(x).numpy(), net(x).numpy())
    opt = ag.optim.SGD(net.parameters(), lr=0.5)
    await net(x).sum().backward()
    opt.step()
    # training the online net leaves the target as it was
    assert not np.allclose(target(x).numpy(), net(x).numpy())
    assert all(p.grad is None for p in target.parameters())
    target.load_state_dict(net.state_dict())
    np.testing.assert_allclose(target(x).numpy(), net(x).numpy(), rtol=0, atol=0)
    shallow = copy.copy(net)
    assert shallow.fc1 is net.fc1


async def test_deepcopy_makes_no_nursery_noise(rt: ag.Runtime) -> None:
    # before: deepcopy walked from a tensor into its device actor, copied its nursery and coroutines, and
    # the half-built copies printed "Exception ignored in: Nursery.__del__" when collected
    import sys
    from io import StringIO

    net = _Net()
    with trio.fail_after(20):
        await (net(ag.ones(2, 3)).sum()).backward()
    err, old = StringIO(), sys.stderr
    sys.stderr = err
    old_hook = sys.unraisablehook
    seen: list[object] = []
    sys.unraisablehook = lambda u: seen.append(u)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                copy.deepcopy(net)
                copy.deepcopy(net.fc1.weight)
            gc.collect()
    finally:
        sys.stderr = old
        sys.unraisablehook = old_hook
    assert seen == [] and "Nursery" not in err.getvalue()
    assert copy.deepcopy(rt.device("cpu")) is rt.device("cpu")


# ---- the ag.autograd namespace ---------------------------------------------------------------------


class _Cube(ag.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return g * 3 * x * x


async def test_autograd_namespace_against_torch(rt: ag.Runtime, torch_ref) -> None:
    xv = np.array([0.5, -1.5, 2.0])
    x = ag.tensor(xv, dtype=ag.float64, requires_grad=True)

    def reference(torch: Any) -> Any:
        tx = torch.tensor(xv, requires_grad=True)
        (tg,) = torch.autograd.grad((tx.sin() * tx).sum(), [tx], only_inputs=True)
        return tg

    (g,) = await ag.autograd.grad((x.sin() * x).sum(), [x], only_inputs=True)
    tg = torch_ref("grad_only_inputs", reference, xv=xv)
    np.testing.assert_allclose(g.numpy(), tg, rtol=1e-14)
    with pytest.warns(FutureWarning, match="only_inputs argument is deprecated"):
        (g2,) = await ag.autograd.grad((x * x).sum(), [x], only_inputs=False)
    np.testing.assert_allclose(g2.numpy(), 2 * xv)
    await ag.autograd.backward([(x * x).sum()])
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), 2 * xv)
    y = _Cube.apply(x)
    (g3,) = await ag.autograd.grad(y.sum(), [x])
    np.testing.assert_allclose(g3.numpy(), 3 * xv**2)
    assert ag.autograd.grad is ag.grad and ag.autograd.Function is ag.Function
    with ag.autograd.no_grad():
        assert not (x * 2).requires_grad
