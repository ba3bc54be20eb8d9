"""Fused elementwise backward rules that read the forward's output: tanh's ``g (1 - y^2)`` and the
sigmoid's ``g y (1 - y)``.

The numpy twins are the rules' own expressions: three ufunc passes and two temporaries each, and on small
arrays three of numpy's fixed ~0.5-1 us call costs. The compiled kernels make one pass with the same
operations in the same order and dtype (the 1 is passed in the arrays' dtype, so float32 stays float32):
their results are bit-identical to the twins'.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._jit import ENABLED, K

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def fusable(g: Any, out: Any) -> bool:
    """Whether the fused kernels take ``g`` and ``out``: numpy arrays of one float dtype and one shape,
    both C-contiguous (anything else goes through the rule's plain expression)."""
    return (
        type(g) is np.ndarray
        and type(out) is np.ndarray
        and g.dtype == out.dtype
        and g.dtype in _FLOATS
        and g.shape == out.shape
        and g.flags.c_contiguous
        and out.flags.c_contiguous
    )


# ---- compiled ------------------------------------------------------------------------------------------


# (the arrays are C-contiguous: ravel is a view inside the kernel. The result is allocated here, not in
# the kernel: numba's boxing of a returned array costs more than the loop on small arrays)


@K.register
def tanh_backward_nd(g, y, res, one):  # type: ignore[no-untyped-def]
    gf, yf, rf = g.ravel(), y.ravel(), res.ravel()
    for i in range(yf.size):
        v = yf[i]
        rf[i] = gf[i] * (one - v * v)


@K.register
def sigmoid_backward_nd(g, y, res, one):  # type: ignore[no-untyped-def]
    gf, yf, rf = g.ravel(), y.ravel(), res.ravel()
    for i in range(yf.size):
        v = yf[i]
        rf[i] = (gf[i] * v) * (one - v)


_ONE = {dt: dt.type(1) for dt in _FLOATS}


def _tanh_backward_jit(g: np.ndarray, y: np.ndarray) -> np.ndarray:
    res = np.empty_like(y)
    K.tanh_backward_nd(g, y, res, _ONE[y.dtype])
    return res


def _sigmoid_backward_jit(g: np.ndarray, y: np.ndarray) -> np.ndarray:
    res = np.empty_like(y)
    K.sigmoid_backward_nd(g, y, res, _ONE[y.dtype])
    return res


# ---- numpy twins -----------------------------------------------------------------------------------------


def _tanh_backward_numpy(g: np.ndarray, y: np.ndarray) -> np.ndarray:
    return g * (1 - y * y)  # type: ignore[no-any-return]


def _sigmoid_backward_numpy(g: np.ndarray, y: np.ndarray) -> np.ndarray:
    return g * y * (1 - y)  # type: ignore[no-any-return]


tanh_backward = _tanh_backward_jit if ENABLED else _tanh_backward_numpy
tanh_backward.__doc__ = """``g * (1 - y * y)`` for the output ``y = tanh(x)`` and its gradient ``g`` (`fusable`
arrays): a new array of their shape and dtype."""
sigmoid_backward = _sigmoid_backward_jit if ENABLED else _sigmoid_backward_numpy
sigmoid_backward.__doc__ = """``g * y * (1 - y)`` for the output ``y = sigmoid(x)`` and its gradient ``g``
(`fusable` arrays): a new array of their shape and dtype."""
