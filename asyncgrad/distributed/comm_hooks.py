"""Communication hooks for DistributedDataParallel: how a bucket of gradients is reduced.

A hook is ``hook(state, bucket) -> awaitable`` (PyTorch's ``(state, GradBucket) -> Future[Tensor]``): it is
called when the bucket is full, during the backward pass, and must *issue* its communication then (the
``*_nowait`` collectives do); the reducer awaits the returned awaitable when the pass finishes, and its
result (a tensor shaped like ``bucket.buffer()``) becomes the bucket's averaged gradients. With a hook
registered the reducer copies gradients into the bucket without dividing them: the hook decides.

``state`` is the hook's own object; for the built-in hooks it is the process group to use (None: DDP's).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import attrs
import numpy as np

from .. import runtime
from ._collectives import all_reduce_nowait
from ._process_group import ProcessGroup


@attrs.define(eq=False)
class GradBucket:
    """One bucket of a reducer, as a communication hook sees it."""

    _index: int
    _buffer: runtime.Tensor
    _parameters: list[Any]
    _offsets: list[int]
    _is_last: bool
    _group: ProcessGroup

    def index(self) -> int:
        """The bucket's position (buckets are reduced in index order on every rank)."""
        return self._index

    def buffer(self) -> runtime.Tensor:
        """The flat tensor holding the bucket's gradients (each parameter's in its own layout)."""
        return self._buffer

    def parameters(self) -> list[Any]:
        """The parameters whose gradients the bucket holds, in bucket order."""
        return list(self._parameters)

    def offsets(self) -> list[int]:
        """Each parameter's element offset in `buffer`."""
        return list(self._offsets)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the pass."""
        return self._is_last

    def process_group(self) -> ProcessGroup:
        """The group the reducer reduces over (what a hook with ``state=None`` should use)."""
        return self._group


def _group_of(state: Any, bucket: GradBucket) -> ProcessGroup:
    return state if isinstance(state, ProcessGroup) else bucket.process_group()


def allreduce_hook(state: Any, bucket: GradBucket) -> Awaitable[runtime.Tensor]:
    """Average the bucket over the ranks (what DDP does without a hook): divide, then all-reduce the sum."""
    group = _group_of(state, bucket)
    buf = bucket.buffer()
    buf.mul_(1.0 / group.size)
    return all_reduce_nowait(buf, "sum", group)  # type: ignore[return-value]


def fp16_compress_hook(state: Any, bucket: GradBucket) -> Awaitable[runtime.Tensor]:
    """Send the bucket as float16 (half the bytes): divide first (to avoid overflow), all-reduce the float16
    copy, and write it back into the bucket in its own dtype."""
    group = _group_of(state, bucket)
    buf = bucket.buffer()
    compressed = (buf * (1.0 / group.size)).to(dtype=np.float16)
    work = all_reduce_nowait(compressed, "sum", group)

    async def decompress() -> runtime.Tensor:
        await work
        buf.copy_(compressed.to(dtype=buf.dtype))
        return buf

    return decompress()


__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook"]
