"""The TensorPipe stream discipline on asyncgrad streams (CPU lanes now; the same calls for CUDA later).

- Send: the tensors of a message are copied out ("staged") into their wire buffers by a kernel on a
  *pool* stream, which first waits on an event recorded where each tensor's value is produced (the
  caller's current stream, usually). The caller's stream is never blocked, and work queued on it after
  the call is not waited for. A small tensor whose value is there already is staged inline.
- Receive: a call runs on a pool stream of its own (current for the function), without synchronising;
  its response is staged from that same stream, so it follows the function's kernels in stream order;
  the stream goes back to the pool afterwards, and the pool hands it out again only once its work is done.
- Futures: `Future.then` callbacks run with a pool stream current; awaiting a future makes the caller's
  current stream wait on the future's event (see `_future`).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ..devices import INLINE_MAX_ELEMENTS, DeviceStatistics, Stream
from ..runtime import apply, current_runtime, current_stream, defop, use_stream
from ..runtime import from_numpy as _from_numpy
from . import _shm
from ._connection import MAX_SEGMENTS
from ._wire import Encoded, stage_kernel, stage_meta

OP_STAGE = defop("rpc_stage", stage_kernel, stage_meta, None, saves=())


class StreamCounters:
    """How many pool streams the RPC layer holds now, and has taken in all (this process)."""

    taken = 0
    in_use = 0


def acquire(device: Any) -> Stream:
    StreamCounters.taken += 1
    StreamCounters.in_use += 1
    return device.pool.acquire()  # type: ignore[no-any-return]


def release(device: Any, stream: Stream) -> None:
    StreamCounters.in_use -= 1
    device.pool.release(stream)


def stage(enc: Encoded, *, respond: bool = False, shm: bool = False) -> list[tuple[Any, Stream]]:
    """Queue the copy-out of ``enc``'s tensors into their wire buffers.

    A small tensor whose value is computed already is copied inline (a few microseconds, no stream);
    the others on a pool stream of their device (a send: taken here, waiting on the events of the
    streams that produce the values) or, for a served call's response (``respond``), on the call's own
    current stream, after the function's kernels. Returns the (device, stream) pairs taken, for
    `wait_staged` to give back. With ``shm`` (a connection to a local process that takes shared
    segments) large buffers are staged into shared segments.
    """
    held: list[tuple[Any, Stream]] = []
    if not enc.tensors:
        return held
    streams: dict[Any, Stream] = {}
    shm_left = MAX_SEGMENTS
    staged = enc.staged
    # the staging op has no backward rule: it records no graph whatever the grad mode
    try:
        for t, box in zip(enc.tensors, enc.boxes):
            src = _from_numpy(t) if isinstance(t, np.ndarray) else t
            dev = src.device
            if dev.type != "cpu":
                raise TypeError(f"only tensors on a cpu device can be sent yet, got one on {dev}")
            n = src.numel()
            if n <= INLINE_MAX_ELEMENTS and src.is_ready():
                staged.append(apply(OP_STAGE, (src,), {"box": box}))  # runs inline: no stream
                continue
            big = shm and shm_left > 0 and n * src.dtype.itemsize >= _shm.MIN_BYTES
            shm_left -= big
            stream = streams.get(dev)
            if stream is None:
                if respond:
                    stream = current_stream(dev)
                else:
                    stream = acquire(dev)
                    held.append((dev, stream))
                streams[dev] = stream
            with use_stream(stream):
                staged.append(apply(OP_STAGE, (src,), {"box": box, "shm": big}))
    except BaseException:
        for dev, stream in held:
            release(dev, stream)
        raise
    return held


async def wait_staged(enc: Encoded, held: list[tuple[Any, Stream]]) -> None:
    """Wait (without blocking the loop) until every tensor of ``enc`` is in its wire buffer."""
    try:
        for s, box in zip(enc.staged, enc.boxes):
            if not box:  # queued on the pool stream: wait for that kernel only
                await s.ready()
            if not box:
                raise RuntimeError("a tensor could not be copied out for sending (its kernel was dropped)")
    finally:
        enc.staged = []
        for dev, stream in held:
            release(dev, stream)
        held.clear()


@attrs.frozen
class RPCStatistics:
    """Counters of the RPC layer in one process (`statistics()`, or `await worker.statistics()`)."""

    name: str
    connections: int
    calls_sent: int
    calls_in_flight: int
    bytes_in_flight: int
    max_bytes_in_flight: int
    calls_served: int
    calls_serving: int
    max_calls_serving: int
    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    frames_rejected: int
    connections_refused: int
    objects: int
    rpc_streams_taken: int
    rpc_streams_in_use: int
    pool: DeviceStatistics | None


def pool_statistics() -> DeviceStatistics | None:
    try:
        rt = current_runtime("statistics")
    except Exception:
        return None
    return rt.cpu.device_statistics()
