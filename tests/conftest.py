"""Shared fixtures of the asyncgrad test suite (tests run in trio mode: ``async def test_...``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import asyncgrad as ag


@pytest.fixture
async def rt():
    """An open runtime for the duration of one test."""
    async with ag.open_runtime() as r:
        yield r


@pytest.fixture
def rng():
    """A seeded generator, so failures reproduce."""
    return np.random.default_rng(1234)


def set_inline_limit(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """Set the inline fast-path threshold everywhere it was imported.

    ``limit=-1`` sends every kernel (forward, backward rule, in-place) to the worker lanes; a huge limit
    runs every kernel inline on the calling thread.
    """
    for name, mod in list(sys.modules.items()):
        if name.startswith("asyncgrad") and hasattr(mod, "INLINE_MAX_ELEMENTS"):
            monkeypatch.setattr(mod, "INLINE_MAX_ELEMENTS", limit)
