"""The trampoline: nested (reentrant) backward passes of one trio task, run without recursion.

A backward function that awaits another pass hands that pass to the trampoline of its task (`_drive`),
which keeps the nested coroutines on a list instead of the Python stack: depth costs suspended coroutines,
never threads or recursion.
"""

from __future__ import annotations

import contextvars
import time
import types
from collections.abc import Coroutine, Generator
from typing import Any

import trio

# while a pass runs nodes back to back, the loop gets control back at least this often
TIME_BUDGET_S = 0.002


class NestedPass:
    """What a pass awaited on a trampoline yields to `_drive`: its not yet started coroutine (``coro``).

    The engine's `GraphTask` is one; `_drive` tells it apart from trio's traps by this type.
    """

    __slots__ = ("coro",)

    coro: Coroutine[Any, Any, Any] | None


class _Trampoline:
    """Runs the reentrant passes of one trio task, nested at any depth, on a stack of coroutines.

    A backward function that awaits a nested pass cannot simply ``await`` the pass's coroutine: a chain of
    D nested awaits is resumed through D Python frames at every step, so depth would be bounded by the
    recursion limit. Spawning a trio task per nested pass keeps the stack flat, at the price of a task,
    a context, a cancel scope and two scheduler rounds per level. Instead, the first async node a task
    enters runs its backward under `_drive`: a pass awaited inside it (a `GraphTask` awaited on this
    trampoline) is pushed onto a stack and driven directly by `_drive`, which forwards trio's traps from
    the innermost coroutine to trio and routes results and exceptions back to the coroutine that awaited
    it. The whole tree of nested passes is then one trio task: cancelling the caller cancels all of it,
    its cancel scopes nest as plain awaits' would, and the device lock and the streams are the task's
    own. Nested passes run in the task's context, as plain awaits do (no copy per level); a pass sets
    `current_graph_task` and the grad mode and puts back both on its way out.

    ``budget_end``: when the passes of this task next give the loop a schedule point (a nested pass
    entering is a cancel point, and a schedule point only once the task has run for `TIME_BUDGET_S`).
    """

    __slots__ = ("budget_end", "task")

    def __init__(self) -> None:
        self.task = trio.lowlevel.current_task()
        self.budget_end = time.perf_counter() + TIME_BUDGET_S



# the trampoline running in this task (a nested pass checks that it is its own task's before using it)
_trampoline: contextvars.ContextVar[_Trampoline | None] = contextvars.ContextVar(
    "asyncgrad_trampoline", default=None
)



# the graph task running in this trio task (whose backward functions run now; checkpoint's nested pass
# stages its parameters' gradients into it); None outside any pass
current_graph_task: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "asyncgrad_graph_task", default=None
)



def trampoline_here() -> bool:
    """Whether a pass awaited right now runs on this task's trampoline."""
    tramp = _trampoline.get()
    return tramp is not None and tramp.task is trio.lowlevel.current_task()



@types.coroutine
def _drive(root: Coroutine[Any, Any, Any]) -> Generator[Any, Any, Any]:
    """Run ``root`` and every pass awaited under it in this task, iteratively (see `_Trampoline`)."""
    tramp = _Trampoline()
    token = _trampoline.set(tramp)
    clock = time.perf_counter
    coros: list[Any] = [root]
    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            coro = coros[-1]
            try:
                if error is None:
                    y = coro.send(value)
                else:
                    e, error = error, None
                    y = coro.throw(e)
            except StopIteration as stop:
                coros.pop()
                if not coros:
                    return stop.value
                value = stop.value
                continue
            except BaseException as exc:
                coros.pop()
                if not coros:
                    raise
                error, value = exc, None
                continue
            coro = None
            if isinstance(y, NestedPass):
                coros.append(y.coro)
                y.coro = None
                value = None
                continue
            # one of trio's traps, from the innermost coroutine: trio answers it (or we are thrown into)
            try:
                value = yield y
            except BaseException as exc:
                error, value = exc, None
            y = None
            tramp.budget_end = clock() + TIME_BUDGET_S  # the task was just scheduled again
    finally:
        _trampoline.reset(token)
        while coros:
            coros.pop().close()  # only after GeneratorExit: the coroutines left unfinished, innermost first
