"""GIL hand-offs of the lanes: a small BLAS call keeps the GIL (a hand-off would cost more than the call)."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from asyncgrad.devices import _blas

# timing bounds: run alone, not beside another xdist worker (README's serial phase)
pytestmark = pytest.mark.serial

needs_axpy = pytest.mark.skipif(not _blas._find_axpy(), reason="no OpenBLAS axpy in this numpy")


@needs_axpy
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "n", [1, 10, 256, _blas._AXPY_ONE_THREAD_MAX + 1, _blas.AXPY_HOLD_MAX_ELEMENTS, _blas.AXPY_HOLD_MAX_ELEMENTS + 1]
)
def test_axpy_on_either_side_of_the_gil_bound_is_numpys_update(dtype: type, n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(dtype)
    y = rng.standard_normal(n).astype(dtype)
    expected = y + dtype(-0.25) * x
    assert _blas.axpy(-0.25, x, y)
    np.testing.assert_allclose(y, expected, rtol=1e-6 if dtype is np.float32 else 1e-14)


@needs_axpy
def test_a_small_axpy_keeps_the_gil_and_a_big_one_lets_go() -> None:
    """While a small axpy runs, no other Python thread can; a big one lets a waiting thread run."""
    small = np.ones(256, np.float32)  # a bias's update
    big = np.ones(1 << 23, np.float32)
    out_small, out_big = small.copy(), big.copy()
    assert _blas.axpy(1.0, small[:1], out_small[:1].copy())  # the BLAS lookup (which lets go) done before
    ticks = [0]
    stop = threading.Event()

    def counter() -> None:
        while not stop.is_set():
            ticks[0] += 1

    th = threading.Thread(target=counter)
    prev = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # this thread is not asked to drop the GIL between its calls
    try:
        th.start()
        time.sleep(0.01)  # the counter runs (and holds the GIL) until we take it back
        moved = 0  # calls during which the counter ran
        for _ in range(50):
            t0 = ticks[0]
            _blas.axpy(1.0, small, out_small)
            moved += ticks[0] != t0
        # (one stray switch allowed: the collector or the machine's other work may run a finalizer here)
        assert moved <= 1
        t0 = ticks[0]
        # a big one lets go: the waiting counter runs meanwhile (given a core: retried under load)
        calls = 0
        end = time.monotonic() + 20
        while ticks[0] == t0 and time.monotonic() < end:
            _blas.axpy(1.0, big, out_big)
            calls += 1
        assert ticks[0] > t0
    finally:
        stop.set()
        sys.setswitchinterval(prev)
        th.join(10)
    np.testing.assert_array_equal(out_small, 51.0)
    np.testing.assert_array_equal(out_big, 1.0 + calls)


@needs_axpy
def test_axpy_refuses_overlapping_arrays_and_takes_disjoint_views_of_one_buffer() -> None:
    buf = np.arange(20, dtype=np.float64)
    assert not _blas.axpy(1.0, buf[0:10], buf[5:15])  # overlapping: numpy's form instead
    assert not _blas.axpy(1.0, buf[5:15], buf[0:10])
    assert not _blas.axpy(1.0, buf[0:10], buf[0:10])
    np.testing.assert_array_equal(buf, np.arange(20.0))
    assert _blas.axpy(2.0, buf[0:10], buf[10:20])  # adjacent, not overlapping
    np.testing.assert_array_equal(buf[10:], np.arange(10, 20.0) + 2 * np.arange(10.0))
    assert _blas.axpy(1.0, np.ones(0), np.ones(0))
