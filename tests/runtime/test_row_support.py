"""Row-sparse gradients kept dense: the embedding's backward (sorted ids, untouched zeros) against
np.add.at, and SGD over the noted rows only against the dense step, including when the record must not
be trusted (an in-place write, weight decay, momentum)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import runtime
from asyncgrad.runtime import _row_support

ROWS, DIM = 6000, 64  # 3 MB in float64: the untouched (mmap) zeros path


def _ref_grad(n: int, ids: np.ndarray, g: np.ndarray) -> np.ndarray:
    z = np.zeros((n, g.shape[-1]))
    np.add.at(z, ids.reshape(-1), g.reshape(-1, g.shape[-1]))
    return z


@pytest.mark.parametrize("n", [ROWS, 7])
async def test_embedding_backward_matches_add_at(rt, n: int) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, n, size=(40, 3))
    ids[0, :] = ids[1, 0]  # repeats within and across rows of the batch
    w = ag.tensor(rng.standard_normal((n, DIM)), requires_grad=True)
    g = rng.standard_normal((40, 3, DIM))
    with trio.fail_after(30):
        (gw,) = await ag.autograd.grad([ag.embedding(ag.tensor(ids), w)], [w], [ag.tensor(g)])
        await rt.synchronize()
    if n == ROWS:  # sorted ids: each row's first id written, its repeats added after it, as add.at does
        np.testing.assert_array_equal(gw.numpy(), _ref_grad(n, ids, g))
    else:
        # a small table is one one-hot GEMM (`ops._nn._ONE_HOT_MAX`): its sums are in the BLAS kernel's
        # order, which on some machines differs from add.at's in the last bits (3.6e-15 here on an AVX-512
        # EPYC, 0 on others)
        np.testing.assert_allclose(gw.numpy(), _ref_grad(n, ids, g), rtol=0, atol=1e-13)
    rows = runtime.noted_rows(gw.numpy())
    assert rows is not None and sorted(rows.tolist()) == sorted(set(ids.ravel().tolist()))


async def test_embedding_backward_padding_scale_and_empty(rt) -> None:
    rng = np.random.default_rng(1)
    ids = np.array([[1, 2, 2], [0, 2, 5]])
    w = ag.tensor(rng.standard_normal((ROWS, 4)), requires_grad=True)
    g = rng.standard_normal((2, 3, 4))
    with trio.fail_after(30):
        out = ag.embedding(ag.tensor(ids), w, padding_idx=2, scale_grad_by_freq=True)
        (gw,) = await ag.autograd.grad([out], [w], [ag.tensor(g)])
        await rt.synchronize()
        counts = np.bincount(ids.ravel(), minlength=ROWS)
        scaled = g / counts[ids][..., None] * (ids != 2)[..., None]
        np.testing.assert_allclose(gw.numpy(), _ref_grad(ROWS, ids, scaled), rtol=0, atol=1e-12)
        assert not gw.numpy()[2].any()
        empty = ag.tensor(np.zeros((0,), dtype=np.int64))
        (ge,) = await ag.autograd.grad([ag.embedding(empty, w)], [w], [ag.zeros((0, 4), dtype=np.float64)])
        assert ge.shape == (ROWS, 4) and not ge.numpy().any()
        # second order still goes through the recorded (index_add) form
        w2 = ag.tensor(rng.standard_normal((9, 3)), requires_grad=True)
        ids2 = ag.tensor(np.array([1, 1, 4]))
        assert await ag.autograd.gradcheck(lambda t: (ag.embedding(ids2, t) ** 2).sum(), (w2,))


def test_untouched_zeros_are_zero_and_writable() -> None:
    z = runtime.untouched_zeros((ROWS, DIM), np.float64)
    assert z.flags.c_contiguous and z.flags.writeable and z.shape == (ROWS, DIM)
    assert not z.any()
    z[3] = 1.0
    assert z.sum() == DIM
    assert runtime.untouched_zeros((2, 3), np.float32).dtype == np.float32


async def _step(rt, *, bind: bool, touch: bool = False, **hyper) -> tuple[np.ndarray, np.ndarray]:
    """One SGD step on a table from an embedding gradient; returns (table after, its gradient)."""
    rng = np.random.default_rng(2)
    w = ag.tensor(rng.standard_normal((ROWS, DIM)), requires_grad=True)
    ids = ag.tensor(rng.integers(0, ROWS, size=(64,)))
    (g,) = await ag.autograd.grad([ag.embedding(ids, w)], [w], [ag.tensor(rng.standard_normal((64, DIM)))])
    w.grad = g
    if bind:
        runtime.bind_rows(g)
    if touch:  # an in-place write the noted rows know nothing of
        g.add_(0.5)
    opt = ag.optim.SGD([w], lr=0.1, **hyper)
    opt.step()
    await rt.synchronize()
    return w.numpy().copy(), g.numpy().copy()


async def test_sgd_steps_noted_rows_as_the_dense_step(rt) -> None:
    with trio.fail_after(60):
        dense, g = await _step(rt, bind=False)
        sparse, _ = await _step(rt, bind=True)
        start = np.random.default_rng(2).standard_normal((ROWS, DIM))
        np.testing.assert_allclose(dense, start - 0.1 * g, rtol=0, atol=1e-14)
        np.testing.assert_allclose(sparse, dense, rtol=0, atol=1e-14)
        # an in-place write after binding: the record is not trusted, every row moves
        touched, gt = await _step(rt, bind=True, touch=True)
        np.testing.assert_allclose(touched, start - 0.1 * gt, rtol=0, atol=1e-14)
        assert (touched != start).all()
        # weight decay moves every row: the dense step
        wd, _ = await _step(rt, bind=True, weight_decay=0.01)
        wd_ref, _ = await _step(rt, bind=False, weight_decay=0.01)
        np.testing.assert_array_equal(wd, wd_ref)
        mom, _ = await _step(rt, bind=True, momentum=0.9)
        mom_ref, _ = await _step(rt, bind=False, momentum=0.9)
        np.testing.assert_array_equal(mom, mom_ref)


async def test_binding_follows_the_version_counter(rt) -> None:
    t = ag.zeros((4, 2), dtype=np.float64)
    assert not runtime.rows_bound(t)
    runtime.bind_rows(t)
    assert runtime.rows_bound(t)
    t.mul_(2.0)
    assert not runtime.rows_bound(t)
    runtime.bind_rows(t)
    runtime.unbind_rows(t)
    assert not runtime.rows_bound(t)


async def _bound_grad(rt, rng: np.random.Generator) -> tuple[ag.Tensor, np.ndarray]:
    """An embedding's gradient of a (ROWS, DIM) table, bound as a commit binds it; and its rows."""
    w = ag.tensor(np.zeros((ROWS, DIM)), requires_grad=True)
    ids = rng.integers(0, ROWS, size=(50,))
    (g,) = await ag.autograd.grad([ag.embedding(ag.tensor(ids), w)], [w], [ag.tensor(rng.standard_normal((50, DIM)))])
    await rt.synchronize()
    runtime.bind_rows(g)
    return g, np.unique(ids)


