"""In-place updates in stream order (optimizer steps, `.grad` accumulation, zeroing).

An in-place kernel runs on the calling task's stream after the work that produced the tensor and its
operands; the tensor is then pending on that stream until the kernel completes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..devices import INLINE_MAX_ELEMENTS
from ._dispatch import wait_for
from ._runtime import current_stream
from ._tensor import Tensor


def inplace(t: Tensor, fn: Callable[..., Any], *others: Any, write: bool = True) -> Tensor:
    """Apply ``fn(t_array, *other_arrays)`` to ``t``'s array in place, in stream order; returns ``t``.

    Every write bumps ``t``'s version counter (PyTorch's; the one place that does, shared with t's views), so a backward
    node that saved ``t`` sees the change; ``write=False`` for a kernel that only reads ``t``.
    """
    for o in others:
        if isinstance(o, Tensor) and o._dev is not t._dev:
            raise RuntimeError(
                f"in-place update of a tensor on {t._dev} with a tensor on {o._dev}; move it with .to() first"
            )
    if write:
        vc = t._vc
        if vc is None:
            t._vc = [1]
        else:
            vc[0] += 1  # the cell is shared with t's views and base
    stream = current_stream(t._dev)
    ready = t._data is not None and (t._stream is None or t._stream._completed >= t._seq)
    for o in others:
        if isinstance(o, Tensor) and (
            o._data is None or (o._stream is not None and o._stream._completed < o._seq)
        ):
            ready = False
    if ready and stream._completed >= stream._submitted and t.numel() <= INLINE_MAX_ELEMENTS:
        fn(t._value(), *[o._value() if isinstance(o, Tensor) else o for o in others])
        return t
    wait_for(t, stream)
    for o in others:
        if isinstance(o, Tensor):
            wait_for(o, stream)

    def job() -> None:
        fn(t._data, *[o._data if isinstance(o, Tensor) else o for o in others])

    t._seq = stream.submit(job)
    t._stream = stream
    return t
