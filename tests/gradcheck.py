"""Gradient checks against central finite differences, in float64 (a helper module for the tests).

``await gradcheck(fn, inputs)`` compares the analytic gradient (``await ag.grad(...)``) of ``fn`` with
central differences computed on numpy copies of the inputs; ``await gradgradcheck(fn, inputs)`` does the
same for the second derivative (the gradient of ``sum(first_grad * v)`` under ``create_graph=True``).

``fn`` takes tensors and returns a tensor of any shape: a non-scalar output is reduced with a fixed
random weighting ``(out * w).sum()`` so that every output element takes part. ``inputs`` are numpy
arrays or asyncgrad tensors; every input is differentiated (constants belong in ``fn``'s closure).
Both functions must run inside an open runtime; they raise AssertionError with the offending input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import asyncgrad as ag

Fn = Callable[..., Any]


def _arrays(inputs: Sequence[Any]) -> list[np.ndarray]:
    out = []
    for x in inputs:
        a = np.array(x.numpy() if isinstance(x, ag.Tensor) else x, dtype=np.float64, copy=True)
        out.append(a)
    return out


def _leaves(arrays: Sequence[np.ndarray]) -> list[ag.Tensor]:
    return [ag.tensor(a, dtype=np.float64, requires_grad=True) for a in arrays]


def _weights(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _reduce(out: Any, w: np.ndarray) -> Any:
    if not isinstance(out, ag.Tensor):
        raise TypeError(f"fn must return a Tensor, got {type(out).__name__}")
    return (out * ag.tensor(w, dtype=out.dtype)).sum()


def _value(fn: Fn, arrays: Sequence[np.ndarray], w: np.ndarray) -> float:
    """``sum(fn(arrays) * w)`` computed without a graph."""
    with ag.no_grad():
        out = fn(*[ag.tensor(a, dtype=np.float64) for a in arrays])
        return float(np.sum(out.numpy() * w))


def _fd(f: Callable[[list[np.ndarray]], Any], arrays: list[np.ndarray], i: int, eps: float) -> Any:
    """Central differences of the scalar ``f`` w.r.t. every element of ``arrays[i]``."""
    base = arrays[i]
    grad = np.zeros_like(base)
    for j in range(base.size):
        plus = [a.copy() for a in arrays]
        minus = [a.copy() for a in arrays]
        plus[i].flat[j] += eps
        minus[i].flat[j] -= eps
        grad.flat[j] = (f(plus) - f(minus)) / (2 * eps)
    return grad


async def _afd(f: Callable[[list[np.ndarray]], Any], arrays: list[np.ndarray], i: int, eps: float) -> Any:
    """`_fd` for an async ``f``."""
    base = arrays[i]
    grad = np.zeros_like(base)
    for j in range(base.size):
        plus = [a.copy() for a in arrays]
        minus = [a.copy() for a in arrays]
        plus[i].flat[j] += eps
        minus[i].flat[j] -= eps
        grad.flat[j] = (await f(plus) - await f(minus)) / (2 * eps)
    return grad


def _check_grad(
    name: str, i: int, got: Any, want: np.ndarray, like: np.ndarray, atol: float, rtol: float
) -> None:
    if got is None:
        got_arr = np.zeros_like(like)
    else:
        assert isinstance(got, ag.Tensor), f"{name}: grad of input {i} is {type(got).__name__}, not a Tensor"
        assert got.shape == like.shape, f"{name}: grad of input {i} has shape {got.shape}, input {like.shape}"
        assert got.dtype == like.dtype, f"{name}: grad of input {i} has dtype {got.dtype}, input {like.dtype}"
        got_arr = got.numpy()
    np.testing.assert_allclose(
        got_arr, want, rtol=rtol, atol=atol, err_msg=f"{name}: analytic vs numeric gradient of input {i}"
    )


async def gradcheck(
    fn: Fn, inputs: Sequence[Any], eps: float = 1e-6, atol: float = 1e-5, rtol: float = 1e-4, *, seed: int = 0
) -> bool:
    """Check ``ag.grad`` of ``fn`` w.r.t. every input against central finite differences."""
    arrays = _arrays(inputs)
    leaves = _leaves(arrays)
    out = fn(*leaves)
    w = _weights(tuple(out.shape), seed)
    analytic = await ag.grad(_reduce(out, w), leaves, allow_unused=True)
    assert len(analytic) == len(leaves)
    for i, a in enumerate(arrays):
        numeric = _fd(lambda arrs: _value(fn, arrs, w), arrays, i, eps)
        _check_grad("gradcheck", i, analytic[i], numeric, a, atol, rtol)
    return True


async def _first_grads(fn: Fn, arrays: Sequence[np.ndarray], w: np.ndarray, create_graph: bool) -> Any:
    leaves = _leaves(arrays)
    out = fn(*leaves)
    grads = await ag.grad(_reduce(out, w), leaves, create_graph=create_graph, allow_unused=True)
    return leaves, grads


async def gradgradcheck(
    fn: Fn, inputs: Sequence[Any], eps: float = 1e-6, atol: float = 1e-5, rtol: float = 1e-4, *, seed: int = 0
) -> bool:
    """Check second derivatives: ``grad(sum_i first_grad_i * v_i)`` against differences of first grads.

    Also checks that the first gradients computed with ``create_graph=True`` (rules run as recorded
    asyncgrad ops) equal the plain ones (rules run as numpy kernels).
    """
    arrays = _arrays(inputs)
    with ag.no_grad():
        out_shape = tuple(fn(*[ag.tensor(a) for a in arrays]).shape)
    w = _weights(out_shape, seed)
    vs = [np.random.default_rng(seed + 1 + i).standard_normal(a.shape) for i, a in enumerate(arrays)]

    leaves, first = await _first_grads(fn, arrays, w, create_graph=True)
    _, plain = await _first_grads(fn, arrays, w, create_graph=False)
    for i, (g, p) in enumerate(zip(first, plain)):
        assert (g is None) == (p is None), f"gradgradcheck: input {i} used in one pass and not the other"
        if g is not None:
            np.testing.assert_allclose(
                g.numpy(),
                p.numpy(),
                rtol=1e-12,
                atol=1e-12,
                err_msg=f"gradgradcheck: create_graph first grad differs from the plain one (input {i})",
            )

    terms = [(g * ag.tensor(v)).sum() for g, v in zip(first, vs) if g is not None and g.requires_grad]
    if terms:
        s = terms[0]
        for t in terms[1:]:
            s = s + t
        analytic = await ag.grad(s, leaves, allow_unused=True)
    else:  # no first gradient depends on the inputs: the second derivative is zero
        analytic = (None,) * len(leaves)

    async def h(arrs: list[np.ndarray]) -> float:
        _, gs = await _first_grads(fn, arrs, w, create_graph=False)
        return float(sum(np.sum(g.numpy() * v) for g, v in zip(gs, vs) if g is not None))

    for i, a in enumerate(arrays):
        numeric = await _afd(h, arrays, i, eps)
        _check_grad("gradgradcheck", i, analytic[i], numeric, a, atol, rtol)
    return True
