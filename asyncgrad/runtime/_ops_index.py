"""scatter and scatter_add (out-of-place), with PyTorch's names, arguments and gradients.

``x.scatter(dim, index, src)`` is a copy of ``x`` with ``out[index[i][j]][j] = src[i][j]`` (dim 0);
``scatter_add`` adds instead. Only the leading ``index.shape`` block of ``src`` is used. Gradients: to
``x``, the incoming gradient with the overwritten positions zeroed (scatter) or unchanged (scatter_add);
to ``src``, the incoming gradient gathered at ``index`` (0 outside the used block: PyTorch refuses a
``src`` larger than ``index`` in backward, this gives the gradient instead).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._dispatch import OpError, apply, defop
from ._ops_nn2 import _dim, _gather_index, _index_arg
from ._tensor import Tensor


def _scatter_meta(
    x: Tensor, idx: Any, src: Any, dim: int, op: str, value: Any
) -> tuple[tuple[int, ...], np.dtype[Any]]:
    xs, ish = tuple(x.shape), tuple(idx.shape)
    if len(ish) != len(xs):
        raise OpError(f"{op}: index of shape {ish} must have as many dims as input {xs}")
    for d, (a, b) in enumerate(zip(ish, xs)):
        if d != dim and a > b:
            raise OpError(f"{op}: index {ish} is larger than input {xs} in dim {d} (only dim {dim} may be)")
    if src is not None:
        ss = tuple(src.shape)
        if len(ss) != len(xs) or any(a > b for a, b in zip(ish, ss)):
            raise OpError(f"{op}: src of shape {ss} must have as many dims as input {xs} and be at least index {ish}")
        if src.dtype != x.dtype:
            raise OpError(
                f"{op}: src dtype {src.dtype} must equal the input's dtype {x.dtype}; convert with .to(dtype)"
            )
    return xs, x.dtype


def _positions(x: np.ndarray, idx: np.ndarray, dim: int, op: str) -> tuple[Any, ...]:
    if idx.size and (idx.min() < 0 or idx.max() >= x.shape[dim]):
        raise IndexError(f"{op}: index out of bounds for dim {dim} with size {x.shape[dim]}")
    return _gather_index(idx.astype(np.intp, copy=False), dim)


def _used(src: np.ndarray, idx: np.ndarray) -> Any:
    """The block of ``src`` that the scatter reads (its leading ``idx.shape`` corner)."""
    return src[tuple(slice(0, n) for n in idx.shape)]


def _scatter_kernel(x: np.ndarray, idx: np.ndarray, src: Any, dim: int, op: str, value: Any) -> np.ndarray:
    out = x.copy()
    pos = _positions(x, idx, dim, op)
    vals = value if src is None else _used(src, idx)
    if op == "scatter":
        out[pos] = vals
    else:
        np.add.at(out, pos, vals)
    return out


def _src_grad(xp: Any, g: Any, src: Any, pos: tuple[Any, ...], ishape: tuple[int, ...]) -> Any:
    picked = g[pos]
    if tuple(src.shape) == ishape:
        return picked
    return xp.index_add(tuple(src.shape), tuple(slice(0, n) for n in ishape), picked)


def _scatter_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, idx, src = args
    iv = xp.value(idx)
    pos = _gather_index(iv.astype(np.intp, copy=False), kw["dim"])
    gx = gs = None
    if needs[0]:
        if kw["op"] == "scatter":
            keep = np.ones(tuple(x.shape), dtype=bool)
            keep[pos] = False
            gx = xp.where(xp.const(keep, g), g, 0)
        else:
            gx = g
    if needs[2]:
        gs = _src_grad(xp, g, src, pos, tuple(iv.shape))
    return (gx, None, gs)


OP_SCATTER = defop("scatter", _scatter_kernel, _scatter_meta, _scatter_rule)
OP_SCATTER_ADD = defop("scatter_add", _scatter_kernel, _scatter_meta, _scatter_rule)


def _scatter(op: str, input: Tensor, dim: int, index: Any, src: Any) -> Tensor:
    if not isinstance(input, Tensor):
        raise TypeError(f"{op}: input must be a Tensor, got {type(input).__name__}")
    idx = _index_arg(op, index)
    value = None
    if isinstance(src, (np.ndarray, list, tuple)):
        src = Tensor._wrap(np.asarray(src, dtype=input.dtype), input._dev)
    elif not isinstance(src, Tensor):
        if not isinstance(src, (int, float, bool, np.number)):
            raise TypeError(f"{op}: src must be a Tensor or a number, got {type(src).__name__}")
        src, value = None, src
    kw = {"dim": _dim(op, input, dim), "op": op, "value": value}
    return apply(OP_SCATTER if op == "scatter" else OP_SCATTER_ADD, (input, idx, src), kw)


def scatter(input: Tensor, dim: int, index: Any, src: Any = None, *, value: Any = None, reduce: Any = None) -> Tensor:
    """A copy of ``input`` with ``src`` (a tensor, or a number) written at ``index`` along ``dim``.

    ``reduce="add"`` is ``scatter_add``; for repeated indices the last write wins (PyTorch leaves it
    unspecified). Differentiable w.r.t. ``input`` and ``src``.
    """
    if src is None:
        src = value
    if src is None:
        raise TypeError("scatter: give src (a tensor) or value (a number)")
    if reduce is not None:
        if reduce != "add":
            raise OpError(f"scatter: reduce={reduce!r} is not supported; use 'add' or scatter_add")
        return _scatter("scatter_add", input, dim, index, src)
    return _scatter("scatter", input, dim, index, src)


def scatter_add(input: Tensor, dim: int, index: Any, src: Tensor) -> Tensor:
    """A copy of ``input`` with ``src`` added at ``index`` along ``dim`` (repeated indices accumulate)."""
    return _scatter("scatter_add", input, dim, index, src)


def _install() -> None:
    Tensor.scatter = scatter  # type: ignore[attr-defined]
    Tensor.scatter_add = scatter_add  # type: ignore[attr-defined]


_install()
