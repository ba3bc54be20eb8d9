"""Argument and shape helpers shared by the op families' meta functions."""

from __future__ import annotations

import builtins
from typing import Any

import numpy as np

from ._op import OpError
from ._tensor import Tensor


def norm_dim(op: str, x: Any, dim: Any) -> int:
    """``dim`` as a non-negative index of one of ``x``'s dims (a 0-dim tensor has dim 0 and -1)."""
    n = max(len(x.shape), 1)
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    if not -n <= dim < n:
        raise OpError(
            f"{op}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)} "
            f"(expected a dim in [{-n}, {n - 1}])"
        )
    return int(dim) % n



_bcast_cache: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ...] | None] = {}



def broadcast_shapes(op: str, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if a == b:
        return a
    key = (a, b)
    r = _bcast_cache.get(key)
    if r is None:
        try:
            r = tuple(np.broadcast_shapes(a, b))
        except ValueError:
            raise OpError(
                f"{op}: shapes {a} and {b} cannot be broadcast together; make each dimension "
                "equal or 1 (reshape or unsqueeze one operand)"
            ) from None
        if len(_bcast_cache) < 4096:
            _bcast_cache[key] = r
    return r


def _value(x: Any) -> Any:
    """numpy value of a side input (a Tensor, array, list or number)."""
    return x.numpy() if isinstance(x, Tensor) else np.asarray(x)



def _index_arg(op: str, idx: Any) -> Any:
    """An integer index input as a Tensor (kept, so pending values are waited for in order) or array."""
    if isinstance(idx, Tensor):
        if idx.dtype.kind not in "iu":
            raise OpError(f"{op}: index must be an integer tensor, got dtype {idx.dtype}")
        return idx
    a = np.asarray(idx)
    if a.dtype.kind not in "iu":
        raise OpError(f"{op}: index must be integers, got dtype {a.dtype}")
    return a



def _dim(op: str, x: Any, dim: int) -> int:
    n = max(x.ndim, 1)
    if not -n <= dim < n:
        raise OpError(f"{op}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % n



def _float_check(op: str, x: Tensor) -> None:
    if x.dtype.kind not in "fc":
        raise OpError(f"{op}: expected a floating point tensor, got dtype {x.dtype}")


def check_int_div(op: str, *xs: Any) -> None:
    kinds = [(x.dtype.kind if isinstance(x, (Tensor, np.ndarray)) else np.asarray(x).dtype.kind) for x in xs]
    if builtins.all(k in "biu" for k in kinds):
        raise RuntimeError(
            f"{op}: integer division with addcdiv is no longer supported, and in a future release addcdiv will "
            "perform a true division of tensor1 and tensor2. Use a floating point tensor1 or tensor2"
        )
