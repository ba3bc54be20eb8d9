"""`gradcheck` / `gradgradcheck`: analytic gradients against float64 central finite differences.

As PyTorch's ``torch.autograd.gradcheck``: ``func`` takes the inputs and returns a tensor; a non-scalar
output is weighted by a fixed random array (``(out * w).sum()``) so that every output element takes part.
The inputs that are checked are numpy arrays (copied to float64 leaves, their strides kept) and tensors
that require grad; other arguments are passed as they are. Both are ``async`` (they run backward passes):
``assert await ag.autograd.gradcheck(f, [x])``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..runtime import Tensor, from_numpy, no_grad
from ._api import grad

Fn = Callable[..., Any]


class GradcheckError(RuntimeError):
    """An analytic gradient differs from its finite-difference estimate (names the input and the worst element)."""


def _leaf(a: np.ndarray) -> Tensor:
    return from_numpy(np.array(a, dtype=np.float64, order="K", copy=True)).requires_grad_()


class _Inputs:
    """The checked inputs as float64 arrays, and how to rebuild ``func``'s arguments from them."""

    def __init__(self, inputs: Any) -> None:
        items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        self.items = items
        self.slots: list[int] = []  # positions of the checked inputs among func's arguments
        self.arrays: list[np.ndarray] = []
        for i, x in enumerate(items):
            if isinstance(x, Tensor):
                if not x.requires_grad:
                    continue
                arr = x.numpy()
            elif isinstance(x, np.ndarray):
                arr = x
            else:
                continue
            if arr.dtype.kind not in "fc":
                raise TypeError(
                    f"gradcheck: input {i} has dtype {arr.dtype}; differentiated inputs must be floating point"
                )
            self.slots.append(i)
            self.arrays.append(np.array(arr, dtype=np.float64, order="K", copy=True))
        if not self.slots:
            raise ValueError(
                "gradcheck: no input to differentiate; pass numpy arrays or tensors with requires_grad=True"
            )

    def args(self, arrays: Sequence[np.ndarray], leaves: bool) -> tuple[list[Any], list[Tensor]]:
        args = list(self.items)
        made: list[Tensor] = []
        for slot, a in zip(self.slots, arrays):
            t = _leaf(a) if leaves else from_numpy(np.array(a, order="K", copy=True))
            args[slot] = t
            made.append(t)
        return args, made


def _weighted(out: Any, w: np.ndarray) -> Tensor:
    if not isinstance(out, Tensor):
        raise TypeError(f"gradcheck: func must return a Tensor, got {type(out).__name__}")
    return (out * from_numpy(w.astype(out.dtype, copy=False))).sum()


def _value(func: Fn, ins: _Inputs, arrays: Sequence[np.ndarray], w: np.ndarray) -> float:
    """``sum(func(arrays) * w)`` computed without a graph."""
    with no_grad():
        args, _ = ins.args(arrays, leaves=False)
        return float(np.sum(func(*args).numpy() * w))


def _perturbed(arrays: list[np.ndarray], i: int, j: int, delta: float) -> list[np.ndarray]:
    out = list(arrays)
    a = out[i] = arrays[i].copy(order="K")
    idx = np.unravel_index(j, a.shape)
    a[idx] += delta
    return out


def _compare(what: str, i: int, got: Any, want: np.ndarray, like: np.ndarray, atol: float, rtol: float) -> None:
    if got is None:
        got_arr = np.zeros_like(like)
    else:
        if not isinstance(got, Tensor):
            raise GradcheckError(f"{what}: the gradient of input {i} is a {type(got).__name__}, not a Tensor")
        if tuple(got.shape) != like.shape or got.dtype != like.dtype:
            raise GradcheckError(
                f"{what}: the gradient of input {i} has shape {tuple(got.shape)} and dtype {got.dtype}, "
                f"the input has shape {like.shape} and dtype {like.dtype}"
            )
        got_arr = got.numpy()
    bad = ~np.isclose(got_arr, want, rtol=rtol, atol=atol)
    if bad.any():
        j = int(np.argmax(np.where(bad, np.abs(got_arr - want), -1.0)))
        idx = np.unravel_index(j, like.shape)
        raise GradcheckError(
            f"{what}: analytic and numerical gradients of input {i} differ at index {tuple(int(k) for k in idx)}: "
            f"analytic {got_arr[idx]!r}, numerical {want[idx]!r} ({int(bad.sum())} of {bad.size} elements "
            f"outside rtol={rtol}, atol={atol})"
        )


async def gradcheck(
    func: Fn,
    inputs: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    seed: int = 0,
) -> bool:
    """Check the gradients of ``func`` w.r.t. its inputs against central finite differences (float64).

    Args:
        func: A function of the inputs returning a Tensor.
        inputs: One input or a sequence (numpy arrays and tensors that require grad are checked).
        eps: The finite-difference step.
        atol: Absolute tolerance.
        rtol: Relative tolerance.
        raise_exception: Raise `GradcheckError` on a mismatch (else return False).
        seed: Seed of the random output weighting.

    Returns:
        True if every gradient matches.
    """
    ins = _Inputs(inputs)
    try:
        args, leaves = ins.args(ins.arrays, leaves=True)
        out = func(*args)
        w = np.random.default_rng(seed).standard_normal(tuple(out.shape))
        analytic = await grad(_weighted(out, w), leaves, allow_unused=True)
        for i, a in enumerate(ins.arrays):
            numeric = np.zeros(a.shape)
            for j in range(a.size):
                fp = _value(func, ins, _perturbed(ins.arrays, i, j, eps), w)
                fm = _value(func, ins, _perturbed(ins.arrays, i, j, -eps), w)
                numeric[np.unravel_index(j, a.shape)] = (fp - fm) / (2 * eps)
            _compare("gradcheck", ins.slots[i], analytic[i], numeric, a, atol, rtol)
    except GradcheckError:
        if raise_exception:
            raise
        return False
    return True


