"""The two array namespaces a backward rule runs against.

`NP` is numpy itself (plain backward: the rule runs as one kernel on a lane). `AG` maps the same names
onto differentiable asyncgrad ops (``create_graph=True``: the rule's own ops are recorded).
Rules may use operators (+ - * / ** @, comparisons, indexing) and only the functions below.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _index_add(shape: tuple[int, ...], idx: Any, g: np.ndarray) -> np.ndarray:
    """Scatter-add ``g`` into zeros of ``shape`` at ``idx`` (the adjoint of ``x[idx]``)."""
    z = np.zeros(shape, dtype=g.dtype)
    if _is_basic(idx):
        z[idx] = g  # basic indexing never repeats an element
    else:
        np.add.at(z, idx, g)
    return z


def _is_basic(idx: Any) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(isinstance(i, (int, np.integer, slice, type(None), type(Ellipsis))) for i in items)


class NP:
    """numpy namespace for rules."""

    exp = staticmethod(np.exp)
    log = staticmethod(np.log)
    tanh = staticmethod(np.tanh)
    sqrt = staticmethod(np.sqrt)
    sign = staticmethod(np.sign)
    abs = staticmethod(np.abs)
    where = staticmethod(np.where)
    matmul = staticmethod(np.matmul)  # _ops_linalg swaps in its lane-aware kernel
    swapaxes = staticmethod(np.swapaxes)
    transpose = staticmethod(np.transpose)
    expand_dims = staticmethod(np.expand_dims)
    reshape = staticmethod(np.reshape)
    broadcast_to = staticmethod(np.broadcast_to)
    index_add = staticmethod(_index_add)

    @staticmethod
    def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        return np.sum(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def astype(x: np.ndarray, dtype: Any) -> np.ndarray:
        return x.astype(dtype, copy=False)

    @staticmethod
    def value(x: Any) -> Any:
        return x

    @staticmethod
    def const(arr: Any, like: Any) -> Any:
        return arr

    @staticmethod
    def concat(xs: Any, axis: int) -> Any:
        return np.concatenate(xs, axis=axis)

    # adjoint kernels of conv / pooling and a few more (each an op with its own rule in AG)

    @staticmethod
    def conv2d(x: Any, w: Any, b: Any, geom: dict[str, Any]) -> Any:
        from ._ops_conv import conv2d_kernel

        return conv2d_kernel(x, w, b, **geom)

    @staticmethod
    def conv2d_input_grad(g: Any, w: Any, x: Any, geom: dict[str, Any]) -> Any:
        from ._ops_conv import np_conv2d_input_grad

        return np_conv2d_input_grad(g, w, x, geom)

    @staticmethod
    def conv2d_weight_grad(x: Any, g: Any, w_shape: Any, geom: dict[str, Any]) -> Any:
        from ._ops_conv import conv2d_weight_grad_kernel

        return conv2d_weight_grad_kernel(x, g, w_shape, **geom)

    @staticmethod
    def max_pool2d_scatter(g: Any, idx: Any, x_shape: Any, geom: dict[str, Any]) -> Any:
        from ._ops_conv import _pool_scatter_kernel

        return _pool_scatter_kernel(g, idx, x_shape, geom)

    @staticmethod
    def max_pool2d_gather(a: Any, idx: Any, geom: dict[str, Any]) -> Any:
        from ._ops_conv import _pool_gather_kernel

        return _pool_gather_kernel(a, idx, geom)

    @staticmethod
    def avg_pool2d(x: Any, geom: dict[str, Any], div: Any) -> Any:
        from ._ops_conv import _avg_pool_kernel

        return _avg_pool_kernel(x, geom, div)

    @staticmethod
    def avg_pool2d_backward(g: Any, x_shape: Any, geom: dict[str, Any], div: Any) -> Any:
        from ._ops_conv import _avg_pool_backward_kernel

        return _avg_pool_backward_kernel(g, x_shape, geom, div)

    @staticmethod
    def cumsum(x: Any, axis: int) -> Any:
        return np.cumsum(x, axis=axis)

    @staticmethod
    def einsum(eq: str, *ops: Any) -> Any:
        from ._ops_nn2 import np_einsum

        return np_einsum(eq, *ops)


class AG:
    """asyncgrad namespace for rules (bound lazily: the op modules import this one)."""

    @staticmethod
    def _bind() -> None:
        from . import _ops_elementwise as E
        from . import _ops_linalg as L
        from . import _ops_reduce as R
        from . import _ops_shape as S
        from ._tensor import Tensor

        AG.exp = staticmethod(E.exp)  # type: ignore[attr-defined]
        AG.log = staticmethod(E.log)  # type: ignore[attr-defined]
        AG.tanh = staticmethod(E.tanh)  # type: ignore[attr-defined]
        AG.sqrt = staticmethod(E.sqrt)  # type: ignore[attr-defined]
        AG.sign = staticmethod(E.sign)  # type: ignore[attr-defined]
        AG.abs = staticmethod(E.abs)  # type: ignore[attr-defined]
        AG.where = staticmethod(E.where)  # type: ignore[attr-defined]
        AG.astype = staticmethod(E.astype)  # type: ignore[attr-defined]
        AG.matmul = staticmethod(L.matmul)  # type: ignore[attr-defined]
        AG.swapaxes = staticmethod(lambda x, i, j: S.transpose(x, i, j))  # type: ignore[attr-defined]
        AG.transpose = staticmethod(S.permute)  # type: ignore[attr-defined]
        AG.expand_dims = staticmethod(S.expand_dims)  # type: ignore[attr-defined]
        AG.reshape = staticmethod(S.reshape)  # type: ignore[attr-defined]
        AG.broadcast_to = staticmethod(S.broadcast_to)  # type: ignore[attr-defined]
        AG.index_add = staticmethod(S.index_add)  # type: ignore[attr-defined]
        AG.concat = staticmethod(lambda xs, axis: S.concat(list(xs), axis))  # type: ignore[attr-defined]
        AG.sum = staticmethod(lambda x, axis=None, keepdims=False: R.sum(x, axis, keepdims))  # type: ignore[attr-defined]
        AG.value = staticmethod(lambda x: x.numpy() if isinstance(x, Tensor) else x)  # type: ignore[attr-defined]
        from . import _ops_conv as C
        from . import _ops_nn2 as N2

        AG.conv2d = staticmethod(C.ag_conv2d)  # type: ignore[attr-defined]
        AG.conv2d_input_grad = staticmethod(C.ag_conv2d_input_grad)  # type: ignore[attr-defined]
        AG.conv2d_weight_grad = staticmethod(C.ag_conv2d_weight_grad)  # type: ignore[attr-defined]
        AG.max_pool2d_scatter = staticmethod(C.ag_max_pool2d_scatter)  # type: ignore[attr-defined]
        AG.max_pool2d_gather = staticmethod(C.ag_max_pool2d_gather)  # type: ignore[attr-defined]
        AG.avg_pool2d = staticmethod(C.ag_avg_pool2d)  # type: ignore[attr-defined]
        AG.avg_pool2d_backward = staticmethod(C.ag_avg_pool2d_backward)  # type: ignore[attr-defined]
        AG.cumsum = staticmethod(N2.ag_cumsum)  # type: ignore[attr-defined]
        AG.einsum = staticmethod(N2.ag_einsum)  # type: ignore[attr-defined]
        AG.const = staticmethod(  # type: ignore[attr-defined]
            lambda arr, like: Tensor._wrap(np.asarray(arr), like._dev) if isinstance(like, Tensor) else arr
        )


def sum_to(xp: Any, g: Any, shape: tuple[int, ...]) -> Any:
    """Reduce a broadcast gradient back to ``shape`` (the engine applies this to every rule output)."""
    gshape = g.shape
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    if lead < 0:
        raise ValueError(f"gradient of shape {tuple(gshape)} cannot be reduced to shape {shape}")
    inner = tuple(i + lead for i, s in enumerate(shape) if s == 1 and gshape[i + lead] != 1)
    if not inner:
        # only leading dims to drop (a bias's gradient): one reduction, no reshape
        g = xp.sum(g, tuple(range(lead)), False)
    else:
        g = xp.sum(g, tuple(range(lead)) + inner, True)
        if lead:
            g = xp.reshape(g, shape)
    if tuple(g.shape) != tuple(shape):
        raise ValueError(f"gradient of shape {tuple(gshape)} cannot be reduced to shape {shape}")
    return g
