"""Helpers of the program ports: float64 defaults, running a port's shared training loop for torch, and the
relative loss difference."""

from __future__ import annotations

from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import asyncgrad as ag


@contextmanager
def float64_everywhere(torch: Any = None) -> Iterator[None]:
    """float64 as the default dtype of asyncgrad and, where ``torch`` is given, of torch (both restored).

    The torch side of a port runs inside its ``torch_ref`` reference function, which passes ``torch``; the
    asyncgrad side calls it without (it must run where torch is not installed).
    """
    old_ag = ag.get_default_dtype()
    old_torch = torch.get_default_dtype() if torch is not None else None
    if torch is not None:
        torch.set_default_dtype(torch.float64)
    ag.set_default_dtype(ag.float64)
    try:
        yield
    finally:
        if torch is not None:
            torch.set_default_dtype(old_torch)
        ag.set_default_dtype(old_ag)


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (a port's shared ``async`` training loop on torch's ``Lib``, whose
    ``backward`` awaits nothing) to its result, synchronously: inside a ``torch_ref`` reference function."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("run_sync: the coroutine suspended (the torch side awaited something)")


def max_rel_diff(ours: list[float], theirs: list[float]) -> float:
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    assert a.shape == b.shape and a.size > 0
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))
