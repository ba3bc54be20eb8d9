"""The shape ops (``ops/_shape.py``): split/chunk/unbind/narrow, flip/roll/movedim, repeat, tril/triu/diag/
trace, unfold; values against numpy and PyTorch, gradients against central finite differences.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import arr, set_inline_limit, t

# ---- shape ops ------------------------------------------------------------------------------------------


async def test_split_chunk_unbind_narrow(rt: Any) -> None:
    a = np.arange(14).reshape(2, 7)
    x = t(a)
    assert [p.shape for p in ag.split(x, 3, 1)] == [(2, 3), (2, 3), (2, 1)]
    assert [p.shape for p in x.split([2, 0, 5], dim=-1)] == [(2, 2), (2, 0), (2, 5)]
    assert [p.shape for p in ag.chunk(x, 3, 1)] == [(2, 3), (2, 3), (2, 1)]
    assert [p.shape for p in ag.chunk(t(np.arange(6)), 4)] == [(2,), (2,), (2,)]  # fewer than asked
    np.testing.assert_array_equal(np.concatenate([arr(p) for p in x.chunk(2, 1)], 1), a)
    rows = ag.unbind(x)
    assert isinstance(rows, tuple) and len(rows) == 2
    np.testing.assert_array_equal(arr(x.unbind(1)[4]), a[:, 4])
    np.testing.assert_array_equal(arr(x.narrow(1, 2, 3)), a[:, 2:5])
    np.testing.assert_array_equal(arr(ag.narrow(x, -1, -2, 2)), a[:, -2:])
    with pytest.raises(ag.OpError, match=r"split: sizes \[2, 2\] must be non-negative and sum to the size 7"):
        ag.split(x, [2, 2], 1)
    with pytest.raises(ag.OpError, match=r"narrow: start \(5\) \+ length \(3\) exceeds the size 7 of dim 1"):
        x.narrow(1, 5, 3)
    with pytest.raises(ag.OpError, match="chunk: chunks must be a positive int"):
        x.chunk(0)


async def test_flip_roll_movedim(rt: Any) -> None:
    a = np.arange(24).reshape(2, 3, 4)
    x = t(a)
    np.testing.assert_array_equal(arr(ag.flip(x, (0, 2))), np.flip(a, (0, 2)))
    np.testing.assert_array_equal(arr(x.flip(1)), np.flip(a, 1))
    np.testing.assert_array_equal(arr(ag.fliplr(x)), np.fliplr(a))
    np.testing.assert_array_equal(arr(ag.flipud(x)), np.flipud(a))
    np.testing.assert_array_equal(arr(ag.roll(x, (1, -5), (0, 2))), np.roll(a, (1, -5), (0, 2)))
    np.testing.assert_array_equal(arr(x.roll(7)), np.roll(a, 7))
    np.testing.assert_array_equal(arr(ag.movedim(x, 0, -1)), np.moveaxis(a, 0, -1))
    np.testing.assert_array_equal(arr(x.movedim((0, 1), (2, 0))), np.moveaxis(a, (0, 1), (2, 0)))
    np.testing.assert_array_equal(arr(ag.moveaxis(x, 2, 0)), np.moveaxis(a, 2, 0))
    np.testing.assert_array_equal(arr(ag.swapaxes(x, 0, 2)), np.swapaxes(a, 0, 2))
    np.testing.assert_array_equal(arr(x.swapdims(1, 2)), np.swapaxes(a, 1, 2))
    assert ag.unflatten(x, 2, (2, -1)).shape == (2, 3, 2, 2)
    assert x.unflatten(-1, (1, 4, 1)).shape == (2, 3, 1, 4, 1)
    with pytest.raises(ag.OpError, match=r"unflatten: sizes \(3, -1\) do not multiply to the size 4"):
        x.unflatten(2, (3, -1))
    with pytest.raises(ag.OpError, match="flip: dim 3 is out of range for a tensor of shape"):
        x.flip(3)


async def test_repeat_and_repeat_interleave(rt: Any) -> None:
    a = np.arange(6).reshape(2, 3)
    x = t(a)
    np.testing.assert_array_equal(arr(x.repeat(2, 3)), np.tile(a, (2, 3)))  # PyTorch's repeat is tile
    np.testing.assert_array_equal(arr(ag.repeat(x, (2, 1, 2))), np.tile(a, (2, 1, 2)))
    assert x.repeat(0, 1).shape == (0, 3)
    with pytest.raises(ag.OpError, match="repeat: got 1 repeat sizes"):
        x.repeat(2)
    np.testing.assert_array_equal(arr(ag.repeat_interleave(x, 2)), np.repeat(a, 2))
    np.testing.assert_array_equal(arr(x.repeat_interleave(2, dim=1)), np.repeat(a, 2, 1))
    np.testing.assert_array_equal(arr(x.repeat_interleave(t([1, 3]), dim=0)), np.repeat(a, [1, 3], 0))
    with pytest.raises(ag.OpError, match="repeat_interleave: repeats must be non-negative integers, one per entry"):
        x.repeat_interleave([1, 2], dim=1)


async def test_tril_triu_diag_trace(rt: Any) -> None:
    a = np.arange(24.0).reshape(2, 3, 4)
    for k in (-1, 0, 2):
        np.testing.assert_array_equal(arr(ag.tril(t(a), k)), np.tril(a, k))
        np.testing.assert_array_equal(arr(t(a).triu(diagonal=k)), np.triu(a, k))
    with pytest.raises(ag.OpError, match="tril: expected a tensor of at least 2 dims"):
        ag.tril(t([1.0]))
    m = a[0]
    for k in (-2, -1, 0, 1, 3, 5):
        np.testing.assert_array_equal(arr(ag.diag(t(m), k)), np.diag(m, k))
    v = np.array([1.0, 2.0, 3.0])
    for k in (-1, 0, 2):
        np.testing.assert_array_equal(arr(t(v).diag(k)), np.diag(v, k))
    assert ag.trace(t(m)).item() == np.trace(m)
    assert ag.trace(t(np.arange(6).reshape(2, 3))).dtype == np.int64
    with pytest.raises(ag.OpError, match="diag: expected a 1-D or 2-D tensor"):
        ag.diag(t(a))


# ---- unfold --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dim", "size", "step"),
    [((10,), 0, 3, 2), ((4, 7), 1, 3, 1), ((4, 7), 0, 2, 3), ((2, 5, 6), -1, 6, 1), ((2, 5, 6), 1, 1, 2),
     ((3, 4), 1, 0, 1)],
)
async def test_unfold_matches_torch(
    rt: ag.Runtime, torch_ref: Any, shape: tuple, dim: int, size: int, step: int
) -> None:
    a = np.random.default_rng(0).standard_normal(shape)

    def reference(torch: Any) -> Any:
        tx = torch.tensor(a, dtype=torch.float64, requires_grad=True)
        ty = tx.unfold(dim, size, step)
        tw = np.random.default_rng(1).standard_normal(tuple(ty.shape))
        (tg,) = torch.autograd.grad((ty * torch.tensor(tw)).sum(), [tx])
        return {"shape": ty.shape, "y": ty.detach(), "grad": tg}

    want = torch_ref("unfold", reference, a=a, dim=dim, size=size, step=step)
    x = ag.tensor(a, dtype=ag.float64, requires_grad=True)
    y = x.unfold(dim, size, step)
    assert y.shape == want["shape"]
    np.testing.assert_array_equal(y.numpy(), want["y"])
    w = np.random.default_rng(1).standard_normal(y.shape)
    (g,) = await ag.grad((y * ag.tensor(w)).sum(), [x])
    np.testing.assert_allclose(g.numpy(), want["grad"], rtol=1e-14, atol=1e-14)


async def test_unfold_gradients_by_finite_differences(rt: ag.Runtime) -> None:
    a = np.random.default_rng(2).standard_normal((3, 8))
    assert await ag.autograd.gradcheck(lambda x: x.unfold(1, 3, 2) ** 2, [a], rtol=1e-4)
    assert await ag.autograd.gradgradcheck(lambda x: x.unfold(1, 3, 2) ** 2, [a], rtol=1e-4)
    assert await ag.autograd.gradgradcheck(lambda x: ag.unfold(x * x, 0, 2, 1), [a], rtol=1e-4)


async def test_unfold_errors(rt: ag.Runtime) -> None:
    x = ag.zeros(2, 5)
    with pytest.raises(ag.OpError, match="maximum size for tensor at dimension 1 is 5 but size is 6"):
        x.unfold(1, 6, 1)
    with pytest.raises(ag.OpError, match="step is 0 but must be > 0"):
        x.unfold(1, 2, 0)
    with pytest.raises(ag.OpError, match="dim 2 is out of range"):
        x.unfold(2, 2, 1)


# ---- unfold is a view (PyTorch's) ----------------------------------------------------------------------------


@pytest.fixture(params=["inline", "lanes"])
def mode(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "lanes":
        set_inline_limit(monkeypatch, -1)
    return str(request.param)


def _input(a: np.ndarray, layout: str) -> ag.Tensor:
    # the same (possibly strided) layout on both sides (see _torch_input): a transpose, or every other column
    x = ag.tensor(np.ascontiguousarray(a), dtype=ag.float64)
    if layout == "transposed":
        return x.t()
    if layout == "sliced":
        return x[:, ::2]
    return x


def _torch_input(torch: Any, a: np.ndarray, layout: str) -> Any:
    """``_input``'s layout in torch."""
    tx = torch.tensor(np.ascontiguousarray(a), dtype=torch.float64)
    if layout == "transposed":
        return tx.t()
    if layout == "sliced":
        return tx[:, ::2]
    return tx


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize(("dim", "size", "step"), [(0, 2, 1), (1, 3, 2), (-1, 1, 1), (1, 2, 5), (0, 0, 1), (1, 4, 1)])
async def test_unfold_is_a_view_with_torchs_strides(
    rt: ag.Runtime, torch_ref: Any, mode: str, layout: str, dim: int, size: int, step: int
) -> None:
    a = np.random.default_rng(3).standard_normal((8, 8))

    def reference(torch: Any) -> Any:
        tu = _torch_input(torch, a, layout).unfold(dim, size, step)
        return {"shape": tu.shape, "stride": tu.stride(), "contiguous": tu.is_contiguous(), "u": tu}

    want = torch_ref("unfold_view", reference, a=a, layout=layout, dim=dim, size=size, step=step)
    x = _input(a, layout)
    u = x.unfold(dim, size, step)
    assert u.shape == want["shape"]
    assert u.stride() == want["stride"]
    assert u.is_contiguous() == want["contiguous"]
    np.testing.assert_array_equal(u.numpy(), want["u"])
    # the same memory: the window view's first element sits where torch's storage offset puts it
    assert u.numel() == 0 or np.shares_memory(u.numpy(), x.numpy())
    assert u._vc is x._vc  # one version counter


