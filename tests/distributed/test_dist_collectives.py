"""Collectives over MPI on 2 ranks (one launched job batches the checks; see mpi_scripts/collectives.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from ._launch import SCRIPTS, describe, launch

sys.path.insert(0, str(SCRIPTS))
from collectives import layouts


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[str]]:
    out = tmp_path_factory.mktemp("coll")
    proc = launch("collectives.py", out, timeout=90)
    assert proc.returncode == 0, describe(proc)
    return [np.load(out / f"rank{r}.npz") for r in range(2)], [(out / f"rank{r}.txt").read_text() for r in range(2)]


BASE = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5) + 1


@pytest.mark.parametrize("layout", ["c", "f", "cl", "strided"])
def test_reductions_broadcast_gather_keep_every_layout(job: Any, layout: str) -> None:
    ranks, _ = job
    for r in ranks:
        np.testing.assert_array_equal(r[f"sum/{layout}"], BASE * 3)
        np.testing.assert_array_equal(r[f"avg/{layout}"], BASE * 1.5)
        np.testing.assert_array_equal(r[f"max/{layout}"], BASE * 2)
        np.testing.assert_array_equal(r[f"bcast/{layout}"], BASE * 11)
        np.testing.assert_array_equal(r[f"gather/{layout}"], np.stack([BASE, BASE * 2]))
        assert r[f"sum_strides_kept/{layout}"]  # reduced in its own layout
        assert r[f"sum_in_place/{layout}"]


def test_layout_helper_builds_what_it_says() -> None:
    ls = layouts(BASE)
    assert ls["f"].flags.f_contiguous and not ls["f"].flags.c_contiguous
    assert ls["cl"].strides[1] == 8 and not ls["cl"].flags.c_contiguous
    assert not ls["strided"].flags.c_contiguous and not ls["strided"].flags.f_contiguous


def test_reduce_scatter_f16_and_integer_prod(job: Any) -> None:
    ranks, _ = job
    inputs = [[np.array([1.0, 2.0, 3.0]) * (k + 1) + 10 * r for r in range(2)] for k in range(2)]
    for rank, r in enumerate(ranks):
        np.testing.assert_array_equal(r["reduce_scatter"], inputs[0][rank] + inputs[1][rank])
        assert r["f16"].dtype == np.float16
        np.testing.assert_array_equal(r["f16"], np.array([1.5, 4.5, 7.5], np.float16))
        np.testing.assert_array_equal(r["prod_int"], [2, 200])


def test_collective_runs_after_the_kernels_that_produce_its_input(job: Any) -> None:
    ranks, _ = job
    total = ranks[0]["matmul_parts"] + ranks[1]["matmul_parts"]
    for r in ranks:
        np.testing.assert_allclose(r["matmul_sum"], total, rtol=1e-12)
        np.testing.assert_allclose(r["after"], 2 * total, rtol=1e-12)  # a later op waited for the all-reduce


def test_event_loop_runs_while_a_collective_waits(job: Any) -> None:
    ranks, _ = job
    r0 = ranks[0]
    assert r0["late_wait_s"] > 0.3  # rank 1 came 0.5 s late...
    assert r0["ticks"] >= 30  # ...and rank 0's loop kept ticking every 5 ms meanwhile


def test_mismatch_is_a_clear_error_on_every_rank_and_the_group_still_works(job: Any) -> None:
    ranks, msgs = job
    for text in msgs:
        lines = dict(line.split(": ", 1) for line in text.splitlines())
        assert "rank 0 passed a tensor of shape (3,)" in lines["shape"]
        assert "rank 1 passed one of shape (4,)" in lines["shape"]
        assert "float64" in lines["dtype"] and "float32" in lines["dtype"]
        assert "row-major" in lines["layout"] and "dims in memory order [1, 0]" in lines["layout"]
    for r in ranks:
        np.testing.assert_array_equal(r["after_mismatch"], [2.0, 2.0])


def test_groups_have_their_own_communicators_and_lanes(job: Any) -> None:
    ranks, _ = job
    for r in ranks:
        # 40 all-reduces on each of two groups, from two tasks at once, all right
        np.testing.assert_array_equal(r["groups_a"], [3.0 * i for i in range(40)])
        np.testing.assert_array_equal(r["groups_b"], [21.0 * i for i in range(40)])
        assert int(r["g1_stats_completed"]) == 40


def test_a_peer_that_never_joins_times_out_and_breaks_only_its_group(job: Any) -> None:
    ranks, msgs = job
    lines = dict(line.split(": ", 1) for line in msgs[0].splitlines())
    assert "did not complete within the group's timeout of 1 s" in lines["timeout"]
    assert "unusable after an earlier failure" in lines["broken"]
    assert 0.9 < float(ranks[0]["timeout_s"]) < 5.0


def test_destroy_stops_every_comm_lane(job: Any) -> None:
    ranks, _ = job
    for r in ranks:
        assert int(r["threads_with_groups"]) >= 3  # one comm lane per group used (world, g1, g2, ...)
        assert int(r["threads_after"]) == 0
        assert not bool(r["initialized_after"])


def test_import_needs_no_mpi4py(tmp_path: Path) -> None:
    # a fresh interpreter where mpi4py cannot be imported: asyncgrad and its distributed package still load
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "import asyncgrad as ag; from asyncgrad import distributed as dist\n"
        "from asyncgrad.nn.parallel import DistributedDataParallel\n"
        "assert not dist.is_initialized()\n"
        "try:\n    dist.init_process_group('mpi')\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'asyncgrad[mpi]'" in proc.stdout
