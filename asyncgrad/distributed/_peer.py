"""The RPC protocol over one connection, the same at both ends: calls out, calls served, replies.

Each end of a connection is a `Peer`. Either end may call the other (a worker serves its parent's calls
today; later issues have workers call back and call each other). Calls are numbered by the end that makes
them; replies (RESULT, ERROR, CANCELLED) and streamed messages (NOTIFY) name the caller's number. Every
served call runs as a task of the connection's nursery inside a cancel scope registered under its
number, so a CANCEL cancels exactly that task (it sees `trio.Cancelled`), and a connection that goes
away cancels all of them.

`Node` is what a process serves: the functions it resolves by name, the objects RRefs point to, counters.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib
import importlib.util
import inspect
import itertools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import trio

from ..devices import DeviceStatistics
from ..runtime import NoRuntimeError, current_runtime, from_numpy, use_stream
from . import _spin, _streams
from ._connection import Connection, ConnectionClosed, server_handshake
from ._errors import AuthenticationError, CallCancelled, ProtocolError, WorkersClosed, error_from_wire, error_to_wire
from ._future import Future
from ._wire import Encoded, RRefMarker, decode, encode, plain, read_table

log = logging.getLogger("asyncgrad.distributed")

_V = TypeVar("_V")

# message kinds (the first item of every message)
CALL = 1  # [CALL, id, target, args, kwargs]
RCALL = 2  # [RCALL, id, object id, method, args, kwargs]
NEW = 3  # [NEW, id, target, args, kwargs] -> RESULT with the new object's id
FETCH = 4  # [FETCH, id, object id]
DELETE = 5  # [DELETE, object id]
CANCEL = 6  # [CANCEL, id]
SHUTDOWN = 7  # [SHUTDOWN]
JOIN = 8  # [JOIN, info]: the first frame of a worker joining its parent
PEER = 9  # [PEER, info]: the first frame of any other connection
HELLO = 10  # [HELLO, config]: the parent's answer to JOIN
READY = 11  # [READY, info]: the worker's answer to HELLO
RESULT = 20  # [RESULT, id, value]
ERROR = 21  # [ERROR, id, error]
CANCELLED = 22  # [CANCELLED, id]
NOTIFY = 23  # [NOTIFY, id, value]: a message from a running call to its caller
POST = 24  # [POST, id, target, args, kwargs]: a CALL that gets no reply (an error is logged where it ran)

_CALL_LEN = {CALL: 5, RCALL: 6, NEW: 5, FETCH: 3, POST: 5}  # items of a well-formed call message of each kind

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30
UNSET: Any = object()  # "the default": a timeout not given falls back to the workers' one


# ---- what a process serves -----------------------------------------------------------------------


class Node:
    """This process's RPC state: name, resolved targets, objects behind RRefs, counters."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.objects: dict[int, Any] = {}
        self._object_ids = itertools.count(1)
        self._targets: dict[str, Callable[..., Any]] = {}
        self.is_async: dict[Any, bool] = {}  # resolved functions (and bound methods) that are async
        self.main_module: Any = None  # the parent's main script, loaded in a worker for "__main__:fn"
        self.main_path: str | None = None
        self.main_name: str | None = None
        self.peers: set[Peer] = set()
        self.calls_sent = 0
        self.calls_served = 0
        self.calls_serving = 0
        self.max_calls_serving = 0
        self.frames_rejected = 0
        self.connections_refused = 0
        self.bytes_in_flight = 0
        self.max_bytes_in_flight = 0
        self.shutdown_requested = trio.Event() if _in_trio() else None

    def resolve(self, target: Any) -> Callable[..., Any]:
        if not isinstance(target, str):
            raise ProtocolError(f"a call target that is not a name: {target!r:.80}")
        fn = self._targets.get(target)
        if fn is None:
            fn = self._targets[target] = self._import(target)
        return fn

    def _import(self, target: str) -> Callable[..., Any]:
        module_name, sep, qualname = target.partition(":")
        if not sep or not module_name or not qualname:
            raise ValueError(f"a call target is 'module:qualified.name', got {target!r}")
        if module_name == "__main__":
            mod = self._main()
        else:
            mod = importlib.import_module(module_name)
        obj: Any = mod
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not callable(obj):
            raise TypeError(f"{target} is not callable")
        return obj  # type: ignore[no-any-return]

    def _main(self) -> Any:
        """The caller's ``__main__`` module, loaded here under another name (as multiprocessing's spawn
        does, so its ``if __name__ == "__main__":`` block does not run)."""
        if self.main_module is not None:
            return self.main_module
        main = sys.modules.get("__main__")
        if self.main_name:  # it was run with -m: import it by name
            self.main_module = importlib.import_module(self.main_name)
        elif self.main_path and getattr(main, "__file__", None) != self.main_path:
            spec = importlib.util.spec_from_file_location("__asyncgrad_main__", self.main_path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load the caller's main module from {self.main_path}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules["__asyncgrad_main__"] = mod
            spec.loader.exec_module(mod)
            self.main_module = mod
        else:
            self.main_module = main
        return self.main_module

    def add_object(self, obj: Any) -> int:
        i = next(self._object_ids)
        self.objects[i] = obj
        return i

    def object(self, object_id: Any) -> Any:
        try:
            return self.objects[object_id]
        except (KeyError, TypeError):
            raise LookupError(
                f"no object {object_id!r} on {self.name}: its RRef was deleted, or it belongs to another worker"
            ) from None

    def statistics(self) -> _streams.RPCStatistics:
        conns = [p.conn for p in self.peers]
        return _streams.RPCStatistics(
            name=self.name,
            connections=len(conns),
            calls_sent=self.calls_sent,
            calls_in_flight=sum(len(p.pending) for p in self.peers),
            bytes_in_flight=self.bytes_in_flight,
            max_bytes_in_flight=self.max_bytes_in_flight,
            calls_served=self.calls_served,
            calls_serving=self.calls_serving,
            max_calls_serving=self.max_calls_serving,
            frames_sent=sum(c.frames_sent for c in conns) + self._closed_counts[0],
            frames_received=sum(c.frames_received for c in conns) + self._closed_counts[1],
            bytes_sent=sum(c.bytes_sent for c in conns) + self._closed_counts[2],
            bytes_received=sum(c.bytes_received for c in conns) + self._closed_counts[3],
            frames_rejected=self.frames_rejected,
            connections_refused=self.connections_refused,
            objects=len(self.objects),
            rpc_streams_taken=_streams.StreamCounters.taken,
            rpc_streams_in_use=_streams.StreamCounters.in_use,
            pool=_streams.pool_statistics(),
        )

    _closed_counts = (0, 0, 0, 0)

    def forget(self, peer: Peer) -> None:
        if peer in self.peers:
            self.peers.discard(peer)
            c = peer.conn
            a = self._closed_counts
            self._closed_counts = (
                a[0] + c.frames_sent, a[1] + c.frames_received, a[2] + c.bytes_sent, a[3] + c.bytes_received
            )


def _in_trio() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


_node: Node | None = None


def this_node() -> Node:
    """The process's node (named "parent" unless this process is a worker)."""
    global _node
    if _node is None:
        _node = Node("parent")
    return _node


def set_node(node: Node) -> None:
    global _node
    _node = node


def statistics() -> _streams.RPCStatistics:
    """The RPC layer's counters in this process, with the CPU stream pool's (when a runtime is open)."""
    return this_node().statistics()


def statistics_for_wire() -> dict[str, Any]:
    """(served) This process's statistics as plain data."""
    return _attrs_dict(statistics())  # type: ignore[no-any-return]


def _attrs_dict(obj: Any) -> Any:
    import attrs

    if attrs.has(type(obj)):
        return {a.name: _attrs_dict(getattr(obj, a.name)) for a in attrs.fields(type(obj))}
    return obj


def statistics_from_wire(d: dict[str, Any]) -> _streams.RPCStatistics:
    d = dict(d)
    pool = d.pop("pool", None)
    return _streams.RPCStatistics(**d, pool=DeviceStatistics(**pool) if pool is not None else None)


def _remember(cache: dict[Any, _V], fn: Any, value: _V) -> _V:
    """``value``, kept in the bounded per-function ``cache`` (4096 entries; unhashable ``fn``s are not)."""
    try:
        if len(cache) < 4096:
            cache[fn] = value
    except TypeError:  # unhashable
        pass
    return value


def target_of(fn: Any) -> str:
    """The name a function (or class) is sent by: ``module:qualified.name``. Never pickled."""
    try:
        return _target_names[fn]
    except (KeyError, TypeError):
        pass
    return _remember(_target_names, fn, _target_of(fn))


_target_names: dict[Any, str] = {}


def _target_of(fn: Any) -> str:
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"a function given by name is 'module:qualified.name', got {fn!r}")
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or not callable(fn):
        raise TypeError(
            f"a remote call needs a module-level function or class (sent by its qualified name), got {fn!r}"
        )
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"{module}.{qualname} is not defined at module level (a lambda or a nested function): the worker "
            "imports functions by their qualified name, so define it at the top level of a module"
        )
    return f"{module}:{qualname}"


