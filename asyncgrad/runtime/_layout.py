"""The gradient layout contract (see DESIGN.md) and AccumulateGrad.

A dense, non-overlapping parameter gets a `.grad` with its own strides (C, Fortran, channels-last, any
permutation); any other parameter gets a C-contiguous `.grad`. An incoming gradient that already obeys
and has no other owner is stolen; otherwise it is copied into a contract-obeying buffer. Accumulating onto
an existing `.grad` is in place (keeping that tensor's layout), or out of place under create_graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _grad_mode


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


def accumulate(rt: Any, leaf: Any, g: Any, create_graph: bool, unique: bool) -> None:
    """Fold gradient ``g`` into ``leaf.grad`` following the layout contract (see module docstring)."""
    from ._inplace import inplace
    from ._tensor import Tensor

    old = leaf._grad
    param = leaf._value()
    if old is None:
        garr = g._value()
        if unique and obeys_contract(garr, param) and (create_graph or g._grad_fn is None):
            leaf._grad = g
            rt.grads_stolen += 1
            return
        if create_graph and g._rg:
            from ._ops_elementwise import copy_to_layout

            leaf._grad = copy_to_layout(g, param)
        else:
            buf = Tensor._wrap(empty_like_contract(param), leaf._dev)
            leaf._grad = inplace(buf, np.copyto, g)
        rt.grads_copied += 1
        return
    if create_graph or _grad_mode.is_grad_enabled() and g._rg:
        leaf._grad = old + g
    else:
        inplace(old, _add_into, g)
    rt.grads_accumulated += 1


def _add_into(a: np.ndarray, b: np.ndarray) -> None:
    np.add(a, b, out=a, casting="unsafe")
