"""The errors a remote call can raise, and how an exception crosses the wire (as text, never pickled)."""

from __future__ import annotations

import builtins
import traceback
from typing import Any


class RemoteError(Exception):
    """An exception raised by the remote function, of a type that is not a builtin one.

    ``str()`` is the remote message; `type_name` is the remote type's qualified name
    (``"mypkg.mod.MyError"``) and `remote_traceback` the remote traceback as text.
    """

    def __init__(self, type_name: str, message: str, remote_traceback: str = "", worker: str | None = None) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback
        self.worker = worker
        if remote_traceback:
            self.add_note(f"remote traceback ({worker or 'remote'}):\n{remote_traceback.rstrip()}")

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}" if self.message else self.type_name

    def __reduce__(self) -> Any:
        return (type(self), (self.type_name, self.message, self.remote_traceback, self.worker))


class WorkerDied(RuntimeError):
    """The worker process ended (or its connection broke) while calls to it were pending, or before them.

    `worker` is the worker's name; `exitcode` its exit status (negative: killed by that signal; None when
    unknown, e.g. for a worker on another host).
    """

    def __init__(self, worker: str, exitcode: int | None = None, detail: str = "") -> None:
        how = "exit code unknown" if exitcode is None else f"exit code {exitcode}"
        if exitcode is not None and exitcode < 0:
            how += f" (killed by signal {-exitcode})"
        msg = f"worker {worker!r} died ({how})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
        self.worker = worker
        self.exitcode = exitcode
        self.detail = detail

    def __reduce__(self) -> Any:
        return (type(self), (self.worker, self.exitcode, self.detail))


class CallCancelled(RuntimeError):
    """Raised by a `Future` whose call was cancelled with `Future.cancel()`."""


class WorkersClosed(RuntimeError):
    """The workers were shut down (their `open_workers` block ended) before the call completed."""


class AuthenticationError(ConnectionError):
    """A connection did not prove the cluster's secret (or the peer could not prove it to us)."""


class ProtocolError(Exception):
    """A malformed, oversized or unexpected frame: the connection that sent it is closed."""


# ---- exceptions on the wire --------------------------------------------------------------------------


def _leaf(exc: BaseException) -> BaseException:
    """A group of one exception stands for that exception (a call raises one exception, never a group)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def error_to_wire(exc: BaseException, args_ok: Any) -> dict[str, Any]:
    """What the caller needs to rebuild ``exc``: its type's module and name, message, args, traceback text.

    ``args_ok(value)`` tells whether the exception's args can travel as they are (plain values).
    """
    exc = _leaf(exc)
    t = type(exc)
    tb = "".join(traceback.format_exception(exc))
    args = list(exc.args)
    return {
        "module": t.__module__,
        "type": t.__qualname__,
        "message": str(exc),
        "args": args if args_ok(args) else None,
        "traceback": tb,
    }


def error_from_wire(info: Any, worker: str) -> BaseException:
    """The exception a caller raises for a remote error: a builtin type as itself (the remote traceback
    as a note), anything else as `RemoteError`."""
    if not isinstance(info, dict):
        return RemoteError("unknown", f"a malformed error report: {info!r}", "", worker)
    module = str(info.get("module", ""))
    name = str(info.get("type", "Exception"))
    message = str(info.get("message", ""))
    tb = str(info.get("traceback", ""))
    args = info.get("args")
    if module == "builtins":
        cls = getattr(builtins, name, None)
        # only ordinary errors: a remote SystemExit or KeyboardInterrupt must not end the caller
        if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, BaseExceptionGroup):
            exc: BaseException | None = None
            for attempt in ((tuple(args),) if isinstance(args, list) else ()) + ((message,),):
                try:
                    exc = cls(*attempt)
                    break
                except Exception:
                    continue
            if exc is not None:
                if tb:
                    exc.add_note(f"remote traceback ({worker}):\n{tb.rstrip()}")
                return exc
    type_name = name if module in ("builtins", "") else f"{module}.{name}"
    return RemoteError(type_name, message, tb, worker)
