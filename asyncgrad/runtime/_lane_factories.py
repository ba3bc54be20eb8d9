"""Large factories fill on a lane: ``ag.tensor(big_array)``, ``randn``/``rand``/``ones``/``full`` of many elements.

Making 64 MB of normal samples takes ~0.3 s of CPU; on the event loop thread that stalls every other task.
At or above `LANE_FACTORY_MIN_BYTES` the factory queues the fill on the calling task's stream and returns a
pending tensor, as any op does (later ops on it queue behind the fill; reading it waits for it). Below
that, and outside a trio task, the fill runs inline (a hand-off would cost more).

Random factories stay reproducible: the draw for a lane uses a generator seeded, on the calling thread
and in call order, from the caller's generator, so ``manual_seed(s)`` fixes every value; the numbers
differ from an inline draw of the same size from that generator.

``ag.tensor(a)`` of a large ndarray copies ``a`` on the lane. Until that copy ran, ``a`` is made read-only
(PyTorch copies at once, so code may overwrite ``a`` right after): a write then raises numpy's
"assignment destination is read-only" instead of changing the tensor silently; once copied, ``a``'s flag
is set back. Views of ``a`` made earlier are not protected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from ._runtime import current_runtime, current_stream
from ._tensor import Tensor

# bytes of output from which a factory fills on a lane: ~1 ms of randn on the loop thread, far more
# than a hand-off (~10 us)
LANE_FACTORY_MIN_BYTES = 1 << 20


def big(shape: tuple[int, ...], dtype: np.dtype[Any]) -> bool:
    """Whether a factory of ``shape`` and ``dtype`` should fill on a lane (and can: inside a trio task)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n >= LANE_FACTORY_MIN_BYTES and trio.lowlevel.in_trio_task()


def on_lane(
    fill: Callable[[], np.ndarray],
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    device: Any,
    requires_grad: bool,
    what: str,
    *,
    after: Callable[[], None] | None = None,
) -> Tensor:
    """A pending tensor whose value ``fill()`` computes on the task's stream of ``device``."""
    dev = current_runtime(what).device(device)
    stream = current_stream(dev)
    out = Tensor._pending(shape, dtype, dev, stream)

    def job() -> None:
        try:
            arr = fill()
            if arr.dtype != dtype:
                arr = arr.astype(dtype)
            out._data = arr
        finally:
            if after is not None:
                after()

    out._seq = stream.submit(job)
    if requires_grad:
        out.requires_grad_(True)
    return out


def child_generator(g: np.random.Generator) -> np.random.Generator:
    """A generator for one draw on a lane, seeded from ``g`` now (in the caller's order)."""
    return np.random.default_rng(int(g.integers(0, 2**63 - 1)))


def copy_on_lane(data: np.ndarray, dtype: np.dtype[Any], device: Any, requires_grad: bool) -> Tensor:
    """``ag.tensor(data)`` of a large array: the copy runs on a lane; ``data`` is read-only until then."""
    was_writeable = data.flags.writeable
    if was_writeable:
        data.flags.writeable = False

    def restore() -> None:
        if was_writeable:
            try:
                data.flags.writeable = True
            except ValueError:  # its base became read-only meanwhile: leave it so
                pass

    return on_lane(
        lambda: np.array(data, dtype=dtype, copy=True), data.shape, dtype, device, requires_grad,
        "asyncgrad.tensor", after=restore,
    )
