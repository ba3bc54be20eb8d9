"""Must-show 1: 2 ranks on halves of each batch end with the parameters of 1 process on whole batches.

float64, 20 steps, SGD with momentum and Adam, an MLP (2 buckets) and a channels-last CNN, with and without
gradient_as_bucket_view; `.grad` keeps each parameter's strides at every step. One 2-rank job trains all
eight cases (MPI start-up costs seconds); each case is compared here with the same training in this process.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag

pytest.importorskip("mpi4py")

from ._launch import SCRIPTS, describe, launch

sys.path.insert(0, str(SCRIPTS))
import ddp_common as C

CASES = [(k, o, v) for k in ("mlp", "cnn") for o in ("sgd", "adam") for v in (False, True)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    out = tmp_path_factory.mktemp("ddp_eq")
    proc = launch("ddp_equivalence.py", out, timeout=150)
    assert proc.returncode == 0, describe(proc)
    return [np.load(out / f"rank{r}.npz") for r in range(2)]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.mark.parametrize(("kind", "opt_name", "view"), CASES)
async def test_two_ranks_match_one_process(ranks: list[Any], kind: str, opt_name: str, view: bool) -> None:
    tag = f"{kind}-{opt_name}-{'view' if view else 'copy'}"
    with trio.fail_after(60):
        async with ag.open_runtime():
            initial = C.params_of(C.build(kind))
            model = C.build(kind)
            opt = C.optimizer(opt_name, model.parameters())
            strides = await C.train(model, opt, C.data(kind), slice(None))
            ref = C.params_of(model)
    assert all(p == g for step in strides for p, g in step)  # the reference obeys the contract too
    worst = 0.0
    for name, want in ref.items():
        got0, got1 = ranks[0][f"{tag}/param/{name}"], ranks[1][f"{tag}/param/{name}"]
        assert np.array_equal(got0, got1), f"{tag} {name}: the ranks differ"
        worst = max(worst, _rel(got0, want))
        # the parameters moved: a test that trains nothing could not fail
        assert _rel(want, initial[name]) > 1e-4
    print(f"{tag}: max relative difference {worst:.2e}")  # shown with pytest -s
    assert worst <= 1e-10, f"{tag}: max relative difference {worst:.3g}"
    for r in range(2):
        assert ranks[r][f"{tag}/strides_ok"].all(), f"{tag}: a .grad lost its parameter's strides"
        assert int(ranks[r][f"{tag}/synced"]) == C.STEPS
        assert bool(ranks[r][f"{tag}/rebuilt"])
        if view:
            assert ranks[r][f"{tag}/grad_is_view"].all()
    if kind == "mlp":
        assert len(ranks[0][f"{tag}/buckets"]) >= 2  # several buckets, launched in order
