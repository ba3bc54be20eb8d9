"""`RRef`: a reference to an object living on a worker (made by `Worker.remote`)."""

from __future__ import annotations

import weakref
from typing import Any

import trio

from . import _dist_autograd
from ._dist_autograd import wants_grad
from ._future import Future
from ._peer import DELETE, FETCH, RCALL, UNSET, Peer
from ._wire import RRefMarker


class RRef:
    """An object on a worker: ``await rref.call("method", *args)`` calls one of its methods there;
    ``await rref.fetch()`` copies the object back (it must be something the wire carries).

    Passed as an argument to a call on its owner, an RRef arrives as the object itself. When the last
    reference to the RRef goes away, the worker drops the object.
    """

    def __init__(self, worker: Any, peer: Peer, object_id: int, type_name: str) -> None:
        self._worker = worker
        self._peer = peer
        self._id = object_id
        self.type_name = type_name
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            token = None
        self._finalizer = weakref.finalize(self, _delete, token, peer, object_id)

    def __repr__(self) -> str:
        return f"<RRef to a {self.type_name} on {self._worker.name} (#{self._id})>"

    @property
    def owner(self) -> Any:  # the Worker it lives on
        """The worker the object lives on."""
        return self._worker

    def _wire_marker(self) -> RRefMarker:
        return RRefMarker(self._worker.name, self._id)

    async def call(self, method: str, *args: Any, timeout: Any = UNSET, **kwargs: Any) -> Any:
        """Call ``method`` of the object on its worker; returns the (copied back) result."""
        if wants_grad(args, kwargs, any_tensor=True):  # recorded in the caller's graph (distributed autograd)
            return await _dist_autograd.rref_call(self, method, args, kwargs, timeout)
        peer = self._worker._live_peer()
        out = peer.prepare(RCALL, [self._id, method], args, kwargs, f"{self.type_name}.{method}()")
        return await peer.roundtrip(out, self._worker._timeout(timeout))

    def call_nowait(self, method: str, *args: Any, timeout: Any = UNSET, **kwargs: Any) -> Future:
        """`call` without waiting: a `Future` of the result."""
        peer = self._worker._live_peer()
        out = peer.prepare(RCALL, [self._id, method], args, kwargs, f"{self.type_name}.{method}()")
        return self._worker._drive(peer, out, timeout)

    async def fetch(self, timeout: Any = UNSET) -> Any:
        """A copy of the object (tensors as tensors; an object the wire cannot carry is a TypeError)."""
        peer = self._worker._live_peer()
        out = peer.prepare(FETCH, [self._id], (), {}, f"fetch of {self.type_name}")
        return await peer.roundtrip(out, self._worker._timeout(timeout))

    def close(self) -> None:
        """Drop the remote object now (later calls through this RRef fail)."""
        self._finalizer()


def _delete(token: Any, peer: Peer, object_id: int) -> None:
    # may run in any thread (the garbage collector): hand the send to the loop
    def send() -> None:
        if not peer.conn.closed:
            peer._send_plain([DELETE, object_id])

    if token is None:
        return
    try:
        token.run_sync_soon(send)
    except trio.RunFinishedError:
        pass
