"""The embedding's backward: each id's gradient row summed into its table row (a scatter-add).

The compiled kernel adds the rows in batch order, bit for bit as ``np.add.at`` does, in one pass, and
marks the rows it wrote (an optimizer may then step only those). Its numpy twin is ``np.add.at`` itself.
"""

from __future__ import annotations

import numpy as np

from ._jit import ENABLED, K


@K.register
def embedding_scatter_add(z, ids, g, seen):  # type: ignore[no-untyped-def]
    n, d = g.shape
    for i in range(n):
        r = ids[i]
        seen[r] = True
        for j in range(d):
            z[r, j] += g[i, j]


def _scatter_add_jit(z: np.ndarray, ids: np.ndarray, g: np.ndarray) -> np.ndarray:
    seen = np.zeros(z.shape[0], np.bool_)
    K.embedding_scatter_add(z, np.ascontiguousarray(ids, np.intp), np.ascontiguousarray(g), seen)
    return np.flatnonzero(seen)


def _scatter_add_numpy(z: np.ndarray, ids: np.ndarray, g: np.ndarray) -> np.ndarray:
    np.add.at(z, ids, g)
    return np.unique(ids)


embedding_scatter_add_ = _scatter_add_jit if ENABLED else _scatter_add_numpy
embedding_scatter_add_.__doc__ = """Add each row ``g[i]`` ((n, d)) into ``z[ids[i]]`` (``z``: (rows, d), C-contiguous,
in place), in batch order; returns the sorted rows written. ``ids`` must be in range (the forward checked)."""
