"""The reductions (``ops/_reduce.py``): prod, all/any, amin, logsumexp, cumsum, var/std; values, dtypes,
gradients against central finite differences in float64 and PyTorch (recorded, see tests/_reference.py).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

import asyncgrad as ag
from tests._util import arr, t, vs_torch


def _call_method(name: str, args: Any, kw: Any, x: Any) -> Any:
    """``x.name(*args, **kw)``: the same call on an asyncgrad or a torch tensor."""
    return getattr(x, name)(*args, **kw)


# ---- logsumexp, cumsum, var/std ----------------------------------------------------------------------------


async def test_logsumexp(rng: np.random.Generator, torch_ref: Any) -> None:
    async with ag.open_runtime():
        x = rng.standard_normal((3, 4, 5))
        for i, (dim, keep) in enumerate([(1, False), ((0, 2), True), (-1, True)]):
            await ag.autograd.gradcheck(
                lambda x, d=dim, k=keep: ag.logsumexp(x, d, k), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
            )
            await vs_torch(
                torch_ref,
                f"logsumexp-{i}",
                lambda x, d=dim, k=keep: ag.logsumexp(x, d, k),
                lambda torch, x, d=dim, k=keep: torch.logsumexp(x, d, k),
                x,
            )
        big = ag.tensor(np.array([[1000.0, 1000.0], [-1000.0, -np.inf]]))
        np.testing.assert_allclose(ag.logsumexp(big, 1).numpy(), [1000 + np.log(2), -1000])


async def test_cumsum(rng: np.random.Generator, torch_ref: Any) -> None:
    async with ag.open_runtime():
        x = rng.standard_normal((3, 4, 2))
        for dim in (0, 1, -1):
            await ag.autograd.gradcheck(lambda x, d=dim: ag.cumsum(x, d), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
            await vs_torch(
                torch_ref, f"cumsum{dim}", lambda x, d=dim: x.cumsum(d), lambda torch, x, d=dim: x.cumsum(d), x
            )
        i = ag.tensor(np.array([1, 2, 3], dtype=np.int32)).cumsum(0)
        assert i.dtype == np.int64 and i.numpy().tolist() == [1, 3, 6]


async def test_var_std(rng: np.random.Generator, torch_ref: Any) -> None:
    async with ag.open_runtime():
        x = rng.standard_normal((3, 4, 5))
        for i, (args, kw) in enumerate([
            ((), {}),
            ((1,), {}),
            (((0, 2),), {"keepdim": True}),
            ((1,), {"correction": 0}),
            ((2,), {"unbiased": False}),
            ((), {"correction": 2}),
        ]):
            var = functools.partial(_call_method, "var", args, kw)
            std = functools.partial(_call_method, "std", args, kw)
            await ag.autograd.gradcheck(var, [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
            await ag.autograd.gradcheck(std, [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
            await vs_torch(torch_ref, f"var-{i}", var, lambda torch, x, f=var: f(x), x)
            await vs_torch(torch_ref, f"std-{i}", std, lambda torch, x, f=std: f(x), x)
        np.testing.assert_allclose(ag.var(ag.tensor(x), False).item(), x.var())


R = np.random.default_rng(77)


# ---- reductions -----------------------------------------------------------------------------------------


async def test_prod_values_and_dtypes(rt: Any) -> None:
    a = R.uniform(0.5, 1.5, (2, 3, 4))
    np.testing.assert_allclose(arr(ag.prod(t(a))), np.prod(a))
    np.testing.assert_allclose(arr(t(a).prod(1)), np.prod(a, 1))
    assert t(a).prod(-1, keepdim=True).shape == (2, 3, 1)
    assert ag.prod(t([1, 2, 3], dtype=np.int32)).dtype == np.int64  # integers multiply in int64
    assert ag.prod(t([True, False])).dtype == np.int64
    assert ag.prod(t([1, 2]), dtype=np.float32).dtype == np.float32
    assert t(a, dtype=np.float32).prod(0).dtype == np.float32


async def test_prod_gradient_with_zeros(rt: Any) -> None:
    x = t([[2.0, 0.0, 3.0], [0.0, 0.0, 5.0], [1.0, 2.0, 4.0]], requires_grad=True)
    (g,) = await ag.grad(x.prod(1).sum(), [x])
    np.testing.assert_array_equal(arr(g), [[0, 6, 0], [0, 0, 0], [8, 4, 2]])
    (g,) = await ag.grad(ag.prod(x[0]), [x])
    np.testing.assert_array_equal(arr(g)[0], [0, 6, 0])


async def test_all_any(rt: Any) -> None:
    a = np.array([[1, 0, 2], [3, 4, 5]])
    assert arr(ag.all(t(a))).item() is False and ag.all(t(a)).dtype == np.bool_
    np.testing.assert_array_equal(arr(t(a).all(1)), [False, True])
    np.testing.assert_array_equal(arr(ag.any(t(a == 0), 0, keepdim=True)), [[False, True, False]])
    assert ag.any(t(np.zeros((2, 0)))).item() is False and ag.all(t(np.zeros(0))).item() is True
    assert ag.all(t(a, dtype=np.uint8)).dtype == np.uint8  # PyTorch keeps uint8


async def test_amin(rt: Any) -> None:
    a = R.standard_normal((3, 4))
    np.testing.assert_array_equal(arr(ag.amin(t(a), 1)), a.min(1))
    np.testing.assert_array_equal(arr(t(a).amin()), a.min())
    assert t(a).amin(0, keepdim=True).shape == (1, 4)
