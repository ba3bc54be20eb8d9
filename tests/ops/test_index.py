"""The indexing ops (``ops/_index.py``): gather, index_select, scatter/scatter_add; values and gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import INDEX_ERRORS, arr, t, vs_torch


async def test_gather_and_index_select(rng: np.random.Generator, torch_ref: Any) -> None:
    async with ag.open_runtime():
        x = rng.standard_normal((4, 5, 3))
        idx = rng.integers(0, 5, (3, 6, 2))  # smaller than x in the other dims; repeats
        await ag.autograd.gradcheck(lambda x: ag.gather(x, 1, idx), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await vs_torch(
            torch_ref,
            "gather",
            lambda x: x.gather(1, ag.tensor(idx)),
            lambda torch, x: x.gather(1, torch.tensor(idx)),
            x,
        )
        sel = np.array([2, 0, 2, 1])
        for dim in (0, 1, -1):
            await ag.autograd.gradcheck(
                lambda x, d=dim: ag.index_select(x, d, sel % x.shape[d]), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
            )
            await vs_torch(
                torch_ref,
                f"index_select{dim}",
                lambda x, d=dim: x.index_select(d, ag.tensor(sel % x.shape[d])),
                lambda torch, x, d=dim: x.index_select(d, torch.tensor(sel % x.shape[d])),
                x,
            )
        with pytest.raises(INDEX_ERRORS, match="out of bounds"):
            ag.gather(ag.tensor(x), 0, np.full((1, 1, 1), 9)).numpy()


async def test_scatter(rt: Any) -> None:
    x = np.zeros((3, 4))
    idx = np.array([[0, 1, 2, 0], [2, 0, 0, 1]])
    src = np.arange(1.0, 13.0).reshape(3, 4)
    want = x.copy()
    for i in range(2):
        for j in range(4):
            want[idx[i, j], j] = src[i, j]
    np.testing.assert_array_equal(arr(t(x).scatter(0, t(idx), t(src))), want)
    np.testing.assert_array_equal(arr(ag.scatter(t(x), 0, t(idx), value=7.0))[idx, np.arange(4)], 7.0)
    add = ag.scatter_add(t(x), 1, t([[0, 0, 3]]), t([[1.0, 2.0, 4.0]]))
    np.testing.assert_array_equal(arr(add)[0], [3.0, 0.0, 0.0, 4.0])
    np.testing.assert_array_equal(arr(t(x).scatter(1, t([[0, 0]]), t([[1.0, 2.0]]), reduce="add"))[0, 0], 3.0)
    with pytest.raises(ag.OpError, match="scatter: src dtype float32 must equal the input's dtype float64"):
        t(x).scatter(0, t(idx), t(src, dtype=np.float32))
    with pytest.raises(ag.OpError, match=r"scatter_add: index \(3, 4\) is larger than input \(2, 4\) in dim 0"):
        ag.scatter_add(t(np.zeros((2, 4))), 1, t(np.zeros((3, 4), dtype=np.int64)), t(np.zeros((3, 4))))
    with pytest.raises(IndexError, match="scatter: index out of bounds for dim 0 with size 3"):
        t(x).scatter(0, t([[3, 0, 0, 0]]), t(src)).numpy()


async def test_scatter_gradients(rt: Any) -> None:
    x = t(np.ones((3, 2)), requires_grad=True)
    s = t(np.ones((3, 2)), requires_grad=True)  # larger than the index: the unused part gets 0
    idx = t([[2, 0]])
    w = t([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    gx, gs = await ag.grad((x.scatter(0, idx, s) * w).sum(), [x, s])
    np.testing.assert_array_equal(arr(gx), [[1.0, 0.0], [3.0, 4.0], [0.0, 6.0]])
    np.testing.assert_array_equal(arr(gs), [[5.0, 2.0], [0.0, 0.0], [0.0, 0.0]])
