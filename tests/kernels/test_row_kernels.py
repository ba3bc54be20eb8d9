"""The compiled row kernels (layer norm, softmax) and the float32 GELU against their numpy twins.

Both implementations run in every process (the tests call them directly), whatever ``ASYNCGRAD_JIT`` says.
Bounds: float64 within 1e-12 relative; float32 within a few ulps of the values' scale. The compiled kernels
accumulate row sums in float64 where the twins use float32 BLAS products, so float32 results differ in the
last bits (layer norm: 4 ulps of the output's scale; softmax: 4 ulps of 1), and the GELU's backward calls
libm's expf where numpy has its own SIMD exp (1 ulp of 1); the GELU's forward is the same float32
operations in the same order, so it is bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrad.kernels import _gelu, _layer_norm, _softmax
from asyncgrad.kernels._jit import K

pytestmark = pytest.mark.skipif(not _layer_norm.ENABLED, reason="compiled kernels are off (ASYNCGRAD_JIT=0)")

EPS32 = float(np.finfo(np.float32).eps)


def _close(a: np.ndarray, b: np.ndarray, dtype: np.dtype, ulps: float = 4.0) -> None:
    if np.dtype(dtype) == np.float64:
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    else:
        scale = max(float(np.max(np.abs(b))), 1.0) if b.size else 1.0
        np.testing.assert_allclose(a, b, rtol=ulps * EPS32, atol=ulps * EPS32 * scale)


def _ln_both(x, w, b, eps=1e-5):
    res = []
    for f in (_layer_norm._forward_jit, _layer_norm._forward_numpy):
        r = x.shape[0]
        y, m, s = np.empty_like(x), np.empty(r, x.dtype), np.empty(r, x.dtype)
        f(x, w, b, eps, y, m, s)
        res.append((y, m, s))
    return res


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(256, 32), (1, 7), (5, 1), (3, 1000)])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, True), (False, False)])
def test_layer_norm_forward_and_backward_match_the_twins(dtype, shape, affine) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    n = shape[1]
    w = rng.standard_normal(n).astype(dtype) if affine[0] else None
    b = rng.standard_normal(n).astype(dtype) if affine[1] else None
    (yj, mj, sj), (yn, mn, sn) = _ln_both(x, w, b)
    _close(yj, yn, dtype)
    _close(mj, mn, dtype)
    _close(sj, sn, dtype)
    g = rng.standard_normal(shape).astype(dtype)
    for needs in [(True, True, True), (True, False, False), (False, True, True), (False, False, True)]:
        needs = (needs[0], needs[1] and w is not None, needs[2])
        for saved in (True, False):
            mean, rstd = (mn, sn) if saved else (None, None)
            gj = _layer_norm._backward_jit(g, x, w, mean, rstd, 1e-5, needs)
            gn = _layer_norm._backward_numpy(g, x, w, mean, rstd, 1e-5, needs)
            for a, want, need in zip(gj, gn, needs):
                if not need:
                    assert a is None and want is None
                else:
                    assert a.dtype == want.dtype == dtype and a.shape == want.shape
                    _close(a, want, dtype, ulps=8.0 * (1 + np.sqrt(shape[0]) if a.ndim == 1 else 1))


def test_layer_norm_propagates_nan_and_inf_as_the_twin() -> None:
    x = np.array([[1.0, np.nan, 2.0], [np.inf, 1.0, 0.0], [1.0, 2.0, 3.0]], np.float32)
    (yj, _, _), (yn, _, _) = _ln_both(x, None, None)
    np.testing.assert_array_equal(np.isnan(yj), np.isnan(yn))
    _close(yj[2], yn[2], np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (4, 7), (3, 5, 9), (1, 1)])
def test_softmax_forward_and_backward_match_the_twins(dtype, causal, shape) -> None:
    rng = np.random.default_rng(1)
    s = (rng.standard_normal(shape) * 4).astype(dtype)
    if causal and len(shape) < 2:
        pytest.skip("causal needs (queries, keys)")
    pj = _softmax._softmax_jit(s.copy(), 0.37, causal)
    pn = _softmax._softmax_numpy(s.copy(), 0.37, causal)
    _close(pj, pn, dtype)
    np.testing.assert_allclose(pj.sum(-1), 1.0, rtol=1e-5 if dtype == np.float32 else 1e-12)
    g = rng.standard_normal(shape).astype(dtype)
    _close(_softmax._softmax_backward_jit(g.copy(), pj), _softmax._softmax_backward_numpy(g.copy(), pj), dtype)


@pytest.mark.parametrize("zero_dead", [False, True])
def test_softmax_rows_of_minus_inf_and_nan_as_the_twin(zero_dead) -> None:
    s = np.array([[-np.inf, -np.inf, -np.inf], [1.0, np.nan, 0.0], [np.inf, 0.0, 1.0], [0.0, 1.0, -np.inf]])
    for dtype in (np.float32, np.float64):
        a = s.astype(dtype)
        with np.errstate(invalid="ignore", divide="ignore"):
            pj = _softmax._softmax_jit(a.copy(), 1.0, False, zero_dead)
            pn = _softmax._softmax_numpy(a.copy(), 1.0, False, zero_dead)
        np.testing.assert_array_equal(np.isnan(pj), np.isnan(pn))
        np.testing.assert_allclose(np.nan_to_num(pj), np.nan_to_num(pn), rtol=1e-6)
    if zero_dead:
        np.testing.assert_array_equal(pj[0], 0.0)


def test_causal_softmax_with_more_keys_than_queries_and_a_nan() -> None:
    s = np.random.default_rng(2).standard_normal((2, 3, 5)).astype(np.float32)
    s[1, 2, 1] = np.nan
    with np.errstate(invalid="ignore"):
        pj = _softmax._softmax_jit(s.copy(), 1.0, True)
        pn = _softmax._softmax_numpy(s.copy(), 1.0, True)
    np.testing.assert_array_equal(np.isnan(pj), np.isnan(pn))
    ok = ~np.isnan(pn)
    _close(pj[ok], pn[ok], np.float32)


def test_gelu32_forward_is_bit_identical_and_backward_within_an_ulp() -> None:
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((64, 513)) * 3).astype(np.float32)
    a.reshape(-1)[:6] = [0.0, -0.0, 1e-40, -1e-40, 4.5, -9.0]
    yj, yn = _gelu._gelu32_jit(a), _gelu._gelu32_numpy(a)
    np.testing.assert_array_equal(yj, yn)
    g = rng.standard_normal(a.shape).astype(np.float32)
    bj, bn = _gelu._gelu32_backward_jit(g, a, yj), _gelu._gelu32_backward_numpy(g, a, yn)
    np.testing.assert_allclose(bj, bn, rtol=0, atol=2 * EPS32 * float(np.abs(g).max()))
    with np.errstate(invalid="ignore"):
        special = np.array([np.nan, np.inf, -np.inf], np.float32)
        np.testing.assert_array_equal(_gelu._gelu32_jit(special), _gelu._gelu32_numpy(special))


def test_gelu32_on_a_non_contiguous_input() -> None:
    a = np.random.default_rng(4).standard_normal((30, 40)).astype(np.float32).T
    np.testing.assert_array_equal(_gelu._gelu32_jit(a), _gelu._gelu32_numpy(a))


def test_the_compiled_kernels_release_the_gil() -> None:
    x = np.ones((4, 8), np.float32)
    _ln_both(x, None, None)
    _softmax._softmax_jit(x.copy())
    _gelu._gelu32_jit(x)
    for name in ("ln_forward_rows", "softmax_shift_rows", "softmax_normalize_rows", "gelu32_forward_flat"):
        disp = getattr(K, name)
        assert disp.targetoptions.get("nogil") is True, name
        assert type(disp._cache).__name__ != "NullCache", name  # cached on disk


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_embedding_scatter_add_is_np_add_at_bit_for_bit(dtype) -> None:
    from asyncgrad.kernels import _embedding

    rng = np.random.default_rng(5)
    ids = rng.integers(0, 40, 700)
    g = rng.standard_normal((700, 24)).astype(dtype)
    zj, zn = np.zeros((50, 24), dtype), np.zeros((50, 24), dtype)
    rows_j = _embedding._scatter_add_jit(zj, ids, g)
    rows_n = _embedding._scatter_add_numpy(zn, ids, g)
    np.testing.assert_array_equal(zj, zn)
    np.testing.assert_array_equal(rows_j, rows_n)
