"""Helpers of the program ports: float64 defaults in both libraries, and the relative loss difference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import asyncgrad as ag


@contextmanager
def float64_everywhere(torch: Any) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    ag.set_default_dtype(ag.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
        ag.set_default_dtype(ag.float32)


def max_rel_diff(ours: list[float], theirs: list[float]) -> float:
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    assert a.shape == b.shape and a.size > 0
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))
