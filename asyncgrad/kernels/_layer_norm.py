"""Layer normalisation over the rows of a C-contiguous (rows, n) float32/float64 array, forward and backward.

The forward writes the output and each row's mean and 1/std (PyTorch saves the same two); the backward
reads them and makes the input, weight and bias gradients in one pass over the rows. The compiled kernels
accumulate in float64; the numpy twins reduce with BLAS matrix-vector products (numpy's reduction over a
short last axis runs one inner loop per row) and broadcast the row statistics, about 15 numpy calls a
direction that the compiled kernel replaces with one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._jit import ENABLED, K
from ._rows import const_vector

# ---- compiled ------------------------------------------------------------------------------------------


@K.register
def ln_forward_rows(x, w, b, has_w, has_b, eps, y, mean, rstd):  # type: ignore[no-untyped-def]
    r, n = x.shape
    inv_n = 1.0 / n
    for i in range(r):
        s = 0.0
        for j in range(n):
            s += x[i, j]
        m = s * inv_n
        v = 0.0
        for j in range(n):
            d = x[i, j] - m
            v += d * d
        rs = 1.0 / np.sqrt(v * inv_n + eps)
        mean[i] = m
        rstd[i] = rs
        for j in range(n):
            t = (x[i, j] - m) * rs
            if has_w:
                t = t * w[j]
            if has_b:
                t = t + b[j]
            y[i, j] = t


@K.register
def ln_stats_rows(x, eps, mean, rstd):  # type: ignore[no-untyped-def]
    r, n = x.shape
    inv_n = 1.0 / n
    for i in range(r):
        s = 0.0
        for j in range(n):
            s += x[i, j]
        m = s * inv_n
        v = 0.0
        for j in range(n):
            d = x[i, j] - m
            v += d * d
        mean[i] = m
        rstd[i] = 1.0 / np.sqrt(v * inv_n + eps)


@K.register
def ln_backward_rows(g, x, w, has_w, mean, rstd, need_x, need_w, need_b, gx, gw, gb):  # type: ignore[no-untyped-def]
    r, n = x.shape
    inv_n = 1.0 / n
    acc_w = np.zeros(n)
    acc_b = np.zeros(n)
    for i in range(r):
        m = np.float64(mean[i])
        rs = np.float64(rstd[i])
        s1 = 0.0
        s2 = 0.0
        for j in range(n):
            xh = (x[i, j] - m) * rs
            gij = np.float64(g[i, j])
            gy = gij * w[j] if has_w else gij
            s1 += gy
            s2 += gy * xh
            if need_w:
                acc_w[j] += gij * xh
            if need_b:
                acc_b[j] += gij
        if need_x:
            s1 *= inv_n
            s2 *= inv_n
            for j in range(n):
                xh = (x[i, j] - m) * rs
                gy = np.float64(g[i, j]) * w[j] if has_w else np.float64(g[i, j])
                gx[i, j] = (gy - s1 - xh * s2) * rs
    if need_w:
        for j in range(n):
            gw[j] = acc_w[j]
    if need_b:
        for j in range(n):
            gb[j] = acc_b[j]


def _forward_jit(rows: np.ndarray, w: Any, b: Any, eps: float, y: np.ndarray, mean: np.ndarray,
                 rstd: np.ndarray) -> None:
    dummy = rows[0, :1]  # a typed stand-in for an absent weight or bias (the flags say it is absent)
    K.ln_forward_rows(rows, dummy if w is None else w, dummy if b is None else b, w is not None, b is not None,
                      eps, y, mean, rstd)


def _backward_jit(g: np.ndarray, rows: np.ndarray, w: Any, mean: Any, rstd: Any, eps: float,
                  needs: tuple[bool, bool, bool]) -> tuple[Any, Any, Any]:
    r, n = rows.shape
    dt = rows.dtype
    if mean is None:
        mean, rstd = np.empty(r, dt), np.empty(r, dt)
        K.ln_stats_rows(rows, eps, mean, rstd)
    gx = np.empty((r, n), dt) if needs[0] else np.empty((0, 0), dt)
    gw = np.empty(n, dt) if needs[1] else np.empty(0, dt)
    gb = np.empty(n, dt) if needs[2] else np.empty(0, dt)
    K.ln_backward_rows(g, rows, rows[0, :1] if w is None else w, w is not None, mean, rstd,
                       bool(needs[0]), bool(needs[1]), bool(needs[2]), gx, gw, gb)
    return (gx if needs[0] else None, gw if needs[1] else None, gb if needs[2] else None)


# ---- numpy twins -----------------------------------------------------------------------------------------


def _forward_numpy(rows: np.ndarray, w: Any, b: Any, eps: float, y: np.ndarray, mean: np.ndarray,
                   rstd: np.ndarray) -> None:
    mean_w = const_vector(rows.shape[1], 1.0 / max(rows.shape[1], 1), rows.dtype)
    np.matmul(rows, mean_w, out=mean)
    np.subtract(rows, mean[:, None], out=y)
    np.matmul(np.square(y), mean_w, out=rstd)
    rstd += eps
    np.sqrt(rstd, out=rstd)
    np.reciprocal(rstd, out=rstd)
    y *= rstd[:, None]
    if w is not None:
        y *= w
    if b is not None:
        y += b


def _backward_numpy(g: np.ndarray, rows: np.ndarray, w: Any, mean: Any, rstd: Any, eps: float,
                    needs: tuple[bool, bool, bool]) -> tuple[Any, Any, Any]:
    r, n = rows.shape
    mean_w = const_vector(n, 1.0 / max(n, 1), rows.dtype)
    if mean is None:
        mean = rows @ mean_w
        xhat = rows - mean[:, None]
        rstd = np.square(xhat) @ mean_w
        rstd += eps
        np.sqrt(rstd, out=rstd)
        np.reciprocal(rstd, out=rstd)
    else:
        xhat = rows - mean[:, None]
    rstd = rstd[:, None]
    xhat *= rstd
    ones = const_vector(r, 1.0, g.dtype)
    gx = gw = gb = None
    if needs[0]:
        gy = g * w if w is not None else g
        m1 = gy @ mean_w
        t = gy * xhat
        m2 = t @ mean_w
        gx = np.multiply(xhat, m2[:, None], out=t)
        np.subtract(gy, gx, out=gx)
        gx -= m1[:, None]
        gx *= rstd
    if needs[1]:
        gw = ones @ (g * xhat)
    if needs[2]:
        gb = ones @ g
    return (gx, gw, gb)


# ---- the selected implementations ------------------------------------------------------------------------

layer_norm_forward = _forward_jit if ENABLED else _forward_numpy
layer_norm_forward.__doc__ = """Normalise each row of ``rows`` ((r, n), C-contiguous, float32 or float64) into ``y``
(same shape), scaled by ``w`` and shifted by ``b`` ((n,) or None), writing each row's mean and 1/std into
``mean`` and ``rstd`` ((r,)). ``eps`` is added to the variance (biased, as PyTorch's)."""
layer_norm_backward = _backward_jit if ENABLED else _backward_numpy
layer_norm_backward.__doc__ = """The gradients ``(gx, gw, gb)`` of `layer_norm_forward` for the output gradient
``g`` ((r, n), the rows' dtype), each None unless ``needs`` asks for it: ``gx`` (r, n), ``gw`` and ``gb`` (n,)
summed over the rows. ``mean`` and ``rstd`` are the forward's, or None to compute them again with ``eps``."""
