"""Worker-to-worker calls: code running on a worker reaches the other workers of its set directly.

``await dist.get_worker("worker1")`` inside a call running on worker0 returns a handle to worker1 over
a direct connection (PyTorch's ``rpc.rpc_async(to=...)`` analogue: ``await dist.rpc("worker1", fn, x)``).
The connection is made on first use: worker0 asks its parent for worker1's address, connects, proves the
cluster secret (the same HMAC handshake as every connection) and introduces itself as a peer; worker1
serves it as it serves its parent. The handle is cached for the worker's life; the connection's tasks
live in the worker's serving nursery and end with it.

A call through such a handle whose tensor arguments require grad is recorded in the calling worker's own
graph (distributed autograd): its backward goes worker0 -> worker1 directly, and worker1's staged
gradients are committed by the token that worker0 commits only when the whole pass succeeded.

In the parent (the trainer), ``get_worker(name)`` returns the `Worker` of the open set holding that name.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import trio

from . import _dist_autograd
from ._connection import Connection, client_handshake, connect
from ._dist_autograd import wants_grad
from ._errors import WorkerDied
from ._future import Future
from ._peer import CALL, NEW, PEER, UNSET, Outgoing, Peer, current_call, drive_call, send_message, target_of, this_node
from ._rref import RRef

CONNECT_TIMEOUT = 30.0  # seconds to look a peer up and connect to it


class _Mesh:
    """This worker's means to reach its peers (installed by the worker process when it starts)."""

    def __init__(self, nursery: trio.Nursery, secret: bytes, limits: dict[str, int], parent: Peer) -> None:
        self.nursery = nursery
        self.secret = secret
        self.limits = limits
        self.parent = parent
        self.handles: dict[str, PeerWorker] = {}
        self.connecting: dict[str, trio.Event] = {}


