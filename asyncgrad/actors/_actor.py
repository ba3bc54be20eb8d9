"""The `Actor` base class: a trio task that owns a mailbox and serves it one message at a time."""

from __future__ import annotations

import inspect
import math
from typing import Any

import attrs
import trio

from ._record import read_record


class ActorClosedError(Exception):
    """Raised when sending to, or calling, an actor that no longer accepts messages.

    If the actor crashed, ``__cause__`` is the exception that crashed it.
    """


@attrs.frozen
class ActorStatistics:
    """A snapshot of an actor's counters, as returned by `Actor.statistics`.

    Attributes:
        name: The actor's name.
        messages_received: Messages accepted into the mailbox (sends and calls).
        messages_handled: Messages whose handler finished, by returning or by raising to a caller.
        calls: How many of ``messages_received`` were `Actor.call` requests.
        pending: Messages in the mailbox (or blocked waiting for room in it) not yet taken by the actor.
        closed: True once the actor accepts no more messages (closed, crashed or cancelled).
        crashed: True if a handler error ended the actor's run loop.
        max_pending_seen: The highest ``pending`` has ever been.
    """

    name: str
    messages_received: int
    messages_handled: int
    calls: int
    pending: int
    closed: bool
    crashed: bool
    max_pending_seen: int


class _Reply:
    """The slot a `call` waits on; the actor fills in ``value`` or ``error`` and sets ``event``."""

    __slots__ = ("error", "event", "value")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class Actor:
    """Base class for an actor: a mailbox, private state, and a loop that serves messages in order.

    Subclasses override `handle`, as a plain method or an ``async def``. Start the actor with
    ``await nursery.start(actor.run)``. Because one task handles every message, the actor's state
    needs no locks; an async handler that awaits does hold up the messages behind it.

    Supervision is loud: if the handler raises for a fire-and-forget message, the exception leaves
    `run` and so fails the nursery the actor runs in. Callers still waiting, and later ones, get
    `ActorClosedError` chained from that exception.

    Args:
        name: Used in error messages and statistics.
        capacity: Mailbox size; ``math.inf`` (the default) never blocks senders, ``0`` makes each
            sender wait for the actor to take its message.
    """

    def __init__(self, name: str, *, capacity: float = math.inf) -> None:
        self.name = name
        self._send, self._receive = trio.open_memory_channel[tuple[Any, _Reply | None]](capacity)
        # Decided once here, so the run loop pays no inspection cost per message.
        self._handle_is_async = inspect.iscoroutinefunction(self.handle)
        self._task: trio.lowlevel.Task | None = None
        self._started = False
        self._closed = False
        self._busy = False  # a message is being handled right now
        self._cancelled = False
        self._crash: BaseException | None = None
        self._received = self._taken = self._handled = self._calls = self._max_pending = 0  # counters

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def handle(self, msg: Any) -> Any:
        """Handle one message; override in subclasses (plain or ``async def``).

        Args:
            msg: The message, as passed to `call`, `send` or `send_nowait`.

        Returns:
            The reply to `call`; ignored for fire-and-forget messages.
        """
        raise NotImplementedError(f"{type(self).__name__} must override handle()")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the mailbox until `close` was called and it is drained, or until cancelled.

        Raises:
            RuntimeError: If this actor's `run` was already started.
            Exception: Whatever a handler raised for a fire-and-forget message.
        """
        if self._started:
            raise RuntimeError(f"actor {self.name!r} was already started")
        self._started = True
        self._task = trio.lowlevel.current_task()
        task_status.started()
        reply: _Reply | None = None
        try:
            # receive() checkpoints per message, so even sync handlers let other tasks run.
            async for msg, reply in self._receive:
                self._taken += 1
                self._busy = True
                try:
                    if self._handle_is_async:
                        result = await self.handle(msg)
                    else:
                        result = self.handle(msg)
                except Exception as exc:
                    if reply is None:
                        raise  # nobody is waiting for this error: fail the nursery, never swallow it
                    reply.error = exc
                else:
                    if reply is not None:
                        reply.value = result
                self._busy = False
                self._handled += 1
                if reply is not None:
                    reply.event.set()
                    reply = None
        except trio.Cancelled:
            self._cancelled = True
            raise
        except BaseException as exc:
            self._crash = exc
            raise
        finally:
            self._shut_down(reply)

    async def call(self, msg: Any) -> Any:
        """Send ``msg`` and wait for the handler's return value.

        If the caller is cancelled while waiting, the message is still handled; the reply is dropped.

        Returns:
            What the handler returned.

        Raises:
            ActorClosedError: If the actor is closed, or stops before answering.
            RuntimeError: If called from the actor's own task, which could only deadlock.
            Exception: Whatever the handler raised for this message.
        """
        if self._task is not None and trio.lowlevel.current_task() is self._task:
            raise RuntimeError(f"actor {self.name!r} cannot call itself (it would deadlock)")
        reply = _Reply()
        item = (msg, reply)
        try:
            self._put_nowait(item)  # fast path: no scheduling when there is room
        except trio.WouldBlock:
            await self._put(item)
        await reply.event.wait()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def call_nowait(self, msg: Any) -> Any:
        """Handle ``msg`` at once in the calling task if the actor is idle; else raise `trio.WouldBlock`.

        "Idle" means running, nothing queued and no message in progress, with a plain (sync) handler:
        then handling it here is exactly what the actor would do next, in the same order, and saves two
        task switches. Errors raised by the handler propagate to the caller, as with `call`.
        """
        if (
            self._handle_is_async
            or self._closed
            or not self._started
            or self._busy
            or self._received != self._taken
        ):
            raise trio.WouldBlock
        self._received += 1
        self._taken += 1
        self._calls += 1
        self._busy = True
        try:
            return self.handle(msg)
        finally:
            self._busy = False
            self._handled += 1

    @property
    def idle(self) -> bool:
        """True if `call_nowait` would handle a message right now, in the calling task (same test)."""
        return not (
            self._handle_is_async
            or self._closed
            or not self._started
            or self._busy
            or self._received != self._taken
        )

    def send_nowait(self, msg: Any) -> None:
        """Queue a fire-and-forget message without waiting.

        Raises:
            trio.WouldBlock: If a bounded mailbox is full.
            ActorClosedError: If the actor is closed.
        """
        self._put_nowait((msg, None))

    async def send(self, msg: Any) -> None:
        """Queue a fire-and-forget message, waiting for room in a bounded mailbox.

        Raises:
            ActorClosedError: If the actor is closed, or closes while we wait.
        """
        await self._put((msg, None))

    def close(self) -> None:
        """Stop accepting messages; `run` handles what is already queued, then returns."""
        self._closed = True
        self._send.close()  # also wakes senders blocked on a full mailbox, with ActorClosedError

    @property
    def closed(self) -> bool:
        """True once the actor accepts no more messages (closed, crashed or cancelled)."""
        return self._closed

    def statistics(self) -> ActorStatistics:
        """Return a snapshot of this actor's counters."""
        return read_record(
            ActorStatistics, self, name=self.name, messages_received=self._received,
            messages_handled=self._handled, pending=self._received - self._taken, crashed=self._crash is not None,
            max_pending_seen=self._max_pending,
        )

    # -- internals ------------------------------------------------------------------------------

    def _count_in(self, item: tuple[Any, _Reply | None]) -> None:
        self._received += 1
        if item[1] is not None:
            self._calls += 1
        self._max_pending = max(self._max_pending, self._received - self._taken)

    def _put_nowait(self, item: tuple[Any, _Reply | None]) -> None:
        try:
            self._send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise self._closed_error()  # noqa: B904 (_closed_error sets the cause)
        self._count_in(item)

    async def _put(self, item: tuple[Any, _Reply | None]) -> None:
        # Count before waiting: once room frees up the actor may take the item before we resume,
        # and pending must never go negative.
        self._count_in(item)
        try:
            await self._send.send(item)
        except BaseException as exc:
            # A memory channel send that raises did not deliver, so take the count back.
            self._received -= 1
            if item[1] is not None:
                self._calls -= 1
            if isinstance(exc, (trio.ClosedResourceError, trio.BrokenResourceError)):
                raise self._closed_error()  # noqa: B904 (_closed_error sets the cause)
            raise

    def _closed_error(self) -> ActorClosedError:
        if self._crash is not None:
            why = f"crashed with {self._crash!r}"
        elif self._cancelled:
            why = "stopped because its run() was cancelled"
        else:
            why = "is closed"
        err = ActorClosedError(f"actor {self.name!r} {why}")
        # Chain to the crash here, and hide the trio channel error it is raised from: raise sites
        # must then use a bare `raise err`, since `raise err from None` would clear the cause.
        err.__cause__ = self._crash
        err.__suppress_context__ = True
        return err

    def _shut_down(self, current: _Reply | None) -> None:
        """Refuse new messages and fail every caller that will now never get an answer."""
        self._closed = True
        self._send.close()
        if current is not None and not current.event.is_set():
            current.error = self._closed_error()
            current.event.set()
        while True:
            try:
                _msg, reply = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            self._taken += 1
            if reply is not None:
                reply.error = self._closed_error()
                reply.event.set()
        self._receive.close()
        self._task = None