# ---- the current served call (for streamed messages to the caller) -----------------------------------


class CallContext:
    """The call a task is serving: ``await notify(value)`` streams ``value`` to the caller as it happens."""

    __slots__ = ("_served", "call_id", "peer")

    def __init__(self, peer: Peer, call_id: int, served: _Served | None = None) -> None:
        self.peer = peer
        self.call_id = call_id
        self._served = served

    def drop_stream(self) -> None:
        """(a call about to wait, running no kernels) Give the call's pool stream back meanwhile: a device
        counts the streams taken as trainings sharing it, and a waiting call is none. Take one again with
        `fresh_stream` before queuing work."""
        served = self._served
        if served is not None and served.stream is not None:
            stream, served.stream = served.stream, None
            _streams.release(served.dev, stream)

    @contextlib.contextmanager
    def fresh_stream(self) -> Iterator[None]:
        """After `drop_stream`: a new pool stream of the call's device, current in the block and the one
        its response is staged from."""
        served = self._served
        if served is None or served.stream is not None or served.dev is None:
            yield
            return
        served.stream = _streams.acquire(served.dev)
        with use_stream(served.stream):
            yield

    async def notify(self, value: Any) -> None:
        enc = encode([NOTIFY, self.call_id, value], describe=[("the message", value)])
        held = _streams.stage(enc, respond=True, shm=self.peer.conn.fd_passing)
        await _streams.wait_staged(enc, held)
        self.peer.send(enc)


