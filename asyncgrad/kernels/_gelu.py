"""The float32 erf and the exact GELU's forward and backward, elementwise over float32 arrays.

erf is the rational approximation ``x P(x^2) / Q(x^2)`` on [-4, 4] (Eigen's float32 coefficients: within
5e-7 of the exact value, as close as torch's own float32 erf). The numpy twins run it as a dozen in-place
ufunc passes each (~27 for the GELU forward, ~13 for its backward); the compiled kernels make one pass
with the same float32 operations in the same order.
"""

from __future__ import annotations

import math

import numpy as np

from ._jit import ENABLED, K

# erf(x) ~ x P(x^2) / Q(x^2) on [-4, 4] (and +-1 beyond), float32 coefficients of Eigen's generic_fast_erf_float
ERF32_P = tuple(np.float32(c) for c in (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
    -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02,
))
ERF32_Q = tuple(np.float32(c) for c in (
    -1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
    -1.42647390514189e-02,
))
FOUR32 = np.float32(4.0)
# half of `ERF32_P` (exact: a power of two), for ``erf(x) / 2``
ERF32_P_HALF = tuple(np.float32(c * np.float32(0.5)) for c in ERF32_P)

_GELU_TINY = np.float32(2.0**-100)
_HALF32, _MINUS_HALF32 = np.float32(0.5), np.float32(-0.5)
_SQRT1_2_32 = np.float32(math.sqrt(0.5))
_INV_SQRT_2PI32 = np.float32(0.3989422804014327)

# the coefficients one by one: numba freezes module-level float32 scalars as float32 constants
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = ERF32_P_HALF
_Q0, _Q1, _Q2, _Q3, _Q4 = ERF32_Q
_NEG_FOUR32 = np.float32(-4.0)


def erf32_scaled(xc: np.ndarray, coeffs: tuple[np.float32, ...]) -> np.ndarray:
    """``s * erf(xc)`` for ``xc`` clamped to [-4, 4] (overwritten), with ``coeffs`` `ERF32_P` times ``s``.

    (One clip pass, not minimum + maximum: numpy's float32 minimum/maximum run ~4x slower than a multiply.)"""
    x2 = xc * xc
    p = x2 * coeffs[0]
    p += coeffs[1]
    for c in coeffs[2:]:
        p *= x2
        p += c
    p *= xc
    q = np.multiply(x2, ERF32_Q[0], out=xc)  # (xc is read no more)
    q += ERF32_Q[1]
    for c in ERF32_Q[2:]:
        q *= x2
        q += c
    p /= q
    return p


def erf32(x: np.ndarray) -> np.ndarray:
    """erf of a float32 array in float32 (a dozen in-place ufuncs; scipy's costs ~200 ns an element)."""
    return erf32_scaled(np.clip(x, -FOUR32, FOUR32), ERF32_P)


# ---- compiled ------------------------------------------------------------------------------------------


@K.register
def gelu32_forward_flat(a, out):  # type: ignore[no-untyped-def]
    for i in range(a.size):
        x = a[i]
        u = x * _SQRT1_2_32
        if u > FOUR32:
            u = FOUR32
        elif u < _NEG_FOUR32:
            u = _NEG_FOUR32
        x2 = u * u
        p = x2 * _P0
        p = p + _P1
        p = p * x2 + _P2
        p = p * x2 + _P3
        p = p * x2 + _P4
        p = p * x2 + _P5
        p = p * x2 + _P6
        p = p * u
        q = x2 * _Q0
        q = q + _Q1
        q = q * x2 + _Q2
        q = q * x2 + _Q3
        q = q * x2 + _Q4
        h = p / q + _HALF32
        out[i] = h * x


@K.register
def gelu32_backward_exp_arg(a, e):  # type: ignore[no-untyped-def]
    for i in range(a.size):
        x = a[i]
        e[i] = (x * x) * _MINUS_HALF32


@K.register
def gelu32_backward_flat(g, a, out, e):  # type: ignore[no-untyped-def]
    # e holds exp(-a^2 / 2) (numpy's vectorised exp); the result overwrites it
    for i in range(a.size):
        x = a[i]
        if abs(x) < _GELU_TINY:
            cdf = _HALF32
        else:
            cdf = out[i] / x
        d = e[i] * x * _INV_SQRT_2PI32 + cdf
        e[i] = g[i] * d


def _gelu32_jit(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    out = np.empty_like(a)
    K.gelu32_forward_flat(a.reshape(-1), out.reshape(-1))
    return out


def _gelu32_backward_jit(g: np.ndarray, a: np.ndarray, out: np.ndarray) -> np.ndarray:
    a, out = np.ascontiguousarray(a), np.ascontiguousarray(out)
    g = np.ascontiguousarray(g)
    grad = np.empty_like(a)
    gf, af = grad.reshape(-1), a.reshape(-1)
    K.gelu32_backward_exp_arg(af, gf)
    np.exp(gf, out=gf)  # numpy's SIMD exp: numba's is libm's expf, an element at a time
    K.gelu32_backward_flat(g.reshape(-1), af, out.reshape(-1), gf)
    return grad


# ---- numpy twins -----------------------------------------------------------------------------------------


def _gelu32_numpy(a: np.ndarray) -> np.ndarray:
    u = np.multiply(a, _SQRT1_2_32)
    np.clip(u, -FOUR32, FOUR32, out=u)
    h = erf32_scaled(u, ERF32_P_HALF)
    h += _HALF32
    h *= a
    return h


def _gelu32_backward_numpy(g: np.ndarray, a: np.ndarray, out: np.ndarray) -> np.ndarray:
    tiny = np.less(np.abs(a), _GELU_TINY)
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0 where a is 0: replaced just below
        num = np.divide(out, a)  # cdf
    np.copyto(num, _HALF32, where=tiny)
    d = np.multiply(a, a)
    d *= _MINUS_HALF32
    np.exp(d, out=d)
    d *= a
    d *= _INV_SQRT_2PI32
    d += num  # cdf + a pdf
    return np.multiply(g, d, out=d)


gelu32 = _gelu32_jit if ENABLED else _gelu32_numpy
gelu32.__doc__ = """Exact GELU of a float32 array, ``a (erf(a / sqrt 2) / 2 + 1/2)`` (``a * (1/sqrt 2)`` as torch
computes it; the erf's coefficients carry the 1/2). A new C-contiguous array of ``a``'s shape."""
gelu32_backward = _gelu32_backward_jit if ENABLED else _gelu32_backward_numpy
gelu32_backward.__doc__ = """``g * gelu'(a)`` for float32 ``g``, ``a`` and the forward's output ``out`` (one shape),
reading the saved output: ``gelu'(a) = cdf(a) + a pdf(a)`` with ``cdf(a) = out / a`` (to two float32
roundings), no second erf. Where |a| < 2^-100 (0, and denormal ``out``) cdf is its limit 1/2."""
