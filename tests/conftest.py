"""Shared fixtures of the asyncgrad test suite (tests run in trio mode: ``async def test_...``)."""

from __future__ import annotations

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
