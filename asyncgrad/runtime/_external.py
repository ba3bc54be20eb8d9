"""Work of a layer above on a stream of its own (a communication lane), ordered by events with the rest.

`submit_on` is how collectives and reducers run numpy-level work (an MPI call, a copy into a bucket) on a
stream they own: the stream first waits for the kernels that produce the tensors the work touches (and for
what the calling task queued so far, which may still read them); the tensors it writes are then pending on
that stream, so any later op on them, on any stream, waits for it by an event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..devices import Stream
from ._dispatch import wait_for
from ._runtime import current_stream
from ._tensor import Tensor


def submit_on(
    stream: Stream,
    fn: Callable[..., None],
    tensors: Sequence[Tensor],
    *,
    writes: Sequence[Tensor] | None = None,
    after_caller: bool = True,
) -> int:
    """Queue ``fn(*arrays)`` on ``stream``, with the numpy arrays of ``tensors`` as they are once computed.

    Args:
        stream: Where ``fn`` runs (never on the event loop thread).
        fn: Called on the stream's lane with one array per tensor, in order.
        tensors: The tensors ``fn`` reads or writes: ``stream`` waits for the kernels producing them.
        writes: The tensors ``fn`` writes (default: all of ``tensors``): they are pending on ``stream``
            until ``fn`` has run, and their version counters are bumped.
        after_caller: Also wait for everything the calling task queued so far on the tensors' device (a
            kernel queued earlier may still read memory ``fn`` writes).

    Returns:
        The job's sequence number on ``stream`` (``await stream.synchronize(seq)`` waits for it).
    """
    for t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"submit_on: expected Tensors, got {type(t).__name__}")
        if t._dev is not stream.device:
            raise RuntimeError(f"submit_on: a tensor on {t._dev} cannot be used by work on a stream of {stream.device}")
    if after_caller:
        mine = current_stream(stream.device)
        if mine is not stream and not mine.query():
            stream.wait_event(mine.record_event())
    for t in tensors:
        wait_for(t, stream)
    targets = list(tensors) if writes is None else list(writes)
    for t in targets:
        vc = t._vc
        if vc is None:
            t._vc = [1]
        else:
            vc[0] += 1
    items = list(tensors)

    def job() -> None:
        fn(*[t._data for t in items])

    seq = stream.submit(job)
    for t in targets:
        t._stream = stream
        t._seq = seq
    return seq


def stream_work(t: Tensor) -> tuple[Stream | None, int]:
    """The stream and sequence number of the pending kernel producing ``t`` (None, 0 when computed)."""
    s = t._stream
    if s is None or s.completed >= t._seq:
        return None, 0
    return s, t._seq

