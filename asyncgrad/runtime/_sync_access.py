"""Sync reads on the event loop thread: time them, and warn once per call site when they blocked the loop.

`Tensor.item()`, `numpy()`, `tolist()`, ``float(t)``, ``bool(t)``, ``np.asarray(t)`` ... wait for the value on
the calling thread. Outside a trio run (a script, a worker thread) that is what the caller wants; on the
event loop thread it stalls every other task (a heartbeat beside a W5-size training saw 3.3 s). The async
form is ``(await t.ready()).item()``: `Tensor.ready` waits without blocking the loop and returns the tensor,
whose accessors then return at once. A wait that did not block (the value was ready) costs nothing here:
only the blocking branch of the accessors calls `blocking_wait`.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from types import FrameType

import trio

# a sync read that blocked the loop for longer than this warns (once per call site); a few ms is what a
# service notices (a 1 ms heartbeat, a request's latency), while a wait of a kernel or two stays silent
BLOCKED_WARN_S = 0.005

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../asyncgrad
_warned: set[tuple[str, int]] = set()

# the accessor the user called (the outermost asyncgrad frame) -> the async form to name in the warning
_ASYNC_FORM = {
    "item": "(await t.ready()).item()",
    "tolist": "(await t.ready()).tolist()",
    # numpy() also waits for every kernel the task queued (they may still use the memory it shares)
    "numpy": "await asyncgrad.current_runtime().synchronize() before t.numpy()",
    "__array__": "await asyncgrad.current_runtime().synchronize() before np.asarray(t)",
    "__float__": "float(await t.ready())",
    "__int__": "int(await t.ready())",
    "__index__": "await t.ready() before using t as an index",
    "__bool__": "bool(await t.ready())",
    "__repr__": "await t.ready() before printing t",
}


class SyncAccessWarning(RuntimeWarning):
    """A sync accessor (`item`, `numpy`, `float`, ...) blocked the event loop thread waiting for a value."""


def user_site() -> tuple[FrameType | None, str]:
    """The first frame outside the asyncgrad package, and the name of the asyncgrad function it called."""
    f: FrameType | None = sys._getframe(1)
    inner = "?"
    while f is not None and f.f_code.co_filename.startswith(_PKG_DIR):
        inner = f.f_code.co_name
        f = f.f_back
    return f, inner


def blocking_wait(wait: Callable[[], None]) -> None:
    """Run ``wait()`` (a blocking wait for a value); on the event loop thread, time it and warn when slow."""
    if not trio.lowlevel.in_trio_run():
        wait()
        return
    t0 = time.perf_counter()
    wait()
    blocked = time.perf_counter() - t0
    if blocked > BLOCKED_WARN_S:
        _warn(blocked)


def _warn(blocked: float) -> None:
    frame, accessor = user_site()
    if frame is None:
        return
    site = (frame.f_code.co_filename, frame.f_lineno)
    if site in _warned:
        return
    _warned.add(site)
    form = _ASYNC_FORM.get(accessor, "await t.ready() first")
    warnings.warn_explicit(
        f"Tensor.{accessor.strip('_')}() blocked the trio event loop for {blocked * 1e3:.1f} ms waiting for "
        f"queued kernels (every other task stalled meanwhile); in async code use {form}, which waits "
        "without blocking the loop (warned once per call site)",
        SyncAccessWarning,
        site[0],
        site[1],
        module=frame.f_globals.get("__name__", "?"),
    )
