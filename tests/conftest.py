"""Shared fixtures of the asyncgrad test suite (tests run in trio mode: ``async def test_...``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _cache_bytecode() -> None:
    """Keep compiled bytecode for this run and the processes it starts, outside the source tree.

    With ``PYTHONDONTWRITEBYTECODE`` set (some CI images set it), every worker, rank and loader process the
    suite starts would compile the whole package from source again (~0.3 s of CPU each, hundreds of times).
    The variable's purpose, no ``__pycache__`` in the checkout, is kept: the bytecode goes under the user's
    cache directory instead (``PYTHONPYCACHEPREFIX``), which the children inherit.
    """
    if not os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        return
    prefix = os.environ.get("PYTHONPYCACHEPREFIX")
    if not prefix:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        prefix = os.environ["PYTHONPYCACHEPREFIX"] = str(Path(base) / "asyncgrad" / "test-pycache")
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


_cache_bytecode()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import asyncgrad as ag  # noqa: E402
from tests._reference import torch_ref  # noqa: E402, F401  (the fixture: recorded or live torch references)


@pytest.fixture
async def rt():
    """An open runtime for the duration of one test."""
    async with ag.open_runtime() as r:
        yield r


@pytest.fixture
def rng():
    """A seeded generator, so failures reproduce."""
    return np.random.default_rng(1234)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Keep each phase's report on the item: ``torch_ref`` checks its case's file only after a passing call."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
