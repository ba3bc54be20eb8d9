"""The ops added for PyTorch parity, across families: each is a module function and a Tensor method, and
one table checks values and gradients against PyTorch in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import output_weights

R = np.random.default_rng(77)


# ---- Tensor methods and module functions ----------------------------------------------------------------

NEW = (
    "sin cos floor ceil round log1p expm1 erf rsqrt reciprocal square lerp nan_to_num isnan isinf isfinite "
    "allclose equal prod all any amin chunk split unbind narrow flip roll movedim swapaxes unflatten repeat "
    "repeat_interleave tril triu diag trace mm bmm dot outer addmm sort argsort topk masked_select nonzero "
    "scatter scatter_add"
).split()


# ---- against PyTorch ------------------------------------------------------------------------------------

FIN = np.array([True, False, True, False, False])


NONFIN = np.array([0.0, np.nan, 0.0, np.inf, -np.inf])


IDX2 = [[0, 2], [1, 1]]


rn23, rn22 = R.standard_normal((2, 3)), R.standard_normal((2, 2))


PERM = R.permutation(12).reshape(3, 4) * 0.5


# each case: f(m, *tensors) written so that it reads the same for m = asyncgrad and m = torch; the output's
# value and the gradient of sum(out * w) with respect to every input must agree
T_CASES: list[tuple[str, Callable[..., Any], list[np.ndarray]]] = [
    ("sin", lambda m, x: m.sin(x) * x.cos(), [R.standard_normal((3, 4))]),
    ("log1p-expm1", lambda m, x: m.log1p(x.expm1()), [R.uniform(-0.5, 1, (5,))]),
    ("erf", lambda m, x: m.erf(x), [R.standard_normal((2, 3))]),
    ("rsqrt-reciprocal-square", lambda m, x: m.rsqrt(x) + x.reciprocal() * m.square(x), [R.uniform(0.5, 2, (4,))]),
    ("floor-ceil-round", lambda m, x: (m.floor(x) + x.ceil() + m.round(x)) * x, [R.uniform(-3, 3, (6,)) + 0.01]),
    ("round-decimals", lambda m, x: m.round(x, decimals=1) * x, [np.array([0.123, -2.345, 7.891])]),
    (
        "lerp",
        lambda m, a, b, w: m.lerp(a, b, w),
        [R.standard_normal((2, 3)), R.standard_normal(3), R.uniform(0, 1, (2, 3))],
    ),
    (
        "nan_to_num",
        lambda m, x: m.nan_to_num(m.where(m.tensor(FIN), x, m.tensor(NONFIN)), nan=1.0, posinf=2.0) * x,
        [R.standard_normal(5)],
    ),
    ("prod", lambda m, x: m.prod(x, 1), [np.array([[2.0, 0.0, 3.0], [0.0, 0.0, 1.0], [1.0, 2.0, 3.0]])]),
    ("prod-full", lambda m, x: x.prod(), [np.array([[2.0, 0.5], [1.5, -1.0]])]),
    ("amin", lambda m, x: m.amin(x, 0), [R.standard_normal((3, 4))]),
    ("chunk", lambda m, x: m.chunk(x, 3, 1)[2] * 2, [R.standard_normal((2, 7))]),
    ("split", lambda m, x: m.cat(x.split([1, 2], 0)[::-1]), [R.standard_normal((3, 2))]),
    ("unbind-narrow", lambda m, x: m.unbind(x, 1)[1] * x.narrow(1, -1, 1)[:, 0], [R.standard_normal((3, 4))]),
    ("flip-roll", lambda m, x: m.roll(x.flip(0), (1, 2), (0, 1)), [R.standard_normal((3, 4))]),
    ("roll-flat", lambda m, x: m.roll(x, -4), [R.standard_normal((3, 4))]),
    ("movedim-swapaxes", lambda m, x: m.swapaxes(m.movedim(x, 0, 2), 0, 1), [R.standard_normal((2, 3, 4))]),
    ("unflatten", lambda m, x: m.unflatten(x, 1, (2, 3)), [R.standard_normal((2, 6))]),
    ("repeat", lambda m, x: x.repeat(2, 1, 3), [R.standard_normal((2, 3))]),
    ("repeat_interleave", lambda m, x: m.repeat_interleave(x, 2, dim=0), [R.standard_normal((2, 3))]),
    ("tril-triu", lambda m, x: m.tril(x, -1) + x.triu(1) * 2, [R.standard_normal((2, 4, 3))]),
    ("diag", lambda m, x: m.diag(m.diag(x, 1), -1), [R.standard_normal((3, 4))]),
    ("trace", lambda m, x: m.trace(x) * x, [R.standard_normal((3, 3))]),
    ("mm-bmm", lambda m, a, b: m.mm(a, b), [R.standard_normal((3, 4)), R.standard_normal((4, 2))]),
    ("bmm", lambda m, a, b: a.bmm(b), [R.standard_normal((2, 3, 4)), R.standard_normal((2, 4, 2))]),
    ("dot-outer", lambda m, a, b: m.outer(a, b) * m.dot(a, a), [R.standard_normal(3), R.standard_normal(4)]),
    (
        "addmm",
        lambda m, c, a, b: m.addmm(c, a, b, beta=0.5, alpha=3.0),
        [R.standard_normal(2), R.standard_normal((3, 4)), R.standard_normal((4, 2))],
    ),
    ("sort", lambda m, x: m.sort(x, 0, descending=True).values, [PERM]),
    ("sort-indices", lambda m, x: m.sort(x).indices.double(), [PERM]),
    ("argsort", lambda m, x: m.argsort(x, dim=1, descending=True).double(), [PERM]),
    ("topk", lambda m, x: m.topk(x, 2, dim=0).values, [PERM]),
    ("topk-smallest", lambda m, x: x.topk(3, largest=False)[0], [PERM]),
    ("masked_select", lambda m, x: m.masked_select(x, x > 0), [R.standard_normal((3, 4))]),
    ("nonzero", lambda m, x: m.nonzero(x > 0).double(), [R.standard_normal((3, 4))]),
    ("scatter", lambda m, x, s: x.scatter(1, m.tensor(IDX2), s), [rn23, rn22]),
    (
        "scatter_add",
        lambda m, x, s: m.scatter_add(x, 0, m.tensor([[1, 0, 1]]), s),
        [R.standard_normal((2, 3)), R.standard_normal((1, 3))],
    ),
    ("isfinite", lambda m, x: m.where(m.isfinite(m.tensor(NONFIN)), x, x * 2), [R.standard_normal(5)]),
    ("isnan", lambda m, x: m.where(m.tensor(NONFIN).isnan(), x, x * 2), [R.standard_normal(5)]),
    ("isinf", lambda m, x: m.where(m.isinf(m.tensor(NONFIN)), x, x * 3), [R.standard_normal(5)]),
    ("all", lambda m, x: m.where(m.all(x > -0.5, 1, keepdim=True), x, x * 0), [R.standard_normal((4, 3))]),
    ("any", lambda m, x: m.where(m.any(x > 1, 0), x, x * 0), [R.standard_normal((4, 3))]),
]


def test_module_functions_and_methods_exist() -> None:
    for name in NEW:
        assert callable(getattr(ag, name)), name
        assert callable(getattr(ag.Tensor, name)), name
    assert "repeat" in ag.__all__ and "prod" in ag.__all__


@pytest.mark.parametrize("name, fn, inputs", T_CASES, ids=[c[0] for c in T_CASES])
async def test_against_torch(
    rt: Any, torch_ref: Any, name: str, fn: Callable[..., Any], inputs: list[np.ndarray]
) -> None:
    # the output weighting w: fixed per output shape (output_weights), so a case's recording does not
    # depend on which tests ran before it
    def reference(torch: Any) -> Any:
        xs = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inputs]
        tout = fn(torch, *xs)
        want: dict[str, Any] = {"out": tout.detach(), "dtype": tout.dtype, "requires_grad": tout.requires_grad}
        if tout.requires_grad:
            w = output_weights(tuple(tout.shape))
            want["grads"] = list(torch.autograd.grad((tout * torch.tensor(w)).sum(), xs, allow_unused=True))
        return want

    want = torch_ref("against_torch", reference, inputs=list(inputs))
    ys = [ag.tensor(a, dtype=np.float64, requires_grad=True) for a in inputs]
    aout = fn(ag, *ys)
    np.testing.assert_allclose(aout.numpy(), want["out"], rtol=1e-12, atol=1e-12, err_msg=name)
    assert aout.numpy().dtype == np.dtype(want["dtype"].removeprefix("torch."))
    if not want["requires_grad"]:
        return
    w = output_weights(aout.shape)
    agg = await ag.grad((aout * ag.tensor(w)).sum(), ys, allow_unused=True)
    for i, (a, b) in enumerate(zip(agg, want["grads"])):
        expected = np.zeros_like(inputs[i]) if b is None else b
        got = np.zeros_like(inputs[i]) if a is None else a.numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=f"{name}: gradient of input {i}")