_MESH: _Mesh | None = None
# in a parent: the Worker of each worker connection (to answer "where does my sibling listen?"); weak both
# ways, as the Worker holds its peer
_BY_PEER: weakref.WeakKeyDictionary[Peer, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def install(nursery: trio.Nursery, secret: bytes, limits: dict[str, int], parent: Peer) -> None:
    """Called by a worker process once it serves its parent."""
    global _MESH
    _MESH = _Mesh(nursery, secret, limits, parent)


def note_worker(worker: Any) -> None:
    """Called by a parent when a worker joined (its peer is set)."""
    if worker.peer is not None:
        _BY_PEER[worker.peer] = weakref.ref(worker)


def _address_of(name: str) -> str:
    """(served in the parent) The listening address of the caller's sibling ``name``."""
    ctx = current_call.get()
    ref = _BY_PEER.get(ctx.peer) if ctx is not None else None
    caller = ref() if ref is not None else None
    if caller is None:
        raise RuntimeError(f"only a worker of an open set can look up its peer {name!r}")
    try:
        w = caller._workers.by_name(name)
    except KeyError as e:
        raise KeyError(f"{caller.name} asked for a worker named {name!r}: {e.args[0]}") from None
    if not w.alive or not w.address:
        raise WorkerDied(name, w.exitcode, "it is not alive, so its peers cannot reach it")
    return str(w.address)


class PeerWorker:
    """A handle, on a worker, to another worker of its set over a direct connection (`get_worker`).

    It has `Worker`'s calls: ``call``, ``call_nowait``, ``remote`` (an `RRef` owned by that worker), and
    ``name``; a call whose tensor arguments require grad is recorded in this worker's graph.
    """

    def __init__(self, name: str, peer: Peer, nursery: trio.Nursery, timeout: float | None) -> None:
        self.name = name
        self.peer: Peer | None = peer
        self._nursery = nursery
        self._default_timeout = timeout

    def __repr__(self) -> str:
        return f"<PeerWorker {self.name} from {this_node().name}{'' if self.alive else ' (gone)'}>"

    @property
    def alive(self) -> bool:
        p = self.peer
        return p is not None and p.death is None and not p.lost.is_set()

    def _live_peer(self) -> Peer:
        p = self.peer
        assert p is not None
        if p.death is not None:
            raise copy.copy(p.death)
        return p

    def _timeout(self, timeout: Any) -> float | None:
        t = self._default_timeout if timeout is UNSET else timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {t!r}")
        return t  # type: ignore[no-any-return]

    async def call(self, fn: Any, /, *args: Any, timeout: Any = UNSET, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on that worker (see `Worker.call`)."""
        target = target_of(fn)
        if wants_grad(args, kwargs):
            return await _dist_autograd.call(self, target, args, kwargs, timeout)
        peer = self._live_peer()
        out = peer.prepare(CALL, [target], args, kwargs, f"the call of {target}")
        return await peer.roundtrip(out, self._timeout(timeout))

    def call_nowait(self, fn: Any, /, *args: Any, timeout: Any = UNSET, **kwargs: Any) -> Future:
        """Start ``fn(*args, **kwargs)`` on that worker; a `Future` of its result."""
        target = target_of(fn)
        peer = self._live_peer()
        out = peer.prepare(CALL, [target], args, kwargs, f"the call of {target}")
        return self._drive(peer, out, timeout)

    def _drive(self, peer: Peer, out: Outgoing, timeout: Any, what: str | None = None) -> Future:
        fut = Future(self._nursery, what or out.what)
        scope = trio.CancelScope()
        fut._cancel = scope.cancel
        self._nursery.start_soon(drive_call, peer, out, self._timeout(timeout), fut, scope)
        return fut

    async def remote(self, cls: Any, /, *args: Any, timeout: Any = UNSET, **kwargs: Any) -> RRef:
        """Create ``cls(*args, **kwargs)`` on that worker; an `RRef` to it."""
        target = target_of(cls)
        peer = self._live_peer()
        out = peer.prepare(NEW, [target], args, kwargs, f"the creation of {target}")
        object_id = await peer.roundtrip(out, self._timeout(timeout))
        return RRef(self, peer, object_id, target.partition(":")[2])


async def get_worker(name: str, *, timeout: float | None = None, connect_timeout: float = CONNECT_TIMEOUT) -> Any:
    """A handle to the worker called ``name``: on a worker, a `PeerWorker` over a direct connection (made
    on first use, then cached); in the parent, the `Worker` of the open set that has that name.

    Args:
        name: The worker's name (``"worker1"``...).
        timeout: The default timeout (seconds) of calls through a new handle (None: none).
        connect_timeout: How long looking the peer up and connecting may take.

    Raises:
        KeyError: No worker of this set has that name.
        TimeoutError: The peer could not be reached within ``connect_timeout``.
        WorkerDied: The peer is gone.
    """
    mesh = _MESH
    if mesh is None:
        return _in_parent(name)
    me = this_node().name
    if name == me:
        raise ValueError(f"{me} asked for a handle to itself; call the function directly")
    while True:
        h = mesh.handles.get(name)
        if h is not None and h.alive:
            return h
        ev = mesh.connecting.get(name)
        if ev is None:
            break
        await ev.wait()  # another task of this worker is connecting to it: share its connection
        if name in mesh.handles and mesh.handles[name].alive:
            return mesh.handles[name]
    ev = mesh.connecting[name] = trio.Event()
    try:
        with trio.move_on_after(connect_timeout) as scope:
            peer = await _connect(mesh, name)
        if scope.cancelled_caught:
            raise TimeoutError(f"{me} could not reach its peer {name!r} within {connect_timeout} s")
        h = mesh.handles[name] = PeerWorker(name, peer, mesh.nursery, timeout)
        return h
    finally:
        del mesh.connecting[name]
        ev.set()


async def _connect(mesh: _Mesh, name: str) -> Peer:
    me = this_node().name
    out = mesh.parent.prepare(CALL, [f"{__name__}:_address_of"], (name,), {}, f"the address of {name}")
    address = await mesh.parent.roundtrip(out, None)
    sock = await connect(address, CONNECT_TIMEOUT)
    lim = mesh.limits
    conn = Connection(sock, name, max_meta_bytes=lim["max_meta_bytes"], max_frame_bytes=lim["max_frame_bytes"])
    try:
        await client_handshake(conn, mesh.secret)
        send_message(conn, [PEER, {"name": me}])
    except BaseException:
        conn.close()
        raise
    peer = Peer(conn, this_node(), name, max_inflight_bytes=lim["max_inflight_bytes"])
    await mesh.nursery.start(_run_peer, peer)
    return peer


async def _run_peer(peer: Peer, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    try:
        await peer.run(task_status=task_status)
    finally:
        peer.fail(WorkerDied(peer.name, None, f"the connection from {this_node().name} to it closed"))


def _in_parent(name: str) -> Any:
    live = [r() for r in list(_BY_PEER.values())]
    found = {id(w): w for w in live if w is not None and w.name == name and w.alive}
    if not found:
        raise KeyError(f"no open worker named {name!r} (get_worker works inside open_workers, or on a worker)")
    if len(found) > 1:
        raise KeyError(f"several open sets of workers have a worker named {name!r}; use workers.by_name()")
    return next(iter(found.values()))


async def rpc(to: str, fn: Any, /, *args: Any, timeout: Any = UNSET, **kwargs: Any) -> Any:
    """``await (await get_worker(to)).call(fn, *args, **kwargs)``: PyTorch's ``rpc_sync(to, fn, args)``
    as an await (recorded for autograd when a tensor argument requires grad)."""
    w = await get_worker(to)
    return await w.call(fn, *args, timeout=timeout, **kwargs)
