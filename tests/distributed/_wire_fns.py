"""Functions the wire tests call on workers (sent by name, imported there)."""

from __future__ import annotations

from typing import Any

from asyncgrad.distributed import _shm


def shm_counts() -> dict[str, int]:
    """This process's shared-segment counters."""
    p = _shm.pool
    return {"created": p.created, "mapped": p.mapped, "reclaimed": p.reclaimed, "lent": p.lent}


def plus_one(x: Any) -> Any:
    return x + 1
