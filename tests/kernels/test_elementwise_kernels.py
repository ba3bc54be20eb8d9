"""The fused tanh and sigmoid backward kernels against their numpy twins, and the rules that use them.

The compiled kernels make the twins' float operations in the same order and dtype: bit-identical, float32
and float64. The op-level tests run under ``ASYNCGRAD_JIT=0`` too (the twins are then the kernels).
"""

from __future__ import annotations

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad.kernels import _elementwise as E

SHAPES = [(16,), (3, 5, 7), (), (1000,), (0,), (2, 0, 3), (64, 257)]
PAIRS = [
    ("tanh", E._tanh_backward_jit, E._tanh_backward_numpy, np.tanh),
    ("sigmoid", E._sigmoid_backward_jit, E._sigmoid_backward_numpy, lambda x: 1 / (1 + np.exp(-x))),
]


@pytest.mark.skipif(not E.ENABLED, reason="compiled kernels are off (ASYNCGRAD_JIT=0)")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name,jit,twin,fwd", PAIRS, ids=[p[0] for p in PAIRS])
def test_compiled_backward_is_bitwise_the_twin(name, jit, twin, fwd, shape, dtype) -> None:
    rng = np.random.default_rng(7)
    g = np.asarray(rng.standard_normal(shape), dtype=dtype)
    y = np.asarray(fwd(rng.standard_normal(shape) * 3), dtype=dtype)
    assert E.fusable(g, y)
    got, want = jit(g, y), twin(g, y)
    assert got.dtype == want.dtype == np.dtype(dtype) and got.shape == want.shape == shape
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, want)
    assert got.tobytes() == want.tobytes()  # (signed zeros and NaN payloads too)


def test_fusable_takes_only_contiguous_float_arrays_of_one_shape_and_dtype() -> None:
    a = np.ones((4, 6), np.float32)
    assert E.fusable(a, a.copy())
    assert not E.fusable(a, a.astype(np.float64))  # mixed dtypes: numpy's promotion, in the plain rule
    assert not E.fusable(a.astype(np.int32), a.astype(np.int32))
    assert not E.fusable(a.astype(np.float16), a.astype(np.float16))
    assert not E.fusable(a.T, a.T.copy())  # not C-contiguous
    assert not E.fusable(a[:, ::2], a[:, ::2].copy())
    assert not E.fusable(a, np.ones((6, 4), np.float32))
    assert not E.fusable(np.float32(1.0), np.float32(2.0))  # numpy scalars
    assert not E.fusable(a, [[1.0] * 6] * 4)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["tanh", "sigmoid"])
async def test_the_rules_give_the_plain_expressions_gradient(rt, op, dtype) -> None:
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((33, 65)) * 2
    gs = rng.standard_normal((33, 65))
    x = ag.tensor(xs.astype(dtype), requires_grad=True)
    y = getattr(ag, op)(x)
    await y.backward(ag.tensor(gs.astype(dtype)))
    yv = y.detach().numpy()
    g = gs.astype(dtype)
    want = g * (1 - yv * yv) if op == "tanh" else g * yv * (1 - yv)
    np.testing.assert_array_equal(x.grad.numpy(), want)
    # a transposed (non-contiguous) gradient takes the plain expression: the same values
    x2 = ag.tensor(xs.T.copy().astype(dtype), requires_grad=True)
    y2 = getattr(ag, op)(x2)
    await y2.backward(ag.tensor(gs.astype(dtype)).T)
    y2v = y2.detach().numpy()
    g2 = gs.astype(dtype).T
    want2 = g2 * (1 - y2v * y2v) if op == "tanh" else g2 * y2v * (1 - y2v)
    np.testing.assert_allclose(x2.grad.numpy(), want2, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["tanh", "sigmoid"])
async def test_float64_gradcheck_and_gradgradcheck(rt, op) -> None:
    rng = np.random.default_rng(11)
    x = ag.tensor(rng.standard_normal((4, 5)), requires_grad=True)
    f = getattr(ag, op)
    assert await ag.autograd.gradcheck(f, (x,))
    assert await ag.autograd.gradgradcheck(f, (x,))