def _fresh_is_zero() -> bool:
    z = runtime.untouched_zeros((ROWS, DIM), np.float64)
    return not z.any()


async def test_a_bound_gradient_nobody_wrote_is_recycled_all_zero(rt) -> None:
    rng = np.random.default_rng(3)
    with trio.fail_after(30):
        g, rows = await _bound_grad(rt, rng)
        assert rows.size > 1
        before = _row_support.pooled_bytes()
        del g  # the last view of its mapping: its rows are cleared and the mapping kept
        assert _row_support.pooled_bytes() == before + ROWS * DIM * 8
        assert _fresh_is_zero()  # the recycled mapping (its pages mapped already) reads all zero


@pytest.mark.parametrize("how", ["in_place", "view_in_place", "numpy", "before_bind"])
async def test_a_gradient_written_elsewhere_is_not_recycled(rt, how: str) -> None:
    rng = np.random.default_rng(4)
    with trio.fail_after(30):
        w = ag.tensor(np.zeros((ROWS, DIM)), requires_grad=True)
        ids = ag.tensor(rng.integers(0, ROWS, size=(50,)))
        (g,) = await ag.autograd.grad([ag.embedding(ids, w)], [w], [ag.tensor(rng.standard_normal((50, DIM)))])
        await rt.synchronize()
        if how == "before_bind":  # written before the commit binds it: the kernel's rows are not all
            g.add_(1.0)
        runtime.bind_rows(g)
        if how == "in_place":
            g.add_(1.0)
        elif how == "view_in_place":
            g[ROWS - 1].fill_(2.0)
        elif how == "numpy":
            g.numpy()[0, :] = 3.0  # not versioned: the array left asyncgrad's view
        await rt.synchronize()
        before = _row_support.pooled_bytes()
        del g
        assert _row_support.pooled_bytes() == before  # let go, not kept
        assert _fresh_is_zero()
