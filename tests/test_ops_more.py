"""The PyTorch ops added beyond the core: values, dtypes and shapes against numpy, errors, and (when torch
is installed) values and gradients against PyTorch itself.

Gradients against finite differences (first and second order) are in the table of test_grad_ops.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncgrad as ag

R = np.random.default_rng(77)


def t(a: Any, **kw: Any) -> ag.Tensor:
    return ag.tensor(np.asarray(a), **kw)


def arr(x: ag.Tensor) -> np.ndarray:
    return x.numpy()


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


# ---- linalg ----------------------------------------------------------------------------------------------


async def test_linalg(rt: Any) -> None:
    a, b = R.standard_normal((3, 4)), R.standard_normal((4, 2))
    np.testing.assert_allclose(arr(ag.mm(t(a), t(b))), a @ b)
    p, q = R.standard_normal((2, 3, 4)), R.standard_normal((2, 4, 5))
    np.testing.assert_allclose(arr(t(p).bmm(t(q))), p @ q)
    u, v = R.standard_normal(4), R.standard_normal(5)
    np.testing.assert_allclose(arr(ag.dot(t(u), t(u))), u @ u)
    np.testing.assert_allclose(arr(ag.outer(t(u), t(v))), np.outer(u, v))
    c = R.standard_normal(2)
    np.testing.assert_allclose(arr(ag.addmm(t(c), t(a), t(b), beta=0.5, alpha=2)), 0.5 * c + 2 * (a @ b))
    nan = t(np.full((3, 2), np.nan))
    np.testing.assert_allclose(arr(ag.addmm(nan, t(a), t(b), beta=0)), a @ b)  # beta=0 ignores the input


@pytest.mark.parametrize(
    "call, msg",
    [
        (lambda: ag.mm(t(np.ones(3)), t(np.ones((3, 2)))), "mm: mat1 must be 2-D, got shape (3,)"),
        (
            lambda: ag.mm(t(np.ones((2, 3))), t(np.ones((2, 3)))),
            "mm: mat1 and mat2 shapes cannot be multiplied (2x3 and 2x3)",
        ),
        (
            lambda: ag.mm(t(np.ones((2, 2))), t(np.ones((2, 2)), dtype=np.float32)),
            "mm: expected mat1 and mat2 to have the same dtype, got float64 and float32",
        ),
        (lambda: ag.bmm(t(np.ones((2, 3, 4))), t(np.ones((3, 4, 5)))), "bmm: shapes (2, 3, 4) and (3, 4, 5)"),
        (lambda: ag.dot(t(np.ones(3)), t(np.ones(4))), "dot: expected vectors of equal length, got shapes (3,)"),
        (lambda: ag.outer(t(np.ones((2, 2))), t(np.ones(2))), "outer: input must be 1-D, got shape (2, 2)"),
        (
            lambda: ag.addmm(t(np.ones(3)), t(np.ones((2, 2))), t(np.ones((2, 2)))),
            "addmm: input of shape (3,) cannot be broadcast to the product's shape (2, 2)",
        ),
    ],
)
async def test_linalg_errors(rt: Any, call: Callable[[], Any], msg: str) -> None:
    with pytest.raises(ag.OpError) as e:
        call()
    assert msg in str(e.value)


# ---- sorting and selection ------------------------------------------------------------------------------


async def test_sort_argsort(rt: Any) -> None:
    a = np.array([[3.0, 1.0, 2.0, 1.0], [np.nan, -1.0, 5.0, -1.0]])
    r = ag.sort(t(a))
    assert isinstance(r, ag.SortResult) and r.indices.dtype == np.int64
    np.testing.assert_array_equal(arr(r.values), np.sort(a, -1))
    np.testing.assert_array_equal(arr(r.indices), [[1, 3, 2, 0], [1, 3, 2, 0]])  # stable; NaN last
    v, i = t(a).sort(descending=True)
    np.testing.assert_array_equal(arr(i), [[0, 2, 1, 3], [0, 2, 1, 3]])  # stable; NaN first
    np.testing.assert_array_equal(arr(v)[:, 1:], [[2.0, 1.0, 1.0], [5.0, -1.0, -1.0]])
    np.testing.assert_array_equal(arr(ag.argsort(t(a), dim=0)), np.argsort(a, 0, kind="stable"))
    np.testing.assert_array_equal(arr(t([2, 1, 2]).argsort(descending=True)), [0, 2, 1])
    s = ag.sort(t(4.0))
    assert s.values.shape == () and s.indices.item() == 0


async def test_topk(rt: Any) -> None:
    a = np.array([[1.0, 5.0, 3.0, 4.0], [9.0, 0.0, 2.0, 7.0]])
    r = ag.topk(t(a), 2)
    assert isinstance(r, ag.TopkResult)
    np.testing.assert_array_equal(arr(r.values), [[5.0, 4.0], [9.0, 7.0]])
    np.testing.assert_array_equal(arr(r.indices), [[1, 3], [0, 3]])
    v, i = t(a).topk(1, dim=0, largest=False)
    np.testing.assert_array_equal(arr(v), [[1.0, 0.0, 2.0, 4.0]])
    np.testing.assert_array_equal(arr(i), [[0, 1, 1, 0]])
    assert ag.topk(t(a), 0).values.shape == (2, 0)
    with pytest.raises(ag.OpError, match=r"topk: k \(5\) must be an int in \[0, 4\]"):
        ag.topk(t(a), 5)


async def test_masked_select_and_nonzero(rt: Any) -> None:
    a = np.arange(6.0).reshape(2, 3)
    m = np.array([True, False, True])
    out = ag.masked_select(t(a), t(m))
    np.testing.assert_array_equal(arr(out), a[np.broadcast_to(m, a.shape)])
    assert out.ndim == 1
    with pytest.raises(ag.OpError, match="masked_select: mask must have dtype bool, got int64"):
        ag.masked_select(t(a), t([1, 0, 1]))
    z = np.array([[0, 1, 0], [2, 0, 3]])
    nz = ag.nonzero(t(z))
    assert nz.dtype == np.int64 and nz.shape == (3, 2)
    np.testing.assert_array_equal(arr(nz), np.argwhere(z))
    rows, cols = t(z).nonzero(as_tuple=True)
    np.testing.assert_array_equal(arr(rows), [0, 1, 1])
    np.testing.assert_array_equal(arr(cols), [1, 0, 2])
    assert ag.nonzero(t(np.zeros(4))).shape == (0, 1)
    assert ag.nonzero(t(5.0)).shape == (1, 0)


async def test_scatter(rt: Any) -> None:
    x = np.zeros((3, 4))
    idx = np.array([[0, 1, 2, 0], [2, 0, 0, 1]])
    src = np.arange(1.0, 13.0).reshape(3, 4)
    want = x.copy()
    for i in range(2):
        for j in range(4):
            want[idx[i, j], j] = src[i, j]
    np.testing.assert_array_equal(arr(t(x).scatter(0, t(idx), t(src))), want)
    np.testing.assert_array_equal(arr(ag.scatter(t(x), 0, t(idx), value=7.0))[idx, np.arange(4)], 7.0)
    add = ag.scatter_add(t(x), 1, t([[0, 0, 3]]), t([[1.0, 2.0, 4.0]]))
    np.testing.assert_array_equal(arr(add)[0], [3.0, 0.0, 0.0, 4.0])
    np.testing.assert_array_equal(arr(t(x).scatter(1, t([[0, 0]]), t([[1.0, 2.0]]), reduce="add"))[0, 0], 3.0)
    with pytest.raises(ag.OpError, match="scatter: src dtype float32 must equal the input's dtype float64"):
        t(x).scatter(0, t(idx), t(src, dtype=np.float32))
    with pytest.raises(ag.OpError, match=r"scatter_add: index \(3, 4\) is larger than input \(2, 4\) in dim 0"):
        ag.scatter_add(t(np.zeros((2, 4))), 1, t(np.zeros((3, 4), dtype=np.int64)), t(np.zeros((3, 4))))
    with pytest.raises(IndexError, match="scatter: index out of bounds for dim 0 with size 3"):
        t(x).scatter(0, t([[3, 0, 0, 0]]), t(src)).numpy()


async def test_scatter_gradients(rt: Any) -> None:
    x = t(np.ones((3, 2)), requires_grad=True)
    s = t(np.ones((3, 2)), requires_grad=True)  # larger than the index: the unused part gets 0
    idx = t([[2, 0]])
    w = t([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    gx, gs = await ag.grad((x.scatter(0, idx, s) * w).sum(), [x, s])
    np.testing.assert_array_equal(arr(gx), [[1.0, 0.0], [3.0, 4.0], [0.0, 6.0]])
    np.testing.assert_array_equal(arr(gs), [[5.0, 2.0], [0.0, 0.0], [0.0, 0.0]])


# ---- Tensor methods and module functions ----------------------------------------------------------------

NEW = (
    "sin cos floor ceil round log1p expm1 erf rsqrt reciprocal square lerp nan_to_num isnan isinf isfinite "
    "allclose equal prod all any amin chunk split unbind narrow flip roll movedim swapaxes unflatten repeat "
    "repeat_interleave tril triu diag trace mm bmm dot outer addmm sort argsort topk masked_select nonzero "
    "scatter scatter_add"
).split()


def test_module_functions_and_methods_exist() -> None:
    for name in NEW:
        assert callable(getattr(ag, name)), name
        assert callable(getattr(ag.Tensor, name)), name
    assert "repeat" in ag.__all__ and "prod" in ag.__all__


# ---- against PyTorch ------------------------------------------------------------------------------------

FIN = np.array([True, False, True, False, False])
NONFIN = np.array([0.0, np.nan, 0.0, np.inf, -np.inf])
IDX2 = [[0, 2], [1, 1]]
rn23, rn22 = R.standard_normal((2, 3)), R.standard_normal((2, 2))
PERM = R.permutation(12).reshape(3, 4) * 0.5

# each case: f(m, *tensors) written so that it reads the same for m = asyncgrad and m = torch; the output's
# value and the gradient of sum(out * w) with respect to every input must agree
T_CASES: list[tuple[str, Callable[..., Any], list[np.ndarray]]] = [
    ("sin", lambda m, x: m.sin(x) * x.cos(), [R.standard_normal((3, 4))]),
    ("log1p-expm1", lambda m, x: m.log1p(x.expm1()), [R.uniform(-0.5, 1, (5,))]),
    ("erf", lambda m, x: m.erf(x), [R.standard_normal((2, 3))]),
    ("rsqrt-reciprocal-square", lambda m, x: m.rsqrt(x) + x.reciprocal() * m.square(x), [R.uniform(0.5, 2, (4,))]),
    ("floor-ceil-round", lambda m, x: (m.floor(x) + x.ceil() + m.round(x)) * x, [R.uniform(-3, 3, (6,)) + 0.01]),
    ("round-decimals", lambda m, x: m.round(x, decimals=1) * x, [np.array([0.123, -2.345, 7.891])]),
    (
        "lerp",
        lambda m, a, b, w: m.lerp(a, b, w),
        [R.standard_normal((2, 3)), R.standard_normal(3), R.uniform(0, 1, (2, 3))],
    ),
    (
        "nan_to_num",
        lambda m, x: m.nan_to_num(m.where(m.tensor(FIN), x, m.tensor(NONFIN)), nan=1.0, posinf=2.0) * x,
        [R.standard_normal(5)],
    ),
    ("prod", lambda m, x: m.prod(x, 1), [np.array([[2.0, 0.0, 3.0], [0.0, 0.0, 1.0], [1.0, 2.0, 3.0]])]),
    ("prod-full", lambda m, x: x.prod(), [np.array([[2.0, 0.5], [1.5, -1.0]])]),
    ("amin", lambda m, x: m.amin(x, 0), [R.standard_normal((3, 4))]),
    ("chunk", lambda m, x: m.chunk(x, 3, 1)[2] * 2, [R.standard_normal((2, 7))]),
    ("split", lambda m, x: m.cat(x.split([1, 2], 0)[::-1]), [R.standard_normal((3, 2))]),
    ("unbind-narrow", lambda m, x: m.unbind(x, 1)[1] * x.narrow(1, -1, 1)[:, 0], [R.standard_normal((3, 4))]),
    ("flip-roll", lambda m, x: m.roll(x.flip(0), (1, 2), (0, 1)), [R.standard_normal((3, 4))]),
    ("roll-flat", lambda m, x: m.roll(x, -4), [R.standard_normal((3, 4))]),
    ("movedim-swapaxes", lambda m, x: m.swapaxes(m.movedim(x, 0, 2), 0, 1), [R.standard_normal((2, 3, 4))]),
    ("unflatten", lambda m, x: m.unflatten(x, 1, (2, 3)), [R.standard_normal((2, 6))]),
    ("repeat", lambda m, x: x.repeat(2, 1, 3), [R.standard_normal((2, 3))]),
    ("repeat_interleave", lambda m, x: m.repeat_interleave(x, 2, dim=0), [R.standard_normal((2, 3))]),
    ("tril-triu", lambda m, x: m.tril(x, -1) + x.triu(1) * 2, [R.standard_normal((2, 4, 3))]),
    ("diag", lambda m, x: m.diag(m.diag(x, 1), -1), [R.standard_normal((3, 4))]),
    ("trace", lambda m, x: m.trace(x) * x, [R.standard_normal((3, 3))]),
    ("mm-bmm", lambda m, a, b: m.mm(a, b), [R.standard_normal((3, 4)), R.standard_normal((4, 2))]),
    ("bmm", lambda m, a, b: a.bmm(b), [R.standard_normal((2, 3, 4)), R.standard_normal((2, 4, 2))]),
    ("dot-outer", lambda m, a, b: m.outer(a, b) * m.dot(a, a), [R.standard_normal(3), R.standard_normal(4)]),
    (
        "addmm",
        lambda m, c, a, b: m.addmm(c, a, b, beta=0.5, alpha=3.0),
        [R.standard_normal(2), R.standard_normal((3, 4)), R.standard_normal((4, 2))],
    ),
    ("sort", lambda m, x: m.sort(x, 0, descending=True).values, [PERM]),
    ("sort-indices", lambda m, x: m.sort(x).indices.double(), [PERM]),
    ("argsort", lambda m, x: m.argsort(x, dim=1, descending=True).double(), [PERM]),
    ("topk", lambda m, x: m.topk(x, 2, dim=0).values, [PERM]),
    ("topk-smallest", lambda m, x: x.topk(3, largest=False)[0], [PERM]),
    ("masked_select", lambda m, x: m.masked_select(x, x > 0), [R.standard_normal((3, 4))]),
    ("nonzero", lambda m, x: m.nonzero(x > 0).double(), [R.standard_normal((3, 4))]),
    ("scatter", lambda m, x, s: x.scatter(1, m.tensor(IDX2), s), [rn23, rn22]),
    (
        "scatter_add",
        lambda m, x, s: m.scatter_add(x, 0, m.tensor([[1, 0, 1]]), s),
        [R.standard_normal((2, 3)), R.standard_normal((1, 3))],
    ),
    ("isfinite", lambda m, x: m.where(m.isfinite(m.tensor(NONFIN)), x, x * 2), [R.standard_normal(5)]),
    ("isnan", lambda m, x: m.where(m.tensor(NONFIN).isnan(), x, x * 2), [R.standard_normal(5)]),
    ("isinf", lambda m, x: m.where(m.isinf(m.tensor(NONFIN)), x, x * 3), [R.standard_normal(5)]),
    ("all", lambda m, x: m.where(m.all(x > -0.5, 1, keepdim=True), x, x * 0), [R.standard_normal((4, 3))]),
    ("any", lambda m, x: m.where(m.any(x > 1, 0), x, x * 0), [R.standard_normal((4, 3))]),
]


@pytest.mark.parametrize("name, fn, inputs", T_CASES, ids=[c[0] for c in T_CASES])
async def test_against_torch(rt: Any, name: str, fn: Callable[..., Any], inputs: list[np.ndarray]) -> None:
    torch = pytest.importorskip("torch")
    xs = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inputs]
    ys = [ag.tensor(a, dtype=np.float64, requires_grad=True) for a in inputs]
    tout, aout = fn(torch, *xs), fn(ag, *ys)
    np.testing.assert_allclose(aout.numpy(), tout.detach().numpy(), rtol=1e-12, atol=1e-12, err_msg=name)
    assert aout.numpy().dtype == np.dtype(str(tout.dtype).removeprefix("torch."))
    if not tout.requires_grad:
        return
    w = R.standard_normal(tuple(tout.shape))
    tg = torch.autograd.grad((tout * torch.tensor(w)).sum(), xs, allow_unused=True)
    agg = await ag.grad((aout * ag.tensor(w)).sum(), ys, allow_unused=True)
    for i, (a, b) in enumerate(zip(agg, tg)):
        want = np.zeros_like(inputs[i]) if b is None else b.numpy()
        got = np.zeros_like(inputs[i]) if a is None else a.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{name}: gradient of input {i}")