async def test_unfold_of_a_0d_tensor_is_a_view(rt: ag.Runtime, torch_ref: Any) -> None:
    def reference(torch: Any) -> Any:
        tx = torch.tensor(np.array(5.0), dtype=torch.float64)
        tu = tx.unfold(0, 1, 1)
        shape, stride = tu.shape, tu.stride()
        tx.add_(1)
        return {"shape": shape, "stride": stride, "u": tu.clone(), "version": tu._version}

    want = torch_ref("unfold_0d", reference)
    x = ag.tensor(np.array(5.0), dtype=ag.float64)
    u = x.unfold(0, 1, 1)
    assert u.shape == want["shape"] == (1,) and u.stride() == want["stride"]
    x.add_(1)
    np.testing.assert_array_equal(u.numpy(), want["u"])
    assert u._version == want["version"] == 1


async def test_writes_through_unfold_and_its_base_are_seen_by_each_other(
    rt: ag.Runtime, torch_ref: Any, mode: str
) -> None:
    a = np.arange(20.0).reshape(2, 10)

    def reference(torch: Any) -> Any:
        out: dict[str, Any] = {}
        tx = torch.tensor(a, dtype=torch.float64)
        tu = tx.unfold(1, 3, 1)
        tx.mul_(2)
        out["u_after_mul"] = tu.clone()
        tx[0, 4] = -1.0
        out["u_after_set"] = tu.clone()
        tv = tx.unfold(1, 2, 3)
        tv.add_(10)
        tv[1, 0, 1] = 7.0
        out["x_after_view_writes"] = tx.clone()
        out["u_after_view_writes"] = tu.clone()
        out["version"] = tx._version
        out["w_stride"] = tu.unfold(0, 1, 1).stride()
        return out

    want = torch_ref("unfold_writes", reference, a=a)
    x = ag.tensor(a, dtype=ag.float64)
    u = x.unfold(1, 3, 1)  # overlapping windows
    x.mul_(2)
    np.testing.assert_array_equal(u.numpy(), want["u_after_mul"])
    x[0, 4] = -1.0  # one element seen in the three windows holding it
    np.testing.assert_array_equal(u.numpy(), want["u_after_set"])
    assert (u.numpy() == -1.0).sum() == 3
    # non-overlapping windows (step >= size): a write through the view lands in the base, as in torch
    v = x.unfold(1, 2, 3)
    v.add_(10)
    v[1, 0, 1] = 7.0
    np.testing.assert_array_equal(x.numpy(), want["x_after_view_writes"])
    np.testing.assert_array_equal(u.numpy(), want["u_after_view_writes"])
    assert x._version == u._version == v._version == want["version"] == 4
    # an unfold of an unfold is a view of the first base too
    w = u.unfold(0, 1, 1)
    assert w.stride() == want["w_stride"]
    x.zero_()
    assert not w.numpy().any() and w._vc is x._vc