async def _first_grads(
    func: Fn, ins: _Inputs, arrays: Sequence[np.ndarray], w: np.ndarray, create_graph: bool
) -> tuple[list[Tensor], tuple[Any, ...]]:
    args, leaves = ins.args(arrays, leaves=True)
    gs = await grad(_weighted(func(*args), w), leaves, create_graph=create_graph, allow_unused=True)
    return leaves, gs


def _dot(gs: Sequence[Any], vs: Sequence[np.ndarray]) -> Any:
    terms = [(g * from_numpy(v)).sum() for g, v in zip(gs, vs) if g is not None]
    s = terms[0] if terms else None
    for t in terms[1:]:
        s = s + t
    return s


async def gradgradcheck(
    func: Fn,
    inputs: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    directions: int | None = None,
    raise_exception: bool = True,
    seed: int = 0,
) -> bool:
    """Check second derivatives: the gradient of ``h(x) = <grad f(x), v>`` (recorded with
    ``create_graph=True``) against central differences of ``h``, for a fixed random ``v``.

    Also checks that the first gradients computed with ``create_graph=True`` (rules run as recorded ops)
    equal the plain ones (rules run as numpy kernels), to 1e-12.

    Args:
        func: A function of the inputs returning a Tensor.
        inputs: As for `gradcheck`.
        eps: The finite-difference step.
        atol: Absolute tolerance.
        rtol: Relative tolerance.
        directions: None checks every element; N checks N random directions ``u`` (the directional
            derivative ``<grad h, u>``), for large inputs.
        raise_exception: Raise `GradcheckError` on a mismatch (else return False).
        seed: Seed of the random weightings.

    Returns:
        True if every second derivative matches.
    """
    ins = _Inputs(inputs)
    arrays = ins.arrays
    rng = np.random.default_rng(seed + 1)
    try:
        with no_grad():
            args, _ = ins.args(arrays, leaves=False)
            w = np.random.default_rng(seed).standard_normal(tuple(func(*args).shape))
        vs = [rng.standard_normal(a.shape) for a in arrays]
        leaves, first = await _first_grads(func, ins, arrays, w, create_graph=True)
        _, plain = await _first_grads(func, ins, arrays, w, create_graph=False)
        for i, (g, p) in enumerate(zip(first, plain)):
            if (g is None) != (p is None):
                raise GradcheckError(f"gradgradcheck: input {ins.slots[i]} is used in one pass and not the other")
            if g is not None and not np.allclose(g.numpy(), p.numpy(), rtol=1e-12, atol=1e-12):
                raise GradcheckError(
                    f"gradgradcheck: the first gradient of input {ins.slots[i]} recorded with create_graph=True "
                    "differs from the plain one"
                )
        s = _dot([g if g is not None and g.requires_grad else None for g in first], vs)
        if s is not None:
            hg = await grad(s, leaves, allow_unused=True)
        else:  # no first gradient depends on the inputs: the second derivative is zero
            hg = (None,) * len(leaves)

        async def h(arrs: Sequence[np.ndarray]) -> float:
            _, gs = await _first_grads(func, ins, arrs, w, create_graph=False)
            return float(sum(np.sum(g.numpy() * v) for g, v in zip(gs, vs) if g is not None))

        if directions is None:
            for i, a in enumerate(arrays):
                numeric = np.zeros(a.shape)
                for j in range(a.size):
                    hp = await h(_perturbed(arrays, i, j, eps))
                    hm = await h(_perturbed(arrays, i, j, -eps))
                    numeric[np.unravel_index(j, a.shape)] = (hp - hm) / (2 * eps)
                _compare("gradgradcheck", ins.slots[i], hg[i], numeric, a, atol, rtol)
        else:
            dense = [np.zeros(a.shape) if g is None else g.numpy() for a, g in zip(arrays, hg)]
            for k in range(directions):
                us = [rng.standard_normal(a.shape) for a in arrays]
                hp = await h([a + eps * u for a, u in zip(arrays, us)])
                hm = await h([a - eps * u for a, u in zip(arrays, us)])
                slope = (hp - hm) / (2 * eps)
                analytic = sum(float(np.sum(g * u)) for g, u in zip(dense, us))
                if not np.isclose(analytic, slope, rtol=rtol, atol=atol):
                    raise GradcheckError(
                        f"gradgradcheck: the second derivative along random direction {k} is {analytic!r} "
                        f"analytically and {slope!r} numerically (rtol={rtol}, atol={atol})"
                    )
    except GradcheckError:
        if raise_exception:
            raise
        return False
    return True
