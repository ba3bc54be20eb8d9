"""Softmax over the last axis of a C-contiguous float32/float64 array, in place: optionally scaled and causal
(attention's scores), and its backward ``p * (g - sum(g * p))``.

The numpy twins take ~6 calls a direction (a row max over transposed rows, a broadcast subtraction, exp,
a BLAS row sum, a broadcast division, and for a causal mask a masked copy of -inf); the compiled forward
is three calls: a kernel that scales, masks and shifts, numpy's exp (vectorised: numba calls libm's expf
an element at a time, 5x slower), and a kernel that normalises. A row whose every score is -inf (or whose
max is not finite) is shifted by 0, as the twins do; ``zero_dead`` then gives it zeros (PyTorch's safe
softmax under a mask) instead of 0/0.
"""

from __future__ import annotations

import numpy as np

from ._jit import ENABLED, K
from ._rows import row_max, row_sum

# ---- compiled ------------------------------------------------------------------------------------------


@K.register
def softmax_shift_rows(s, scale, causal, q_len):  # type: ignore[no-untyped-def]
    # scale, then subtract each row's max (0 where the max is not finite, as the twin does); a causal
    # query's later keys become -inf, so numpy's exp (vectorised, unlike libm's expf here) gives them 0
    rows, n = s.shape
    for r in range(rows):
        lim = n
        if causal:
            # query r % q_len sees keys 0..r % q_len (torch's is_causal: a top-left lower triangle)
            lim = min(r % q_len + 1, n)
        m = -np.inf
        nan = False
        for j in range(lim):
            v = s[r, j] * scale
            s[r, j] = v
            if v > m:
                m = v
            elif v != v:
                nan = True
        if nan or not np.isfinite(m):
            m = 0.0
        for j in range(lim):
            s[r, j] = s[r, j] - m
        for j in range(lim, n):
            s[r, j] = -np.inf


@K.register
def softmax_normalize_rows(e, zero_dead):  # type: ignore[no-untyped-def]
    rows, n = e.shape
    for r in range(rows):
        tot = 0.0
        for j in range(n):
            tot += e[r, j]
        if tot == 0.0 and zero_dead:
            tot = 1.0
        for j in range(n):
            e[r, j] = e[r, j] / tot


@K.register
def softmax_backward_rows_inplace(g, p):  # type: ignore[no-untyped-def]
    rows, n = g.shape
    for r in range(rows):
        dot = 0.0
        for j in range(n):
            dot += g[r, j] * p[r, j]
        for j in range(n):
            g[r, j] = (g[r, j] - dot) * p[r, j]


# rows longer than this take the twin: numpy's whole-row max and BLAS sum beat the kernels' scalar loops
# there (a (700, 10000) float32 softmax: 2x faster in numpy), and its fixed cost no longer counts
_LONG_ROW = 1024


def _softmax_jit(s: np.ndarray, scale: float = 1.0, causal: bool = False, zero_dead: bool = False) -> np.ndarray:
    if s.shape[-1] > _LONG_ROW:
        return _softmax_numpy(s, scale, causal, zero_dead)
    q_len = s.shape[-2] if causal else 1
    rows = s.reshape(-1, s.shape[-1])
    K.softmax_shift_rows(rows, s.dtype.type(scale), causal, q_len)
    np.exp(rows, out=rows)
    K.softmax_normalize_rows(rows, zero_dead)
    return s


def _softmax_backward_jit(g: np.ndarray, p: np.ndarray) -> np.ndarray:
    if g.shape[-1] > _LONG_ROW:
        return _softmax_backward_numpy(g, p)
    K.softmax_backward_rows_inplace(g.reshape(-1, g.shape[-1]), p.reshape(-1, p.shape[-1]))
    return g


# ---- numpy twins -----------------------------------------------------------------------------------------

_CAUSAL: dict[tuple[int, int], np.ndarray] = {}


def above_diagonal(ll: int, ss: int) -> np.ndarray:
    """The (L, S) positions a causal query may not see (cached: one per shape, read-only)."""
    m = _CAUSAL.get((ll, ss))
    if m is None:
        m = ~np.tril(np.ones((ll, ss), bool))
        m.setflags(write=False)
        if len(_CAUSAL) < 64:
            _CAUSAL[(ll, ss)] = m
    return m


def _softmax_numpy(s: np.ndarray, scale: float = 1.0, causal: bool = False, zero_dead: bool = False) -> np.ndarray:
    if scale != 1.0:
        s *= scale
    if causal:
        np.copyto(s, -np.inf, where=above_diagonal(*s.shape[-2:]))
    m = row_max(s)
    if zero_dead or not np.isfinite(m).all():
        dead = ~np.isfinite(m)
        if dead.any():
            m[dead] = 0.0
    s -= m
    p = np.exp(s, out=s)
    tot = row_sum(p)
    if zero_dead:
        tot[tot == 0] = 1.0
    p /= tot
    return p


def _softmax_backward_numpy(g: np.ndarray, p: np.ndarray) -> np.ndarray:
    dot = row_sum(np.multiply(g, p))
    g -= dot
    g *= p
    return g


softmax_lastdim_ = _softmax_jit if ENABLED else _softmax_numpy
softmax_lastdim_.__doc__ = """Softmax over the last axis of ``s`` (C-contiguous, float32 or float64), in place,
after scaling by ``scale`` and, with ``causal``, masking the keys after each query (the last two axes are
(queries, keys)). A row whose max is not finite is shifted by 0; ``zero_dead`` turns a row of zero total
into zeros. Returns ``s``."""
softmax_backward_lastdim_ = _softmax_backward_jit if ENABLED else _softmax_backward_numpy
softmax_backward_lastdim_.__doc__ = """``p * (g - sum(g * p))`` over the last axis, in place in ``g`` (C-contiguous,
``p``'s shape and dtype). Returns ``g``."""