current_call: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("asyncgrad_rpc_call", default=None)


# ---- backpressure --------------------------------------------------------------------------------


class Budget:
    """Bytes of calls sent and not answered yet, at most ``limit`` (one call larger than that may go alone)."""

    def __init__(self, limit: int, node: Node) -> None:
        self.limit = limit
        self.used = 0
        self.max_used = 0
        self._node = node
        self._lot = trio.lowlevel.ParkingLot()

    def try_acquire(self, n: int) -> bool:
        if self.used and self.used + n > self.limit:
            return False
        self._take(n)
        return True

    async def acquire(self, n: int) -> None:
        while self.used and self.used + n > self.limit:
            await self._lot.park()
        self._take(n)

    def _take(self, n: int) -> None:
        self.used += n
        self.max_used = max(self.max_used, self.used)
        node = self._node
        node.bytes_in_flight += n
        node.max_bytes_in_flight = max(node.max_bytes_in_flight, node.bytes_in_flight)

    def release(self, n: int) -> None:
        self.used -= n
        self._node.bytes_in_flight -= n
        if self._lot:
            self._lot.unpark_all()


# ---- one end of a connection -------------------------------------------------------------------


class Pending:
    """An outgoing call waiting for its reply (the reader wakes its task directly: no Event per call)."""

    __slots__ = ("done", "error", "on_notify", "task", "value")

    def __init__(self, on_notify: Callable[[Any], None] | None) -> None:
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.on_notify = on_notify
        self.task: Any = None

    def set(self) -> None:
        self.done = True
        task, self.task = self.task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        if self.done:
            await trio.lowlevel.checkpoint()
            return
        self.task = trio.lowlevel.current_task()

        def abort(_: Any) -> Any:
            self.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class Outgoing:
    """A call packed and being staged, not sent yet."""

    __slots__ = ("call_id", "enc", "held", "what")

    def __init__(self, call_id: int, enc: Encoded, held: list[Any], what: str) -> None:
        self.call_id = call_id
        self.enc = enc
        self.held = held
        self.what = what