async def test_a_write_to_the_base_of_a_saved_unfold_raises(rt: ag.Runtime, mode: str) -> None:
    x = ag.tensor(np.ones((2, 3)), dtype="float64", requires_grad=True)
    w = ag.tensor(np.arange(8.0).reshape(2, 4), dtype="float64")
    y = (x * w.unfold(1, 3, 1)[:, 0]).sum()  # mul saves the window view
    w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        await y.backward()
    assert x.grad is None
    # and a write through the view to a saved base
    z = (x[:, :2].unfold(1, 1, 1) ** 2).sum()  # pow saves the view, not the base
    with ag.no_grad():
        w2 = x.detach()
        w2.unfold(1, 2, 1).mul_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        await z.backward()


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
async def test_unfold_view_gradients(rt: ag.Runtime, torch_ref: Any, mode: str, layout: str) -> None:
    a = np.random.default_rng(4).standard_normal((6, 10))

    def f(x: ag.Tensor) -> ag.Tensor:
        v = x.t() if layout == "transposed" else x[:, ::2] if layout == "sliced" else x
        return v.unfold(1, 3, 2).unfold(0, 2, 1) ** 2

    assert await ag.autograd.gradcheck(f, [a], rtol=1e-6)
    assert await ag.autograd.gradgradcheck(f, [a], rtol=1e-5)

    # against torch, through a view of a view and back into the base's shape
    def reference(torch: Any) -> Any:
        tx = _torch_input(torch, a, layout)
        tx.requires_grad_(True)
        tsrc = tx.unfold(0, 2, 2).unfold(1, 4, 1)
        twts = np.random.default_rng(5).standard_normal(tuple(tsrc.shape))
        (tg,) = torch.autograd.grad((tsrc * torch.tensor(twts)).sum(), [tx])
        return tg

    tg = torch_ref("unfold_view_grad", reference, a=a, layout=layout)
    x = _input(a, layout)
    x.requires_grad_(True)
    src = x.unfold(0, 2, 2).unfold(1, 4, 1)
    wts = np.random.default_rng(5).standard_normal(src.shape)
    (g,) = await ag.grad((src * ag.tensor(wts)).sum(), [x])
    np.testing.assert_allclose(g.numpy(), tg, rtol=1e-14, atol=1e-14)
