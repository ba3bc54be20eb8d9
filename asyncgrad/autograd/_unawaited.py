"""A backward pass that was never awaited, reported where it was created, soon after.

``loss.backward()`` (`Tensor.backward`, `autograd.backward`) returns an awaitable (`Pass`); without
``await`` nothing runs and every ``.grad`` stays as it was. Python itself only says "coroutine ... was
never awaited" when the object is garbage collected, far from the mistake, or never. Here each new pass
is remembered with the user's line that created it, and forgotten once awaited. The report is a
`ForgottenAwaitWarning` (once per creation site) naming that line, at the first of:

* the next ``backward()`` call in the same thread (the usual case: the next training step), and
* the loop's next round after the creating task yields (a callback queued with
  ``run_sync_soon``; it runs once the creating task yields, and at the latest when the runtime closes,
  which yields while it waits for its tasks).

Per thread: runtimes in other threads have their own passes. A warning, not an error: awaiting a pass
later than the next scheduling point is legal (a pass handed to another task), and such a program then
only sees a warning. ``-W error::asyncgrad.ForgottenAwaitWarning`` turns it into an error at that point.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import trio

from ..runtime._sync_access import user_site


class _Local(threading.local):
    def __init__(self) -> None:
        self.pending: dict[int, tuple[Any, str, int, str]] = {}  # id(pass) -> (pass, file, line, what)
        self.check_queued = False


_tls = _Local()
_warned: set[tuple[str, int]] = set()


class ForgottenAwaitWarning(RuntimeWarning):
    """A ``backward()`` / ``autograd.grad()`` pass was created and never awaited: it did not run."""


def created(p: Any, what: str) -> None:
    """Remember the new pass ``p`` (made by ``what``) and where the user made it; check the older ones."""
    tls = _tls
    if tls.pending:
        check()
    frame, _ = user_site()
    if frame is None:
        return
    tls.pending[id(p)] = (p, frame.f_code.co_filename, frame.f_lineno, what)
    if not tls.check_queued:
        try:
            trio.lowlevel.current_trio_token().run_sync_soon(_scheduled_check)
            tls.check_queued = True
        except RuntimeError:  # not in a trio run: only the next backward call checks
            pass


def awaited(p: Any) -> None:
    """``p`` is being awaited: it runs, nothing to report."""
    pending = _tls.pending
    if pending:
        pending.pop(id(p), None)


def _scheduled_check() -> None:
    # trio runs this callback on the loop's own thread: the same thread-local state
    _tls.check_queued = False
    check()


def check() -> None:
    """Report (and forget) every remembered pass that has not been awaited."""
    pending = _tls.pending
    items = list(pending.values())
    pending.clear()
    for _p, filename, lineno, what in items:
        if (filename, lineno) in _warned:
            continue
        _warned.add((filename, lineno))
        warnings.warn_explicit(
            f"{what} created at {filename}:{lineno} was never awaited, so the backward pass did not run "
            f"and no .grad was filled: write `await {what}`",
            ForgottenAwaitWarning,
            filename,
            lineno,
        )
