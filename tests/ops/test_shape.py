"""The shape ops (``ops/_shape.py``): split/chunk/unbind/narrow, flip/roll/movedim, repeat, tril/triu/diag/
trace, unfold; values against numpy and PyTorch, gradients against central finite differences.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import arr, t, torch_pair

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


torch = pytest.importorskip("torch")


# ---- unfold --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dim", "size", "step"),
    [((10,), 0, 3, 2), ((4, 7), 1, 3, 1), ((4, 7), 0, 2, 3), ((2, 5, 6), -1, 6, 1), ((2, 5, 6), 1, 1, 2),
     ((3, 4), 1, 0, 1)],
)
async def test_unfold_matches_torch(rt: ag.Runtime, shape: tuple, dim: int, size: int, step: int) -> None:
    a = np.random.default_rng(0).standard_normal(shape)
    x, tx = torch_pair(a, True)
    y, ty = x.unfold(dim, size, step), tx.unfold(dim, size, step)
    assert y.shape == tuple(ty.shape)
    np.testing.assert_array_equal(y.numpy(), ty.detach().numpy())
    w = np.random.default_rng(1).standard_normal(y.shape)
    (g,) = await ag.grad((y * ag.tensor(w)).sum(), [x])
    (tg,) = torch.autograd.grad((ty * torch.tensor(w)).sum(), [tx])
    np.testing.assert_allclose(g.numpy(), tg.numpy(), rtol=1e-14, atol=1e-14)


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
