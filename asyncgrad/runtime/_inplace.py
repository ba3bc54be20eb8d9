"""In-place updates in stream order (optimizer steps, `.grad` accumulation, zeroing).

An in-place kernel runs on the calling task's stream after the work that produced the tensor and its
operands; the tensor is then pending on that stream until the kernel completes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..devices import INLINE_MAX_ELEMENTS, add_scaled
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


def scaled_update(p: Tensor, tmp: Tensor, ufunc: Any) -> Tensor | None:
    """``p += tmp`` / ``p -= tmp`` where ``tmp = k * g`` is queued and nothing was queued after it: take its
    kernel over and update ``p`` in one pass (BLAS axpy), unless ``tmp`` turns out to be used elsewhere.

    The optimizer step users write by hand (``p -= lr * p.grad``) otherwise writes and reads back a whole
    temporary per parameter. Whether ``tmp`` is needed is decided in the kernel, when all the references
    there will ever be to it exist: if anything but the kernel still holds it, it is computed as before.
    Returns None (nothing done) when the pattern does not apply.
    """
    g, k = tmp.__dict__["_scaled"]
    stream = tmp._stream
    if (
        (ufunc is not np.add and ufunc is not np.subtract)
        or stream is None
        or tmp._seq != stream._submitted  # a later kernel may read tmp
        or stream._completed >= tmp._seq  # computed already
        or p._shape != tmp._shape
        or p._dtype is not tmp._dtype
        or p._dev is not tmp._dev
        or stream is not current_stream(p._dev)
    ):
        return None
    alpha = -k if ufunc is np.subtract else k
    tmp._defer = True  # its kernel returns at once (or, already started, computes tmp: handled below)
    box = [tmp]

    def update(a: np.ndarray, garr: np.ndarray, box: list[Tensor]) -> None:
        t = box.pop()
        d = t._data
        # refs to t: `t` and getrefcount's argument, if nothing else (a user's variable) holds it
        if d is None and sys.getrefcount(t) > 2:
            d = t._data = np.multiply(garr, k)
        if d is not None:
            ufunc(a, d, out=a, casting="unsafe")
        else:
            add_scaled(a, alpha, garr)

    inplace(p, update, g, box)
    tmp._seq = p._seq  # tmp is pending until the update: it may compute it
    return p
