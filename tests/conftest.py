"""Shared fixtures of the asyncgrad test suite (tests run in trio mode: ``async def test_...``)."""

from __future__ import annotations

import numpy as np
import pytest

import asyncgrad as ag
from tests._reference import torch_ref  # noqa: F401  (the fixture: recorded or live torch references)


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
