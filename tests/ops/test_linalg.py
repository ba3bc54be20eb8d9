"""The linear-algebra ops (``ops/_linalg.py``): mm/bmm/dot/outer/addmm, einsum, matmul's dtype rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import arr, t, vs_torch

EINSUM_CASES = [
    ("ij,jk->ik", [(3, 4), (4, 2)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk", [(2, 3, 4), (4, 2)]),
    ("ii->i", [(4, 4)]),
    ("ij->", [(3, 4)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij,ij,ij->i", [(3, 4), (3, 4), (3, 4)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("iij,k->jk", [(3, 3, 2), (2,)]),
    ("ij,jk", [(2, 3), (3, 4)]),
    ("ji", [(2, 3)]),
]


@pytest.mark.parametrize("eq,shapes", EINSUM_CASES)
async def test_einsum(eq: str, shapes: Any, rng: np.random.Generator, torch_ref: Any) -> None:
    async with ag.open_runtime():
        ins = [rng.standard_normal(s) for s in shapes]
        await ag.autograd.gradcheck(lambda *t: ag.einsum(eq, *t), ins, eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await vs_torch(torch_ref, "einsum", lambda *t: ag.einsum(eq, *t), lambda torch, *t: torch.einsum(eq, *t), *ins)


async def test_matmul_of_mixed_dtypes_is_an_error(rt: Any) -> None:
    a, b = ag.ones(2, 3, dtype="float32"), ag.ones(3, 2, dtype="float64")
    with pytest.raises(ValueError, match=r"matmul: expected both operands to have the same dtype, got float32"):
        a @ b


R = np.random.default_rng(77)


# ---- linalg ----------------------------------------------------------------------------------------------


async def test_linalg(rt: Any) -> None:
    a, b = R.standard_normal((3, 4)), R.standard_normal((4, 2))
    np.testing.assert_allclose(arr(ag.mm(t(a), t(b))), a @ b)
    p, q = R.standard_normal((2, 3, 4)), R.standard_normal((2, 4, 5))
    np.testing.assert_allclose(arr(t(p).bmm(t(q))), p @ q)
    u, v = R.standard_normal(4), R.standard_normal(5)
    np.testing.assert_allclose(arr(ag.dot(t(u), t(u))), u @ u)
    np.testing.assert_allclose(arr(ag.outer(t(u), t(v))), np.outer(u, v))
    c = R.standard_normal(2)
    np.testing.assert_allclose(arr(ag.addmm(t(c), t(a), t(b), beta=0.5, alpha=2)), 0.5 * c + 2 * (a @ b))
    nan = t(np.full((3, 2), np.nan))
    np.testing.assert_allclose(arr(ag.addmm(nan, t(a), t(b), beta=0)), a @ b)  # beta=0 ignores the input


@pytest.mark.parametrize(
    "call, msg",
    [
        (lambda: ag.mm(t(np.ones(3)), t(np.ones((3, 2)))), "mm: mat1 must be 2-D, got shape (3,)"),
        (
            lambda: ag.mm(t(np.ones((2, 3))), t(np.ones((2, 3)))),
            "mm: mat1 and mat2 shapes cannot be multiplied (2x3 and 2x3)",
        ),
        (
            lambda: ag.mm(t(np.ones((2, 2))), t(np.ones((2, 2)), dtype=np.float32)),
            "mm: expected mat1 and mat2 to have the same dtype, got float64 and float32",
        ),
        (lambda: ag.bmm(t(np.ones((2, 3, 4))), t(np.ones((3, 4, 5)))), "bmm: shapes (2, 3, 4) and (3, 4, 5)"),
        (lambda: ag.dot(t(np.ones(3)), t(np.ones(4))), "dot: expected vectors of equal length, got shapes (3,)"),
        (lambda: ag.outer(t(np.ones((2, 2))), t(np.ones(2))), "outer: input must be 1-D, got shape (2, 2)"),
        (
            lambda: ag.addmm(t(np.ones(3)), t(np.ones((2, 2))), t(np.ones((2, 2)))),
            "addmm: input of shape (3,) cannot be broadcast to the product's shape (2, 2)",
        ),
    ],
)
async def test_linalg_errors(rt: Any, call: Callable[[], Any], msg: str) -> None:
    with pytest.raises(ag.OpError) as e:
        call()
    assert msg in str(e.value)
