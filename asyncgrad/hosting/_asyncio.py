"""Use asyncgrad from an asyncio program: trio in guest mode on the running asyncio loop, behind a portal.

Trio's guest mode (`trio.lowlevel.start_guest_run`) runs a whole trio run as callbacks on a host loop. The
portal starts such a run on the running asyncio loop, opens an asyncgrad runtime inside it, and lets
asyncio code run trio functions in that runtime with ``await portal.run(fn, *args)``.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import outcome
import trio

from ..runtime import Runtime, open_runtime

T = TypeVar("T")

# asyncio loops that host a portal right now: trio allows one guest run per host loop (per thread, in fact:
# trio's run state is thread-local), so a second portal on the same loop gets a clear error instead.
_hosting_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_hosting_lock = threading.Lock()  # taken only when a portal opens or closes


class PortalClosedError(RuntimeError):
    """`AsyncioPortal.run` was called on a portal that is not (or no longer) open."""


class _Call:
    """One `AsyncioPortal.run` call: what to run, its trio cancel scope, and the future asyncio awaits.

    Every field is touched on the host loop's thread only (guest-mode trio runs there too), so no lock.
    """

    __slots__ = ("args", "cancel_requested", "done", "fn", "scope")

    def __init__(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], done: asyncio.Future[Any]):
        self.fn = fn
        self.args = args
        self.done = done
        self.scope: trio.CancelScope | None = None
        self.cancel_requested = False

    # -- called on the trio side (from a run_sync_soon callback or a trio task) --

    def cancel(self) -> None:
        self.cancel_requested = True
        if self.scope is not None:
            self.scope.cancel()

    def finish(self, result: outcome.Outcome[Any] | None) -> None:
        """Resolve the asyncio future; ``None`` means "cancelled on the trio side". Never raises."""
        if self.done.done():
            return
        if result is None:
            self.done.set_exception(_TrioCancelled())
        elif isinstance(result, outcome.Error):
            try:
                self.done.set_exception(result.error)
            except TypeError:  # asyncio refuses some exceptions (StopIteration): wrap them
                wrapped = RuntimeError(f"the trio task raised {type(result.error).__name__}")
                wrapped.__cause__ = result.error
                self.done.set_exception(wrapped)
        else:
            self.done.set_result(result.unwrap())


class _TrioCancelled(Exception):
    """Marker carried through the asyncio future: the trio task ended with `trio.Cancelled`."""


class AsyncioPortal:
    """A handle on a trio guest run (with an open asyncgrad runtime) living on an asyncio loop.

    Get one from `open_asyncio_portal`; see there for the semantics and the limits.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._token: trio.lowlevel.TrioToken | None = None
        self._send: trio.MemorySendChannel[_Call] | None = None
        self._runtime: Runtime | None = None
        self._closed = False
        self._calls_started = 0
        self._calls_active = 0
        self._pending: set[_Call] = set()  # calls whose future is not resolved yet

    @property
    def runtime(self) -> Runtime:
        """The asyncgrad runtime open inside the guest run (read its `statistics()` or `threads()`)."""
        if self._runtime is None:
            raise PortalClosedError("the portal is not open")
        return self._runtime

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> dict[str, int]:
        """How many calls were started through this portal and how many are running now."""
        return {"calls_started": self._calls_started, "calls_active": self._calls_active}

    async def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await async_fn(*args)`` as a trio task inside the runtime; return its result.

        Call this from asyncio code on the loop that hosts the portal. An exception raised by
        ``async_fn`` is raised here. Cancelling the asyncio task that awaits this call cancels the trio
        task (through its own cancel scope) and waits for it to finish before `asyncio.CancelledError`
        is raised here; a trio task that ends with `trio.Cancelled` for any other reason (for example the
        portal shutting down) also surfaces here as `asyncio.CancelledError`.

        Raises:
            PortalClosedError: The portal is not open (not started yet, or shutting down).
        """
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(
                "AsyncioPortal.run must be awaited on the asyncio loop that hosts the portal; from another "
                "thread or loop use asyncio.run_coroutine_threadsafe(portal.run(...), portal_loop)"
            )
        if self._closed or self._token is None or self._send is None:
            raise PortalClosedError("the asyncgrad portal is closed: open one with open_asyncio_portal()")
        done: asyncio.Future[Any] = self._loop.create_future()
        call = _Call(async_fn, args, done)
        self._pending.add(call)
        done.add_done_callback(lambda _: self._pending.discard(call))
        send = self._send

        def submit() -> None:  # runs on the trio side (run_sync_soon callback)
            try:
                send.send_nowait(call)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                call.finish(
                    outcome.Error(PortalClosedError("the asyncgrad portal closed before the call ran"))
                )

        try:
            self._token.run_sync_soon(submit)
        except trio.RunFinishedError:
            raise PortalClosedError("the asyncgrad portal's trio run has finished") from None
        try:
            # shield: cancelling the awaiting task must not cancel `done` itself (trio resolves it)
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # the asyncio side was cancelled: cancel the trio task and wait until it has really stopped
            if not done.done():
                try:
                    self._token.run_sync_soon(call.cancel)
                except trio.RunFinishedError:  # pragma: no cover - the run ended meanwhile; done is set
                    pass
                await _wait_ignoring_cancel(done)
            # an error the trio task raised while stopping is more useful than a bare CancelledError
            if not done.cancelled() and isinstance(done.exception(), BaseException):
                exc = done.exception()
                if exc is not None and not isinstance(exc, _TrioCancelled):
                    raise exc from None
            raise
        except _TrioCancelled:
            raise asyncio.CancelledError("the trio task was cancelled on the trio side") from None


async def _wait_ignoring_cancel(fut: asyncio.Future[Any]) -> None:
    """Wait for ``fut`` (resolved by trio) even if cancelled again meanwhile; cancellation is structured."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except BaseException:
            break
    if fut.done() and not fut.cancelled():
        fut.exception()  # mark retrieved: the caller raises CancelledError instead of this outcome


