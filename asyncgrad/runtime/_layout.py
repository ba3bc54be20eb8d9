"""The gradient layout contract's predicates (see DESIGN.md): which strides a parameter's gradient gets.

A dense, non-overlapping array's gradient has its strides (C, Fortran, channels-last, any permutation);
any other array's gradient is C-contiguous. Accumulation (`asyncgrad.autograd`), DDP buckets and the RPC
wire all decide by these.
"""

from __future__ import annotations

import numpy as np


def is_dense_nonoverlapping(a: np.ndarray) -> bool:
    """True if ``a``'s elements tile one contiguous block exactly, in some dimension order."""
    dims = sorted((abs(st), n) for n, st in zip(a.shape, a.strides) if n > 1)
    if any(st < 0 for n, st in zip(a.shape, a.strides) if n > 1):
        return False
    expected = a.itemsize
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True



def obeys_contract(grad: np.ndarray, param: np.ndarray) -> bool:
    """Does ``grad`` have the layout the contract asks for ``param``? (strides compared on dims > 1)"""
    if grad.shape != param.shape or grad.dtype != param.dtype:
        return False
    if grad.flags.c_contiguous and param.flags.c_contiguous:
        return True  # the common case: equal shapes and itemsizes give equal strides on every dim > 1
    if is_dense_nonoverlapping(param):
        return all(
            gs == ps for n, gs, ps in zip(param.shape, grad.strides, param.strides) if n > 1
        ) and is_dense_nonoverlapping(grad)
    return bool(grad.flags.c_contiguous)



def empty_like_contract(param: np.ndarray) -> np.ndarray:
    """An uninitialised buffer with the layout the contract gives ``param``'s gradient."""
    if not is_dense_nonoverlapping(param):
        return np.empty(param.shape, param.dtype)
    # allocate in the parameter's memory order, then view it back in logical order
    order = sorted(range(param.ndim), key=lambda i: -abs(param.strides[i]) * (param.shape[i] > 1))
    buf = np.empty([param.shape[i] for i in order], param.dtype)
    out = buf.transpose(np.argsort(order))
    return out
