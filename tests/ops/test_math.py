"""The elementwise math ops (``ops/_math.py``): sin/cos, rounding, log1p..square, lerp, nan_to_num, the
predicates, allclose/equal and clamp; values, dtypes and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import arr, t, vs_torch


async def test_clamp(rng: np.random.Generator, torch_ref: Any) -> None:
    async with ag.open_runtime():
        x = rng.uniform(-2, 2, (4, 5))
        x[np.abs(np.abs(x) - 0.5) < 0.01] = 1.0  # keep FD away from the kinks
        await ag.autograd.gradcheck(lambda x: ag.clamp(x, -0.5, 0.5), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await ag.autograd.gradcheck(lambda x: x.clamp(min=-0.5), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await ag.autograd.gradcheck(lambda x: ag.clip(x, max=0.5), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        lo = rng.uniform(-1.5, 0, (1, 5))
        hi = rng.uniform(0, 1.5, (4, 1))
        hi[0, 0] = -1.7  # a row where max < min: the result is max everywhere
        for i, (a, b) in enumerate([(lo, hi), (lo, None), (None, hi)]):
            ins = [x] + [v for v in (a, b) if v is not None]

            def f(x: Any, *bounds: Any, a: Any = a, b: Any = b, mod: Any = ag) -> Any:
                it = iter(bounds)
                return mod.clamp(x, None if a is None else next(it), None if b is None else next(it))

            await ag.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
            await vs_torch(torch_ref, f"clamp-{i}", f, lambda torch, *t, f=f: f(*t, mod=torch), *ins)


R = np.random.default_rng(77)


# ---- elementwise math --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, ref",
    [
        ("sin", np.sin),
        ("cos", np.cos),
        ("log1p", np.log1p),
        ("expm1", np.expm1),
        ("rsqrt", lambda a: 1 / np.sqrt(a)),
        ("reciprocal", lambda a: 1 / a),
        ("square", np.square),
        ("floor", np.floor),
        ("ceil", np.ceil),
        ("round", np.round),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
async def test_unary_values_and_dtypes(rt: Any, name: str, ref: Callable[..., Any], dtype: Any) -> None:
    a = R.uniform(0.1, 3.0, (3, 4)).astype(dtype)
    for out in (getattr(ag, name)(t(a)), getattr(t(a), name)()):
        assert out.dtype == dtype and out.shape == (3, 4)
        np.testing.assert_allclose(arr(out), ref(a), rtol=1e-6)


async def test_erf_values(rt: Any) -> None:
    import math

    a = np.linspace(-3, 3, 13)
    np.testing.assert_allclose(arr(ag.erf(t(a))), [math.erf(v) for v in a], rtol=1e-12, atol=1e-15)
    assert ag.erf(t(a, dtype=np.float32)).dtype == np.float32


async def test_integer_inputs(rt: Any) -> None:
    i = t([1, 2, -3])
    for f in (ag.floor, ag.ceil, ag.round):  # integers are already rounded: kept, dtype too (PyTorch)
        out = f(i)
        assert out.dtype == np.int64
        np.testing.assert_array_equal(arr(out), [1, 2, -3])
    assert ag.square(i).dtype == np.int64
    np.testing.assert_allclose(arr(ag.reciprocal(t([2, 4]))), [0.5, 0.25])  # not numpy's integer 1 // x
    assert ag.sin(i).dtype.kind == "f"


async def test_round_half_to_even_and_decimals(rt: Any) -> None:
    np.testing.assert_array_equal(arr(ag.round(t([0.5, 1.5, 2.5, -0.5]))), [0.0, 2.0, 2.0, -0.0])
    np.testing.assert_allclose(arr(t([1.234, -5.678]).round(decimals=2)), [1.23, -5.68])


async def test_rounding_has_zero_gradient(rt: Any) -> None:
    x = t([0.3, 1.7], requires_grad=True)
    y = ag.floor(x) + ag.ceil(x) + ag.round(x)
    assert y.requires_grad  # as PyTorch: the output is in the graph, the gradient is 0
    (g,) = await ag.grad(y.sum(), [x])
    np.testing.assert_array_equal(arr(g), [0.0, 0.0])


async def test_lerp(rt: Any) -> None:
    a, b = R.standard_normal((2, 3)), R.standard_normal(3)
    np.testing.assert_allclose(arr(ag.lerp(t(a), t(b), 0.25)), a + 0.25 * (b - a))
    w = R.uniform(0, 1, (2, 1))
    np.testing.assert_allclose(arr(t(a).lerp(t(b), t(w))), a + w * (b - a))
    np.testing.assert_array_equal(arr(ag.lerp(t(a), t(b), 1.0)), np.broadcast_to(b, (2, 3)))  # exact at 1
    with pytest.raises(ag.OpError, match=r"lerp: start and end must have the same dtype"):
        ag.lerp(t(a), t(b, dtype=np.float32), 0.5)


async def test_nan_to_num(rt: Any) -> None:
    a = np.array([1.0, np.nan, np.inf, -np.inf], dtype=np.float32)
    out = ag.nan_to_num(t(a))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(arr(out), np.nan_to_num(a))
    np.testing.assert_array_equal(arr(t(a).nan_to_num(nan=2.0, posinf=9.0, neginf=-9.0)), [1, 2, 9, -9])
    x = t(a.astype(np.float64), requires_grad=True)
    (g,) = await ag.grad(ag.nan_to_num(x).sum(), [x])
    np.testing.assert_array_equal(arr(g), [1, 0, 0, 0])  # PyTorch: grad * isfinite(x)


async def test_predicates(rt: Any) -> None:
    a = np.array([1.0, np.nan, np.inf, -np.inf, 0.0])
    x = t(a, requires_grad=True)
    for f, ref in ((ag.isnan, np.isnan), (ag.isinf, np.isinf), (ag.isfinite, np.isfinite)):
        out = f(x)
        assert out.dtype == np.bool_ and not out.requires_grad
        np.testing.assert_array_equal(arr(out), ref(a))
    np.testing.assert_array_equal(arr(t([1, 2]).isfinite()), [True, True])


async def test_allclose_and_equal(rt: Any) -> None:
    a = t([1.0, 2.0])
    assert ag.allclose(a, t([1.0, 2.0 + 1e-9])) is True
    assert a.allclose(t([1.0, 2.1])) is False
    assert ag.allclose(t([np.nan]), t([np.nan]), equal_nan=True)
    assert ag.allclose(t([[1.0, 2.0]]), a)  # broadcasts, as PyTorch
    with pytest.raises(ag.OpError, match="allclose: tensors must have the same dtype"):
        ag.allclose(a, t([1, 2]))
    assert ag.equal(a, t([1.0, 2.0])) is True
    assert a.equal(t([1.0, 2.0, 3.0])) is False  # shapes differ
    assert ag.equal(t([np.nan]), t([np.nan])) is False
    assert ag.equal(t([1, 2]), a) is True  # values compared, as PyTorch
