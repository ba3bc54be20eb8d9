"""Big kernels cut into slices that idle sibling lanes of the device help with (`devices.run_parts`).

A lone training leaves its device's other lanes idle. A kernel big enough to be worth a hand-off cuts its
work into a few slices along its leading axis (images of a convolution, elements of a ReLU); the lane that
runs the kernel takes them from the front, idle siblings from the back, and nobody waits for a sibling that
never wakes. The slices are a function of the shapes only, so a kernel whose values depend on how its work
is cut (a sum over slices) gives the same values whoever ran them. While they run, each lane uses one BLAS
thread: a lone training's lanes otherwise run at every lane's BLAS threads, and two BLAS teams at once
would fight over the cores (one small product per image on a team waits at a barrier per call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..devices import blas_boost_available, blas_boosted, blas_unboost, idle_siblings, run_parts

MAX_SLICES = 4  # slices of a big kernel: two lanes share four of them evenly enough
# elementwise kernels (ReLU, pooling) over at least this many elements run as slices: ~0.3 ms of work or
# more, against tens of microseconds for lending a slice
SPLIT_MIN_ELEMENTS = 1 << 20


def slices(n: int, step: int, big: bool) -> list[tuple[int, int]]:
    """The ranges [lo, hi) of ``range(n)`` a kernel runs as separate slices: whole blocks of ``step``,
    `MAX_SLICES` of them at most when the kernel is ``big``, else one."""
    blocks = -(-n // step)
    ways = min(MAX_SLICES, blocks) if big else 1
    cuts = [min(n, step * (blocks * i // ways)) for i in range(ways + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(ways)]


def run_slices(fn: Callable[[int, int], Any], ranges: list[tuple[int, int]]) -> list[Any]:
    """``[fn(lo, hi) for (lo, hi) in ranges]``, the calls shared with idle sibling lanes when there are any
    (called from a kernel on a lane; off a lane, or with no idle sibling, they run here in order)."""
    results: list[Any] = [None] * len(ranges)

    def part(i: int, lo: int, hi: int) -> Callable[[], None]:
        def run() -> None:
            results[i] = fn(lo, hi)

        return run

    parts = [part(i, lo, hi) for i, (lo, hi) in enumerate(ranges)]
    if len(parts) < 2 or not idle_siblings():
        for run in parts:
            run()
        return results
    one = blas_boost_available()
    if one:
        blas_boosted(1)
    try:
        run_parts(parts)
    finally:
        if one:
            blas_unboost()
    return results


def sliced_flat(fn: Callable[[int, int], Any], size: int) -> None:
    """``fn(lo, hi)`` over [0, size) of a flat elementwise kernel: as slices when there are enough elements."""
    if size < SPLIT_MIN_ELEMENTS:
        fn(0, size)
    else:
        run_slices(fn, slices(size, 1, True))