async def _run_call(portal: AsyncioPortal, call: _Call) -> None:
    """The trio task behind one `AsyncioPortal.run` call."""
    portal._calls_started += 1
    portal._calls_active += 1
    result: outcome.Outcome[Any] | None = None
    try:
        with trio.CancelScope() as scope:
            call.scope = scope
            if call.cancel_requested:
                scope.cancel()
            try:
                result = outcome.Value(await call.fn(*call.args))
            except BaseException as exc:
                if _only_cancelled(exc):
                    raise  # leaves the task via the scope (ours) or the portal nursery (shutdown)
                # a failing call belongs to its caller, never to the portal: keep the nursery alive
                result = outcome.Error(exc)
    finally:
        portal._calls_active -= 1
        call.scope = None
        call.finish(result)


def _only_cancelled(exc: BaseException) -> bool:
    """True for `trio.Cancelled`, or an exception group (from a nursery) holding nothing else."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return False


@asynccontextmanager
async def open_asyncio_portal(**runtime_options: Any) -> AsyncIterator[AsyncioPortal]:
    """Host trio and an asyncgrad runtime on the running asyncio loop; yield a portal into it.

    ::

        async with asyncgrad.hosting.open_asyncio_portal(lanes=2) as portal:
            loss = await portal.run(train_one_epoch, model, batch)   # a trio function, run in the runtime

    Start-up starts a trio guest run on the running asyncio loop (`trio.lowlevel.start_guest_run`),
    opens `asyncgrad.open_runtime(**runtime_options)` inside it, and returns once the runtime is open.
    ``await portal.run(async_fn, *args)`` runs ``async_fn`` as a trio task inside that runtime and returns
    its result or raises its exception. Cancellation goes both ways: cancelling the awaiting asyncio
    task (``task.cancel()``, `asyncio.wait_for`, `asyncio.timeout`) cancels the trio task and waits for it
    to stop; a trio task cancelled on the trio side raises `asyncio.CancelledError` in its caller.

    Shutdown (leaving the ``async with``) cancels every outstanding portal call (their callers get
    `asyncio.CancelledError`), closes the runtime (its worker threads are joined) and waits for the
    guest run to finish; an error of the trio run itself is raised here. To tie the runtime to an ASGI
    app's lifetime, enter the portal in the app's lifespan handler::

        @contextlib.asynccontextmanager
        async def lifespan(app):
            async with asyncgrad.hosting.open_asyncio_portal() as portal:
                app.state.portal = portal
                yield

    Limits:
        - One guest run per asyncio loop (trio keeps its run state per thread): a second portal on the
          same loop, or `trio.run` in that thread while the portal is open, raises `RuntimeError`. Share
          one portal; it takes any number of concurrent `run` calls.
        - Trio code runs as callbacks on the asyncio loop, so a trio checkpoint costs about 3x more
          than under `trio.run`, and trio and asyncio code take turns on the same thread.
        - Blocking calls block the asyncio loop too: ``t.numpy()``, ``t.item()``, ``float(t)`` and
          ``print(t)`` wait for the value on the calling thread. Inside trio code, ``await t.ready()``
          first; return plain numbers/arrays from the trio function rather than pending tensors.
        - asyncgrad ops need a trio task: call them inside functions passed to `run`, not directly in
          asyncio code (tensors created there have no runtime to find).
        - Keep the asyncio loop running until the ``async with`` is left: stopping the host loop with a
          guest run still inside it leaves trio in an inconsistent state.
        - A trio function that shields itself from cancellation delays cancellation and shutdown by as
          long as it shields.
    """
    loop = asyncio.get_running_loop()
    with _hosting_lock:
        if loop in _hosting_loops:
            raise RuntimeError(
                "this asyncio loop already hosts an asyncgrad portal (one trio guest run per loop); "
                "share that portal instead of opening a second one"
            )
        _hosting_loops.add(loop)
    try:
        async with _guest_run(loop, runtime_options) as portal:
            yield portal
    finally:
        with _hosting_lock:
            _hosting_loops.discard(loop)


@asynccontextmanager
async def _guest_run(
    loop: asyncio.AbstractEventLoop, runtime_options: dict[str, Any]
) -> AsyncIterator[AsyncioPortal]:
    portal = AsyncioPortal(loop)
    started: asyncio.Future[None] = loop.create_future()
    finished: asyncio.Future[outcome.Outcome[None]] = loop.create_future()
    stop_scope = trio.CancelScope()

    async def trio_main() -> None:
        send, receive = trio.open_memory_channel[_Call](float("inf"))
        try:
            with stop_scope:
                async with open_runtime(**runtime_options) as rt:
                    async with trio.open_nursery() as nursery:
                        portal._runtime = rt
                        portal._send = send
                        if not started.done():
                            started.set_result(None)
                        # spawn from this task (not from the run_sync_soon callback) so every call
                        # inherits this task's context, where the runtime is published
                        async for call in receive:
                            nursery.start_soon(
                                _run_call, portal, call, name=getattr(call.fn, "__name__", None)
                            )
        finally:
            portal._closed = True
            portal._runtime = None
            send.close()
            while True:  # calls submitted but never started: tell their callers
                try:
                    call = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                call.finish(None)
            receive.close()

    def done_callback(result: outcome.Outcome[None]) -> None:
        portal._closed = True
        for call in list(portal._pending):  # trio resolves every call before it ends; never leave one hanging
            call.finish(None)
        if not finished.done():
            finished.set_result(result)
        if not started.done():
            # the run ended before the runtime opened: hand its error (or a clear one) to start-up
            if isinstance(result, outcome.Error):
                started.set_exception(result.error)
            else:
                started.set_exception(RuntimeError("the trio guest run ended before the runtime opened"))
            started.exception()  # retrieved here; raised from `finished` if nobody awaits `started`

    trio.lowlevel.start_guest_run(
        trio_main,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        run_sync_soon_not_threadsafe=loop.call_soon,
        done_callback=done_callback,
        # asyncio owns signal.set_wakeup_fd (add_signal_handler); trio must not take it over
        host_uses_signal_set_wakeup_fd=True,
    )
    portal._token = trio.lowlevel.current_trio_token()  # valid once start_guest_run returned

    def request_stop() -> None:
        portal._closed = True
        try:
            portal._token.run_sync_soon(stop_scope.cancel)  # type: ignore[union-attr]
        except trio.RunFinishedError:
            pass

    try:
        await asyncio.shield(started)
    except BaseException:
        # start-up failed or the opener was cancelled: stop the run and wait for it before leaving
        request_stop()
        await _wait_ignoring_cancel(finished)
        raise
    body_error: BaseException | None = None
    try:
        yield portal
    except BaseException as exc:
        body_error = exc
        raise
    finally:
        request_stop()
        await _wait_ignoring_cancel(finished)
        result = finished.result()
        if isinstance(result, outcome.Error) and body_error is None:
            result.unwrap()
