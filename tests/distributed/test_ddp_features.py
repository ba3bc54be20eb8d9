"""DDP on 2 ranks: hooks leave with their owner, no_sync, bucket views, comm hooks, unused parameters, failed
and cancelled backwards (mpi_scripts/ddp_features.py), and faults of a peer (mpi_scripts/ddp_fault.py).
Gradients are compared with the same computation in one process on whole batches (relative <= 1e-10)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

pytest.importorskip("mpi4py")

from ._launch import describe, launch

TOL = 1e-10


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp_features")
    proc = launch("ddp_features.py", out, timeout=120)
    assert proc.returncode == 0, describe(proc)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_hook_counts_follow_their_owners(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        # a user hook on the first weight; DDP adds one per parameter and removes exactly its own
        assert r["hooks_before"] == [1, 0, 0, 0]
        assert r["hooks_wrapped"] == [2, 1, 1, 1]
        assert r["hooks_closed"] == [1, 0, 0, 0]
        assert r["hooks_two"] == [3, 2, 2, 2]
        assert r["hooks_one_left"] == [2, 1, 1, 1]
        assert r["hooks_after_gc"] == [1, 0, 0, 0]
        assert r["hooks_async_with"] == [2, 1, 1, 1]
        assert r["hooks_after_async_with"] == [1, 0, 0, 0]
        assert r["user_calls_1"] == 1 and r["user_calls_end"] == 3  # the user's hook ran in every pass


def test_reducer_and_its_closures_are_collected(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["threads_left"] == 0
        assert r["reducer_gone_after_close"] and r["hook_fn_gone_after_close"]
        assert r["reducer_gone_after_gc"]


def test_two_instances_do_not_interfere(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["two_instances_grad_rel"] <= TOL
        assert r["one_left_grad_rel"] <= TOL


def test_failed_wrap_adds_no_hooks_and_names_the_difference(ranks: list[dict[str, Any]]) -> None:
    assert "'0.weight:(8, 6):<f8:0,1' here but '0.weight:(8, 6):<f8:1,0' on rank 1" in ranks[0]["wrap_mismatch"]
    assert "on rank 0" in ranks[1]["wrap_mismatch"]
    for r in ranks:
        assert r["hooks_after_failed_wrap"] == [0, 0, 0, 0]
        assert r["rewrap_hooks"] == [1, 1, 1, 1]


def test_no_sync_accumulates_locally_then_averages(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["no_sync_local_differs"]  # inside no_sync the gradient is this rank's own
        assert r["no_sync_grad_rel"] <= TOL
        assert r["no_sync_stats"] == [1, 2]


def test_bucket_views_accumulate_across_backwards(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["view_accum_rel"] <= TOL


def test_comm_hooks(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["hook_allreduce_rel"] <= TOL
        assert 0 < r["hook_fp16_rel"] < 5e-3  # float16 on the wire: close, not equal
        assert r["hook_allreduce_dtype"] == r["hook_fp16_dtype"] == "float64"
        assert "only once" in r["hook_twice"]
        assert "must return an awaitable of a tensor shaped like bucket.buffer() ((83,))" in r["hook_wrong"]
        assert r["hook_wrong_grads_none"]  # the failed pass wrote no .grad


def test_unused_parameters(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["unused_spare_none"]  # unused on every rank: .grad stays None
        assert r["unused_head_set"]  # used on rank 0 only: both ranks get the average
        assert r["unused_rel"] <= TOL
        assert "no gradient for parameters ['spare.weight', 'spare.bias']" in r["unused_error"]
        assert "find_unused_parameters=True" in r["unused_error"]
        assert r["unused_error_grads_none"]


def test_broadcast_buffers(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        # with it, rank 1's overwritten running mean is replaced by rank 0's before the forward updates it;
        # without it, each rank keeps its own
        assert r["bn_True_rel"] <= TOL
        assert r["bn_False_rel"] <= TOL


def test_failed_and_cancelled_backward_leave_grads_and_reducer_usable(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["failed"] == "boom"
        assert r["failed_grads_as_before"]
        assert r["after_failure_rel"] <= TOL
        assert r["after_cancel_rel"] <= TOL
    assert ranks[0]["cancelled"] and ranks[0]["cancelled_grads_as_before"]


def test_peer_raising_mid_backward_fails_the_other_within_the_timeout(tmp_path: Any) -> None:
    t0 = time.perf_counter()
    proc = launch("ddp_fault.py", tmp_path, "raise", timeout=60)
    assert proc.returncode != 0, describe(proc)  # the job fails as a whole
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["error"].startswith("CollectiveTimeout: ") and "timeout of 2 s" in res["error"], res
    assert 1.9 < res["elapsed"] < 6.0  # within the group's timeout (2 s) plus polling slack
    assert res["grads_as_before"]
    assert time.perf_counter() - t0 < 45


def test_peer_dying_mid_backward_ends_the_job(tmp_path: Any) -> None:
    t0 = time.perf_counter()
    proc = launch("ddp_fault.py", tmp_path, "die", timeout=60)
    assert proc.returncode != 0, describe(proc)
    assert "Exit code:    3" in proc.stdout + proc.stderr  # mpiexec names the rank that died
    assert time.perf_counter() - t0 < 30  # nobody hangs