class Peer:
    """Our end of one connection: the calls we made on it and the calls we serve from it.

    ``name`` is the other end's name (for errors). ``on_lost`` decides the error pending calls get once
    the connection is gone (the exit code of a dead worker, say); until it has, new calls wait for it.
    """

    def __init__(
        self,
        conn: Connection,
        node: Node,
        name: str,
        *,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        accepts_shutdown: bool = False,
    ) -> None:
        self.conn = conn
        self.node = node
        self.name = name
        self.pending: dict[int, Pending] = {}
        self.serving: dict[int, trio.CancelScope] = {}
        self._ids = itertools.count(1)
        self.budget = Budget(max_inflight_bytes, node)
        self.accepts_shutdown = accepts_shutdown
        self.lost = trio.Event()  # the connection is gone
        self.death: BaseException | None = None  # what calls get from now on (set soon after `lost`)
        self._death_set = trio.Event()
        self._tasks: trio.Nursery | None = None
        self.device: Any = None
        node.peers.add(self)

    def __repr__(self) -> str:
        return f"<Peer {self.name} pending={len(self.pending)} serving={len(self.serving)}>"

    # ---- running ---------------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Read and dispatch frames until the connection ends; then cancel the calls served from it."""
        rt = _current_runtime()
        self.device = rt.cpu if rt is not None else None  # where served calls take their streams
        spin = _spin.spinner()
        fd, dev = self.conn.fileno(), self.device
        spin.watch(fd, dev)
        try:
            async with trio.open_nursery() as nursery:
                self._tasks = nursery
                nursery.start_soon(self.conn.sender)
                task_status.started()
                try:
                    await self._read_loop()
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            spin.unwatch(fd, dev)
            self.conn.close()
            self.lost.set()
            self.node.forget(self)

    async def _read_loop(self) -> None:
        conn = self.conn
        node = self.node
        streak = 0
        while True:
            waits = conn.waits
            try:
                meta, table, payload_len = await conn.recv_frame_head()
                bufs = read_table(table, payload_len, conn.take_fd if conn.fd_passing else None) if table else []
                for i in range(len(bufs)):
                    dest = bufs[i][0]
                    if dest is not None:  # in the byte stream (not a shared segment)
                        await conn.recv_into(memoryview(dest))  # type: ignore[arg-type]
                    dest = None
                problems = self._problems = []
                msg = decode(meta, [b[1] for b in bufs] if bufs else [], self._make_tensor, RRefMarker)
                try:
                    self._dispatch(msg, problems)
                except (ProtocolError, ConnectionClosed):
                    raise
                except Exception as e:  # a bug of ours must not end the process: drop this connection
                    log.exception("%s: an error handling a message from %s", node.name, conn.peer)
                    raise ProtocolError(f"an error handling a message: {type(e).__name__}: {e}") from e
                # let go of the frame now: its tensors must not outlive their users (a shared segment
                # returns to the pool when they die)
                del msg, bufs, meta, table
            except ConnectionClosed as e:
                self._closed_reason = e
                return
            except ProtocolError as e:
                node.frames_rejected += 1
                log.error("%s: closing the connection from %s: %s", node.name, conn.peer, e)
                return
            # frames that arrive back to back never wait on the socket: let other tasks run now and then
            if conn.waits == waits:
                streak += 1
                if streak >= 16:
                    streak = 0
                    await trio.lowlevel.checkpoint()
            else:
                streak = 0

    _closed_reason: BaseException | None = None
    _problems: list[str]

    def _make_tensor(self, arr: np.ndarray, requires_grad: bool) -> Any:
        return _make_tensor(arr, requires_grad, self._problems)

    def _dispatch(self, msg: Any, problems: list[str]) -> None:
        if not (isinstance(msg, list) and msg and type(msg[0]) is int):
            raise ProtocolError(f"a message that is not a [kind, ...] list: {msg!r:.80}")
        kind = msg[0]
        if kind in (RESULT, ERROR, CANCELLED, NOTIFY):
            if len(msg) != (2 if kind == CANCELLED else 3) or type(msg[1]) is not int:
                raise ProtocolError(f"a malformed reply {msg!r:.80}")
            p = self.pending.get(msg[1])
            if p is None or p.done:
                return  # a late reply to a call that was cancelled or timed out
            if kind == NOTIFY:
                if p.on_notify is not None:
                    p.on_notify(msg[2])
                return
            if problems:
                p.error = NoRuntimeError(problems[0])
            elif kind == RESULT:
                p.value = msg[2]
            elif kind == ERROR:
                p.error = error_from_wire(msg[2], self.name)
            else:
                p.error = RuntimeError(f"the call was cancelled on {self.name}")
            p.set()
        elif kind in (CALL, RCALL, NEW, FETCH, POST):
            self._serve(msg, problems)
        elif kind == CANCEL:
            if len(msg) != 2 or type(msg[1]) is not int:
                raise ProtocolError(f"a malformed cancel {msg!r:.80}")
            scope = self.serving.get(msg[1])
            if scope is not None:
                scope.cancel()
        elif kind == DELETE:
            if len(msg) != 2 or type(msg[1]) is not int:
                raise ProtocolError(f"a malformed delete {msg!r:.80}")
            self.node.objects.pop(msg[1], None)
        elif kind == SHUTDOWN:
            if self.accepts_shutdown and self.node.shutdown_requested is not None:
                self.node.shutdown_requested.set()
            else:
                log.warning("%s: ignoring a shutdown request from %s", self.node.name, self.conn.peer)
        else:
            raise ProtocolError(f"an unexpected message kind {kind}")

    # ---- serving ---------------------------------------------------------------------------------

    def _serve(self, msg: list[Any], problems: list[str]) -> None:
        """Serve a call. A plain function runs here, in the reader (it could not be cancelled anyway,
        and this saves a task); an async one, or whatever has to wait, goes on in a task of its own."""
        kind = msg[0]
        if len(msg) != _CALL_LEN[kind] or type(msg[1]) is not int:
            raise ProtocolError(f"a malformed call {msg!r:.80}")
        call_id = msg[1]
        if call_id in self.serving:
            raise ProtocolError(f"call number {call_id} is in use already")
        if kind != FETCH:
            args, kwargs = msg[-2], msg[-1]
            if type(args) is not list or type(kwargs) is not dict or (
                kwargs and not all(type(k) is str for k in kwargs)
            ):
                raise ProtocolError(f"a call whose arguments are not a list and a dict: {msg!r:.80}")
        call = _Served(self, msg)
        handed = False
        try:
            if problems:
                raise NoRuntimeError(problems[0])
            fn, args, kwargs = call.target()
            if fn is not None and _is_async(fn, self.node):
                handed = self._start(call, None, (fn, args, kwargs))
                return
            with call.context():
                value = call.object() if fn is None else fn(*args, **kwargs)
            del args, kwargs
            if inspect.isawaitable(value):
                handed = self._start(call, value)
                return
            if not call.reply:
                return
            enc, held = call.respond(value)
            del value
            if held or not all(enc.boxes):  # a tensor still being copied out: finish in a task
                handed = self._start(call, None, None, (enc, held))
                return
            if call.reply:
                self.send(enc)
        except ConnectionClosed:
            pass
        except trio.Cancelled:
            raise
        except BaseException as e:  # the function's error (or its result's) goes to the caller
            self._send_error(call, e)
        finally:
            if not handed:
                call.finish()

    def _start(
        self,
        call: _Served,
        awaitable: Any,
        invoke: tuple[Any, list[Any], dict[str, Any]] | None = None,
        staged: tuple[Encoded, list[Any]] | None = None,
    ) -> bool:
        assert self._tasks is not None
        scope = trio.CancelScope()
        self.serving[call.call_id] = scope
        self._tasks.start_soon(self._serve_task, call, scope, awaitable, invoke, staged)
        return True

    async def _serve_task(
        self,
        call: _Served,
        scope: trio.CancelScope,
        awaitable: Any,
        invoke: tuple[Any, list[Any], dict[str, Any]] | None,
        staged: tuple[Encoded, list[Any]] | None,
    ) -> None:
        call_id = call.call_id
        try:
            with scope:
                if staged is None:
                    with call.context():
                        if invoke is not None:
                            fn, args, kwargs = invoke
                            invoke = None
                            awaitable = fn(*args, **kwargs)
                            del args, kwargs
                        value = await awaitable
                        awaitable = None
                    if not call.reply:
                        return
                    enc, held = call.respond(value)
                    del value
                else:
                    enc, held = staged
                    staged = None
                await _streams.wait_staged(enc, held)
                if call.reply:
                    self.send(enc)
            if scope.cancelled_caught and call.reply:
                self._send_plain([CANCELLED, call_id])
        except trio.Cancelled:
            raise
        except ConnectionClosed:
            pass
        except BaseException as e:  # the function's error (or its result's) goes to the caller
            if isinstance(e, BaseExceptionGroup) and _only_cancelled(e) and scope.cancel_called:
                if call.reply:
                    self._send_plain([CANCELLED, call_id])
            else:
                self._send_error(call, e)
        finally:
            self.serving.pop(call_id, None)
            call.finish()

    def _send_error(self, call: _Served, e: BaseException) -> None:
        call_id = call.call_id
        if not call.reply:  # a post: nobody waits for an answer
            log.error("%s: a call posted by %s raised %s: %s", self.node.name, self.name, type(e).__name__, e)
            return
        try:
            info = error_to_wire(e, plain)
            self._send_plain([ERROR, call_id, info])
        except Exception as e2:  # the connection is gone, or the error did not pack
            if not isinstance(e2, ConnectionClosed):
                log.error("%s: could not report an error to %s: %s", self.node.name, self.name, e2)

    def _send_plain(self, msg: list[Any]) -> None:
        try:
            self.send(encode(msg))
        except ConnectionClosed:
            pass

    def send(self, enc: Encoded) -> None:
        parts, segments = enc.frame()
        self.conn.send_nowait(parts, segments)

    # ---- calling ---------------------------------------------------------------------------------

    def prepare(self, kind: int, head: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> Outgoing:
        """Pack a call and queue the copy-out of its tensors (at call time, so it sees the values queued so
        far and nothing queued later); raises TypeError for a value the wire cannot carry."""
        call_id = next(self._ids)
        if kind == FETCH:
            msg = [kind, call_id, *head]
        else:
            msg = [kind, call_id, *head, list(args), kwargs]
        enc = encode(msg, describe=[("args", args), ("kwargs", kwargs)])
        held = _streams.stage(enc, shm=self.conn.fd_passing)
        return Outgoing(call_id, enc, held, what)

    async def roundtrip(
        self, out: Outgoing, timeout: float | None, on_notify: Callable[[Any], None] | None = None
    ) -> Any:
        """Send a prepared call and wait for its reply; cancelling (or a timeout) cancels the remote task."""
        nbytes = out.enc.nbytes
        p: Pending | None = None
        acquired = False
        try:
            if self.death is not None or self.lost.is_set():
                await self._check_alive()
            if not self.budget.try_acquire(nbytes):
                await self.budget.acquire(nbytes)
            acquired = True
            if out.held or out.enc.tensors:
                await _streams.wait_staged(out.enc, out.held)
            if self.death is not None or self.lost.is_set():
                await self._check_alive()
            p = self.pending[out.call_id] = Pending(on_notify)
            try:
                self.send(out.enc)
            except ConnectionClosed:
                del self.pending[out.call_id]
                p = None
                await self._check_alive(wait=True)
                raise
            self.node.calls_sent += 1
            if timeout is None:
                await p.wait()
            else:
                with trio.move_on_after(timeout):
                    await p.wait()
                if not p.done:
                    self._cancel_remote(out.call_id)
                    raise TimeoutError(f"{out.what} on {self.name} did not answer within {timeout:g} s (cancelled)")
        except trio.Cancelled:
            if p is not None and not p.done:
                self._cancel_remote(out.call_id)
            raise
        finally:
            if acquired:
                self.budget.release(nbytes)
            if out.held:  # never staged (cancelled before): give the pool streams back
                for dev, stream in out.held:
                    _streams.release(dev, stream)
                out.held.clear()
            self.pending.pop(out.call_id, None)
        if p.error is not None:
            raise p.error
        return p.value

    def _cancel_remote(self, call_id: int) -> None:
        if not self.conn.closed:
            self._send_plain([CANCEL, call_id])

    async def _check_alive(self, wait: bool = False) -> None:
        if self.death is not None:
            raise copy.copy(self.death)  # a fresh one per call: tracebacks do not pile up on one object
        if self.lost.is_set() or wait:
            await self._death_set.wait()
            assert self.death is not None
            raise copy.copy(self.death)

    def fail(self, error: BaseException) -> None:
        """The connection is gone for good: pending calls (and later ones) raise ``error``."""
        if self.death is None:
            self.death = error
            self._death_set.set()
        for p in list(self.pending.values()):
            if not p.done:
                p.error = copy.copy(error)
                p.set()
        self.conn.close()


class _Served:
    """One call being served: it has a pool stream of its own, current while the function runs (its
    kernels queue there, nothing is synchronised); the response is staged from that stream, which goes
    back to the pool when the call ends (the pool hands it out again only once its work is done)."""

    __slots__ = ("call_id", "dev", "msg", "peer", "reply", "stream")

    def __init__(self, peer: Peer, msg: list[Any]) -> None:
        self.peer = peer
        self.msg = msg
        self.call_id: int = msg[1]
        self.reply = msg[0] != POST  # a post's outcome goes nowhere
        node = peer.node
        node.calls_serving += 1
        node.max_calls_serving = max(node.max_calls_serving, node.calls_serving)
        self.dev = dev = peer.device
        self.stream = _streams.acquire(dev) if dev is not None else None

    def target(self) -> tuple[Any, list[Any], dict[str, Any]]:
        """The function to call and its arguments (no function for a fetch)."""
        msg = self.msg
        kind = msg[0]
        node = self.peer.node
        if kind == FETCH:
            return None, [], {}
        args = msg[-2]
        kwargs = msg[-1]
        for a in args:  # RRefs passed to their owner arrive as the objects themselves
            if type(a) is RRefMarker:
                args = [_resolve(a, node) for a in args]
                break
        for v in kwargs.values():
            if type(v) is RRefMarker:
                kwargs = {k: _resolve(v, node) for k, v in kwargs.items()}
                break
        if kind == RCALL:
            if not isinstance(msg[3], str):
                raise TypeError(f"a method name must be a str, got {msg[3]!r}")
            return getattr(node.object(msg[2]), msg[3]), args, kwargs
        return node.resolve(msg[2]), args, kwargs

    def object(self) -> Any:
        return self.peer.node.object(self.msg[2])

    def context(self) -> _CallScope:
        """The block the function runs in: this call current (`current_call`), and its stream."""
        return _CallScope(self)

    def respond(self, value: Any) -> tuple[Encoded, list[Any]]:
        """The response packed, its tensors' copy-out queued on the call's stream (inline when small)."""
        if self.msg[0] == NEW:
            value = self.peer.node.add_object(value)
        enc = encode([RESULT, self.call_id, value], describe=[("the result", value)])
        self.msg = None  # type: ignore[assignment]  # the arguments may go now
        if not enc.tensors:  # plain values and small ready ones, packed already: nothing to stage
            return enc, []
        if self.stream is not None:
            with use_stream(self.stream):
                held = _streams.stage(enc, respond=True, shm=self.peer.conn.fd_passing)
        else:
            held = _streams.stage(enc, respond=True, shm=self.peer.conn.fd_passing)
        return enc, held

    def finish(self) -> None:
        node = self.peer.node
        node.calls_serving -= 1
        node.calls_served += 1
        self.msg = None  # type: ignore[assignment]
        if self.stream is not None:
            stream, self.stream = self.stream, None
            _streams.release(self.dev, stream)


class _CallScope:
    __slots__ = ("_call", "_token", "_use")

    def __init__(self, call: _Served) -> None:
        self._call = call

    def __enter__(self) -> None:
        call = self._call
        self._token = current_call.set(CallContext(call.peer, call.call_id, call))
        self._use = use_stream(call.stream) if call.stream is not None else None
        if self._use is not None:
            self._use.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._use is not None:
            self._use.__exit__()
        current_call.reset(self._token)


def _is_async(fn: Any, node: Node) -> bool:
    cache = node.is_async
    try:
        return cache[fn]
    except (KeyError, TypeError):
        pass
    flag = inspect.iscoroutinefunction(fn) or (
        not inspect.isroutine(fn) and not isinstance(fn, type) and inspect.iscoroutinefunction(type(fn).__call__)
    )
    return _remember(cache, fn, flag)


def _only_cancelled(eg: BaseExceptionGroup) -> bool:
    return all(
        isinstance(e, trio.Cancelled) or (isinstance(e, BaseExceptionGroup) and _only_cancelled(e))
        for e in eg.exceptions
    )


def _resolve(value: Any, node: Node) -> Any:
    if isinstance(value, RRefMarker):
        if value.owner != node.name:
            raise LookupError(
                f"an RRef to an object on {value.owner} was passed to {node.name}; pass it to its owner"
            )
        return node.object(value.object_id)
    return value


def _current_runtime() -> Any:
    try:
        return current_runtime("serving a call")
    except NoRuntimeError:
        return None


def _make_tensor(arr: np.ndarray, requires_grad: bool, problems: list[str]) -> Any:
    try:
        t = from_numpy(arr)
    except NoRuntimeError:
        problems.append(
            "a tensor arrived where no asyncgrad runtime is open: open one (`async with ag.open_runtime():` "
            "or `ag.run(main)`) around the code that calls workers"
        )
        return arr
    if requires_grad:
        t.requires_grad_(True)
    return t



# ---- accepting connections -----------------------------------------------------------------------


async def read_message(conn: Connection, timeout: float) -> Any:
    """One frame of plain values (no tensors): the messages that set a connection up."""
    with trio.fail_after(timeout):
        meta, table, payload_len = await conn.recv_frame_head()
    if table or payload_len:
        raise ProtocolError("a set-up message with tensors in it")
    msg = decode(meta, [], lambda arr, rg: arr)
    if not (isinstance(msg, list) and msg and type(msg[0]) is int):
        raise ProtocolError(f"a set-up message that is not a [kind, ...] list: {msg!r:.80}")
    return msg


def send_message(conn: Connection, msg: list[Any]) -> None:
    parts, _ = encode(msg).frame()
    conn.send_nowait(parts)


async def serve_connections(
    listener: Any,
    secret: bytes,
    node: Node,
    *,
    limits: dict[str, int],
    on_join: Callable[[Connection, dict[str, Any]], Any] | None = None,
    closing: Callable[[], bool] | None = None,
) -> None:
    """Accept connections for as long as this runs: each must prove the secret, then say who it is: a
    worker joining (handled by ``on_join``, the parent only) or a peer whose calls we serve.

    ``closing`` (the parent's): while it returns True, a connection that breaks before it introduced
    itself is no news (the workers still starting were stopped) and is logged at debug level only."""
    async with trio.open_nursery() as nursery:
        while True:
            try:
                sock, addr = await listener.accept()
            except ConnectionClosed:  # the listener closed: we are shutting down
                nursery.cancel_scope.cancel()
                return
            conn = Connection(
                sock, addr, max_meta_bytes=limits["max_meta_bytes"], max_frame_bytes=limits["max_frame_bytes"]
            )
            nursery.start_soon(_handle_connection, conn, secret, node, limits, on_join, closing)


async def _handle_connection(
    conn: Connection,
    secret: bytes,
    node: Node,
    limits: dict[str, int],
    on_join: Callable[[Connection, dict[str, Any]], Any] | None,
    closing: Callable[[], bool] | None = None,
) -> None:
    try:
        await server_handshake(conn, secret)
    except (AuthenticationError, ConnectionClosed, trio.TooSlowError) as e:
        node.connections_refused += 1
        quiet = isinstance(e, ConnectionClosed) and closing is not None and closing()
        level = logging.DEBUG if quiet else logging.WARNING
        log.log(level, "%s: refused a connection from %s: %s", node.name, conn.peer, e)
        conn.close()
        return
    try:
        msg = await read_message(conn, 10.0)
        info = msg[1] if len(msg) == 2 and isinstance(msg[1], dict) else None
        if info is None or msg[0] not in (JOIN, PEER) or (msg[0] == JOIN and on_join is None):
            raise ProtocolError(f"a connection that did not introduce itself: {msg!r:.80}")
    except (ProtocolError, ConnectionClosed, trio.TooSlowError) as e:
        node.frames_rejected += 1
        quiet = isinstance(e, ConnectionClosed) and closing is not None and closing()
        level = logging.DEBUG if quiet else logging.ERROR
        log.log(level, "%s: closing the connection from %s: %s", node.name, conn.peer, e)
        conn.close()
        return
    if msg[0] == JOIN:
        assert on_join is not None
        await on_join(conn, info)
        return
    name = info.get("name")
    peer = Peer(
        conn, node, name if isinstance(name, str) else conn.peer, max_inflight_bytes=limits["max_inflight_bytes"]
    )
    await peer.run()
    peer.fail(ConnectionClosed(f"the connection to {peer.name} closed"))


async def drive_call(peer: Peer, out: Outgoing, timeout: float | None, fut: Future, scope: trio.CancelScope) -> None:
    """Run the call ``out`` on ``peer`` for ``fut`` (a `Future`'s task): its result or error lands in ``fut``.

    ``scope`` is the one `Future.cancel` cancels (`CallCancelled`); a call still running when its nursery closes
    fails with `WorkersClosed`.
    """
    try:
        with scope:
            fut._set_result(await peer.roundtrip(out, timeout))
            return
        fut._set_error(CallCancelled(f"{out.what} on {peer.name} was cancelled"))
    except trio.Cancelled:
        fut._set_error(WorkersClosed(f"the workers closed before {out.what} on {peer.name} completed"))
        raise
    except BaseException as e:
        fut._set_error(e)
