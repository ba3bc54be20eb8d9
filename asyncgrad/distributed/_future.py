"""`Future`: the result of `Worker.call_nowait`, stream-aware as TensorPipe's CUDA futures are.

``await fut`` waits for the reply, makes the caller's current stream wait on the future's event and
returns without synchronising: the kernels that produce the values may still be running (`done()` can be
True before the values are ready, as in PyTorch). ``await fut.wait(sync=True)`` also waits for the values.
``fut.then(cb)`` runs ``cb(fut)`` (plain or async) with a pool stream current; the future it returns
completes with ``cb``'s result, its event recorded on that stream after ``cb``'s kernels.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from typing import Any

import trio

from ..devices import Event, Stream
from ..runtime import current_runtime, current_stream, use_stream
from . import _streams


class Future:
    """A value that a remote call (or a callback on one) will produce. Awaitable."""

    def __init__(self, nursery: trio.Nursery | None, what: str = "a call") -> None:
        self._nursery = nursery
        self._what = what
        self._done = trio.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        # (stream, seq, event): the values are ready once each stream completed its work up to seq
        self._marks: list[tuple[Stream, int, Event]] = []
        self._cancel: Callable[[], None] | None = None

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error is not None else "done")
        return f"<Future of {self._what}: {state}>"

    # ---- completing (internal) ---------------------------------------------------------------------

    def _set_result(self, value: Any, marks: list[tuple[Stream, int, Event]] | None = None) -> None:
        if self._done.is_set():
            return
        self._value = value
        if marks:
            self._marks = marks
        self._done.set()

    def _set_error(self, error: BaseException) -> None:
        if self._done.is_set():
            return
        self._error = error
        self._done.set()

    # ---- the public face ---------------------------------------------------------------------------

    def done(self) -> bool:
        """True once the result (or error) is here; its tensors' kernels may still be running."""
        return self._done.is_set()

    def value(self) -> Any:
        """The result now (raises the call's error); the future must be done."""
        if not self._done.is_set():
            raise RuntimeError(f"{self!r} is not done yet: await it first")
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self) -> BaseException | None:
        """The call's error (None if it succeeded); the future must be done."""
        if not self._done.is_set():
            raise RuntimeError(f"{self!r} is not done yet: await it first")
        return self._error

    def cancel(self) -> None:
        """Cancel the call (the remote task sees `trio.Cancelled`); awaiting the future then raises."""
        if not self._done.is_set() and self._cancel is not None:
            self._cancel()

    def __await__(self) -> Generator[Any, None, Any]:
        return self.wait(sync=False).__await__()

    async def wait(self, sync: bool = True) -> Any:
        """Wait for the result. The caller's current stream waits on the future's event (later work on it
        runs after the values); with ``sync`` (the default here, as for beginners in PyTorch) this also
        waits until the values are computed. ``await fut`` is ``await fut.wait(sync=False)``."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if self._marks:
            for stream, _seq, event in self._marks:
                current_stream(stream.device).wait_event(event)
            if sync:
                for stream, seq, _event in self._marks:
                    await stream.synchronize(seq)
        return self._value

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A future of ``callback(self)``, run once this one is done, with a pool stream current (its
        kernels queue there, after this future's event; the new future's event follows them)."""
        if self._nursery is None:
            raise RuntimeError("then() needs a future made by call_nowait")
        nxt = Future(self._nursery, f"then({getattr(callback, '__name__', 'callback')})")
        self._nursery.start_soon(_run_then, self, callback, nxt)
        return nxt


async def _run_then(src: Future, callback: Callable[[Future], Any], nxt: Future) -> None:
    await src._done.wait()
    dev = current_runtime("Future.then").cpu
    stream = _streams.acquire(dev)
    try:
        with use_stream(stream):
            for s, _seq, event in src._marks:
                if s is not stream:
                    stream.wait_event(event)
            value = callback(src)
            if inspect.isawaitable(value):
                value = await value
            seq = stream.statistics().submitted
            event = stream.record_event()
        nxt._set_result(value, [(stream, seq, event)])
    except trio.Cancelled:
        nxt._set_error(RuntimeError("the callback was cancelled (its workers closed)"))
        raise
    except BaseException as e:
        nxt._set_error(e)
    finally:
        _streams.release(dev, stream)
