"""The sorting and selection ops (``ops/_sort.py``): sort/argsort, topk, masked_select, nonzero.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import arr, t

# ---- sorting and selection ------------------------------------------------------------------------------


async def test_sort_argsort(rt: Any) -> None:
    a = np.array([[3.0, 1.0, 2.0, 1.0], [np.nan, -1.0, 5.0, -1.0]])
    r = ag.sort(t(a))
    assert isinstance(r, ag.SortResult) and r.indices.dtype == np.int64
    np.testing.assert_array_equal(arr(r.values), np.sort(a, -1))
    np.testing.assert_array_equal(arr(r.indices), [[1, 3, 2, 0], [1, 3, 2, 0]])  # stable; NaN last
    v, i = t(a).sort(descending=True)
    np.testing.assert_array_equal(arr(i), [[0, 2, 1, 3], [0, 2, 1, 3]])  # stable; NaN first
    np.testing.assert_array_equal(arr(v)[:, 1:], [[2.0, 1.0, 1.0], [5.0, -1.0, -1.0]])
    np.testing.assert_array_equal(arr(ag.argsort(t(a), dim=0)), np.argsort(a, 0, kind="stable"))
    np.testing.assert_array_equal(arr(t([2, 1, 2]).argsort(descending=True)), [0, 2, 1])
    s = ag.sort(t(4.0))
    assert s.values.shape == () and s.indices.item() == 0


async def test_topk(rt: Any) -> None:
    a = np.array([[1.0, 5.0, 3.0, 4.0], [9.0, 0.0, 2.0, 7.0]])
    r = ag.topk(t(a), 2)
    assert isinstance(r, ag.TopkResult)
    np.testing.assert_array_equal(arr(r.values), [[5.0, 4.0], [9.0, 7.0]])
    np.testing.assert_array_equal(arr(r.indices), [[1, 3], [0, 3]])
    v, i = t(a).topk(1, dim=0, largest=False)
    np.testing.assert_array_equal(arr(v), [[1.0, 0.0, 2.0, 4.0]])
    np.testing.assert_array_equal(arr(i), [[0, 1, 1, 0]])
    assert ag.topk(t(a), 0).values.shape == (2, 0)
    with pytest.raises(ag.OpError, match=r"topk: k \(5\) must be an int in \[0, 4\]"):
        ag.topk(t(a), 5)


async def test_masked_select_and_nonzero(rt: Any) -> None:
    a = np.arange(6.0).reshape(2, 3)
    m = np.array([True, False, True])
    out = ag.masked_select(t(a), t(m))
    np.testing.assert_array_equal(arr(out), a[np.broadcast_to(m, a.shape)])
    assert out.ndim == 1
    with pytest.raises(ag.OpError, match="masked_select: mask must have dtype bool, got int64"):
        ag.masked_select(t(a), t([1, 0, 1]))
    z = np.array([[0, 1, 0], [2, 0, 3]])
    nz = ag.nonzero(t(z))
    assert nz.dtype == np.int64 and nz.shape == (3, 2)
    np.testing.assert_array_equal(arr(nz), np.argwhere(z))
    rows, cols = t(z).nonzero(as_tuple=True)
    np.testing.assert_array_equal(arr(rows), [0, 1, 1])
    np.testing.assert_array_equal(arr(cols), [1, 0, 2])
    assert ag.nonzero(t(np.zeros(4))).shape == (0, 1)
    assert ag.nonzero(t(5.0)).shape == (1, 0)
