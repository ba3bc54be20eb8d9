"""`backward()` and `grad()`: each returns a pass (a `GraphTask`) to await.

Where the pass runs depends on the task that awaits it (`Pass.__await__`): a top-level pass right in
the caller's task; a pass awaited by a backward function of a pass in the same task on that task's
trampoline (`_trampoline._Trampoline`: no task spawn, no Python stack per level); a pass awaited from another
task (a backward function's own nursery) as a task of the runtime's nursery. The caller's cancellation
cancels the pass and every pass nested in it; its errors come back to the caller. Gradients reach
`.grad` only after the pass succeeded (through the leaves' owners, see `_leaf_owner`).
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Coroutine, Generator, Sequence
from typing import Any

import numpy as np
import trio

from ..runtime._capture import capture_active
from ..runtime._factories import zeros_like
from ..runtime._runtime import Runtime, _task_streams, _TaskStreams, current_runtime, current_stream
from ..runtime._tensor import Tensor
from . import _unawaited
from ._engine import GraphTask
from ._leaf_owner import prepare_and_commit, run_queued, take_queued
from ._run_node import in_plain_backward
from ._trampoline import current_graph_task, trampoline_here

_task_ids = itertools.count(1)

def _check_not_plain(what: str) -> None:
    name = in_plain_backward.get()
    if name is not None:
        raise RuntimeError(
            f"{what} was called from inside the plain (non-async) backward of {name}; a backward that runs "
            "another backward pass must be `async def backward(ctx, ...)` and `await` it"
        )


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, Tensor):
        return [x]
    return list(x)


def _root_grads(what: str, outputs: Sequence[Any], grads: Sequence[Any] | None) -> list[Tensor]:
    if grads is not None and len(grads) != len(outputs):
        raise RuntimeError(f"{what}: got {len(outputs)} outputs but {len(grads)} gradients")
    out = []
    for i, t in enumerate(outputs):
        if not isinstance(t, Tensor):
            raise TypeError(f"{what}: outputs must be Tensors, got {type(t).__name__}")
        if not t._rg:
            raise RuntimeError(
                f"{what}: element {i} of tensors does not require grad and does not have a grad_fn; "
                "did you forget requires_grad=True on the inputs, or run the forward under no_grad()?"
            )
        g = None if grads is None else grads[i]
        if g is None:
            if t.numel() != 1:
                arg = "gradient=" if what == "backward" else "grad_outputs="
                raise RuntimeError(
                    f"{what}: grad can be implicitly created only for scalar outputs, but the output has "
                    f"shape {t._shape}; pass {arg} (a tensor of shape {t._shape}) to {what}()"
                )
            g = Tensor._wrap(np.ones(t._shape, dtype=t._dtype), t._dev)
        elif not isinstance(g, Tensor):
            g = Tensor._wrap(np.asarray(g, dtype=t._dtype), t._dev)
        if g._shape != t._shape:
            raise RuntimeError(
                f"{what}: gradient has shape {g._shape} but the output has shape {t._shape}; they must match"
            )
        if g._dev is not t._dev:
            raise RuntimeError(f"{what}: gradient is on {g._dev} but the output is on {t._dev}")
        out.append(g)
    return out


class _Box:
    """A pass running in its own task: how to cancel it, and how it ended."""

    __slots__ = ("cancelled", "children", "error", "ok", "scope")

    def __init__(self) -> None:
        self.scope: trio.CancelScope | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.ok = False
        self.children: list[_Box] = []  # nested passes started by this pass's backward functions

    def cancel_tree(self) -> None:
        """Cancel this pass and every pass nested in it at once (not one level per scheduler batch)."""
        stack = [self]
        while stack:
            box = stack.pop()
            box.cancelled = True
            if box.scope is not None:
                box.scope.cancel()
            stack.extend(box.children)


# the pass running in this task, so passes nested in it can be cancelled together with it
_current_box: contextvars.ContextVar[_Box | None] = contextvars.ContextVar("asyncgrad_pass_box", default=None)


class Pass(GraphTask):
    """What `backward()` and `grad()` return: a backward pass, run when awaited (once).

    Where it runs is decided by the task that awaits it, when it awaits it:

    * A top-level pass (not awaited from inside another pass's backward function) runs right in the
      caller's task: nothing nests there.
    * A pass awaited by a backward function of a pass in this same task runs on the task's trampoline
      (`_trampoline._drive`): in the same task, with no task spawn, and cancelled with its caller.
    * A pass awaited from another task while a pass is running (a backward function that starts passes
      in its own nursery) runs as a task of the runtime's nursery, on the caller's streams.
    """

    __slots__ = ()

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self.coro
        if coro is None:
            raise RuntimeError("a backward pass can be awaited only once")
        _unawaited.awaited(self)
        if current_graph_task.get() is None:
            self.coro = None
            return _top_level(self, coro).__await__()
        if trampoline_here():
            return self  # type: ignore[return-value]  # an iterator that hands itself to `_drive`
        self.coro = None
        return _in_own_task(self.rt, coro).__await__()


async def _top_level(task: GraphTask, body: Coroutine[Any, Any, Any]) -> Any:
    # like any trio async function, a pass is a checkpoint even when all its work ran inline
    try:
        await trio.lowlevel.checkpoint_if_cancelled()
    except BaseException:
        body.close()
        raise
    root = _Box()
    token = _current_box.set(root)
    try:
        result = await body
    except trio.Cancelled:
        root.cancel_tree()
        raise
    finally:
        current_graph_task.set(None)
        _current_box.reset(token)
    if not task.slept:  # a pass that waited for its kernels was a schedule point already
        await trio.lowlevel.cancel_shielded_checkpoint()
    return result


async def _in_own_task(rt: Runtime, body: Coroutine[Any, Any, Any]) -> Any:
    """Run ``body`` as a task of the runtime's nursery, on the caller's streams; wait for it."""
    current_stream(rt.cpu)  # make sure the caller has its streams, to lend them to the pass
    caller_streams = _task_streams.get()
    done = trio.Event()
    box = _Box()
    parent = _current_box.get()
    if parent is not None:
        parent.children.append(box)
        if parent.cancelled:
            box.cancelled = True
    result: list[Any] = []

    async def task_main() -> None:
        try:
            if box.cancelled:
                body.close()
                return
            ts = _TaskStreams(trio.lowlevel.current_task())
            ts.by_device = caller_streams.by_device  # type: ignore[union-attr]
            _task_streams.set(ts)
            _current_box.set(box)
            with trio.CancelScope() as cs:
                box.scope = cs
                if box.cancelled:
                    cs.cancel()
                try:
                    result.append(await body)
                    box.ok = True
                except Exception as e:
                    box.error = e
        finally:
            done.set()

    rt.nursery.start_soon(task_main)
    try:
        await done.wait()
    except trio.Cancelled:
        box.cancel_tree()
        with trio.CancelScope(shield=True):
            await done.wait()
        raise
    finally:
        if parent is not None:
            parent.children.remove(box)
    if box.error is not None:
        raise box.error
    if not box.ok:
        # our own scope was cancelled from above (the enclosing pass is being cancelled), or the runtime
        # is shutting down: report it as cancellation if it is one
        await trio.lowlevel.checkpoint_if_cancelled()
        raise RuntimeError("a nested backward pass was cancelled (its runtime is closing)")
    return result[0]


def _targets_of(what: str, inputs: Any) -> tuple[list[Tensor], list[Any]]:
    ins = _as_list(inputs)
    if not ins:
        raise RuntimeError(f"{what}: inputs must be a non-empty sequence of tensors")
    keys = []
    for t in ins:
        if not isinstance(t, Tensor) or not t._rg:
            raise RuntimeError(f"{what}: One of the differentiated Tensors does not require grad")
        keys.append(id(t) if t._grad_fn is None else (t._grad_fn, t._out_nr))
    return ins, keys


def backward(
    tensors: Any,
    grad_tensors: Any = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> Any:
    """Accumulate the gradients of ``tensors`` into the `.grad` of the leaves; returns an awaitable.

    Args:
        tensors: Output tensor(s) to differentiate.
        grad_tensors: Gradient(s) w.r.t. each output (may be None for one-element outputs).
        retain_graph: Keep saved values for another backward (default: ``create_graph``).
        create_graph: Record the backward itself, for higher derivatives.
        inputs: Accumulate only into these tensors (leaves, or non-leaves that then retain grad).
    """
    _check_not_plain("backward()")
    rt = current_runtime("backward()")
    outputs = _as_list(tensors)
    grads = _root_grads("backward", outputs, None if grad_tensors is None else _as_list(grad_tensors))
    targets = None
    if inputs is not None:
        ins, keys = _targets_of("backward", inputs)
        for t in ins:
            if t._grad_fn is not None:
                t.retain_grad()
        targets = set(keys)
    retain = create_graph if retain_graph is None else retain_graph
    if create_graph and capture_active() is not None:
        capture_active().unsupported("backward(create_graph=True): the backward is recorded as a graph")
    p = Pass(rt, outputs, grads, retain_graph=retain, create_graph=create_graph, targets=targets,
             finish=_finish_backward)
    _unawaited.created(p, "loss.backward()")
    return p


async def _finish_backward(task: GraphTask) -> None:
    """After `backward()`'s graph ran: commit the staged leaf gradients, then retained non-leaf ones."""
    create = task.create_graph
    staged = list(task.staged.values())
    task.staged.clear()
    task_id = next(_task_ids)
    try:
        await prepare_and_commit(task.rt, task.stream, staged, commit=True, create_graph=create, task_id=task_id)
    finally:
        queued = take_queued(task_id)  # dropped, not run, if the commit failed (it was undone)
    if queued is not None:
        await run_queued(queued)
    _set_retained(task)


def _set_retained(task: GraphTask) -> None:
    """Non-leaf tensors that retain their grad get it from any pass, `grad()` too (as in PyTorch)."""
    if task.retained:
        create = task.create_graph
        for t, g in task.retained:
            g = g if create else g.detach()
            t._grad = g if t._grad is None else t._grad + g


def grad(
    outputs: Any,
    inputs: Any,
    grad_outputs: Any = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    materialize_grads: bool = False,
    only_inputs: bool = True,
) -> Any:
    """Gradients of ``outputs`` w.r.t. ``inputs``, returned instead of accumulated; await the result.

    ``only_inputs`` is accepted as PyTorch's (deprecated there, and ignored: only the inputs get
    gradients; False warns, as in PyTorch).

    Returns:
        A tuple with one gradient per input; an input the outputs do not depend on raises, unless
        ``allow_unused=True`` (its entry is then None) or ``materialize_grads=True`` (zeros instead).
    """
    if not only_inputs:
        import warnings

        warnings.warn(
            "only_inputs argument is deprecated and is ignored now (defaults to True). To accumulate "
            "gradient for other parts of the graph, please use asyncgrad.autograd.backward.",
            FutureWarning,
            stacklevel=2,
        )
    if allow_unused is None:
        allow_unused = materialize_grads
    elif materialize_grads and not allow_unused:
        raise ValueError("grad(): materialize_grads=True needs allow_unused to be True or left unset")
    _check_not_plain("grad()")
    rt = current_runtime("grad()")
    outs = _as_list(outputs)
    ins, keys = _targets_of("grad", inputs)
    grads = _root_grads("grad", outs, None if grad_outputs is None else _as_list(grad_outputs))
    retain = create_graph if retain_graph is None else retain_graph
    if create_graph and capture_active() is not None:
        capture_active().unsupported("grad(create_graph=True): the backward is recorded as a graph")
    p = _grad(rt, outs, grads, ins, keys, retain, create_graph, allow_unused, None)
    return _materialized(p, ins) if materialize_grads else p


async def _materialized(p: Pass, ins: list[Tensor]) -> tuple[Tensor, ...]:
    gs = await p
    return tuple(zeros_like(t) if g is None else g for g, t in zip(gs, ins))


def _grad(
    rt: Runtime, outs: list[Tensor], grads: list[Tensor], ins: list[Tensor], keys: list[Any],
    retain: bool, create: bool, allow_unused: bool, parent: GraphTask | None,
) -> Pass:
    return Pass(rt, outs, grads, retain_graph=retain, create_graph=create, targets=set(keys), parent=parent,
                finish=_finish_grad, finish_args=(ins, keys, allow_unused))


async def _finish_grad(
    task: GraphTask, ins: list[Tensor], keys: list[Any], allow_unused: bool
) -> tuple[Tensor | None, ...]:
    """After `grad()`'s graph ran: the gradients w.r.t. ``ins`` (leaf hooks run, nothing committed)."""
    create = task.create_graph
    leaf_entries = [task.staged[k] for k in keys if isinstance(k, int) and k in task.staged]
    await prepare_and_commit(task.rt, task.stream, leaf_entries, commit=False, create_graph=create, task_id=0)
    capture = task.capture or {}
    result: list[Tensor | None] = []
    for t, k in zip(ins, keys):
        entry = task.staged.get(k) if t._grad_fn is None else None
        g = entry[1] if entry is not None else capture.get(k)
        if g is None and not allow_unused:
            raise RuntimeError(
                "grad: one of the differentiated Tensors appears to not have been used in the graph; "
                "set allow_unused=True if this is the desired behavior"
            )
        result.append(g if g is None or create else g.detach())
    for k in keys:
        # the pass is over: drop its own references to what it returns (the entries are shared with the
        # leaf owners' prepare messages), so a caller that folds a result into a `.grad` later may steal
        # it: its reference count then says nobody else holds it
        done = task.staged.pop(k, None) if isinstance(k, int) else None
        if done is not None:
            done.clear()
    _set_retained(task)
    return tuple(result)


async def nested_grad(outs: list[Tensor], grads: list[Tensor], ins: list[Tensor]) -> tuple[Tensor | None, ...]:
    """For `checkpoint`: grads w.r.t. ``ins``; every other leaf's gradient joins the running outer pass."""
    rt = current_runtime("checkpoint")
    parent = current_graph_task.get()
    keys = [id(t) if t._grad_fn is None else (t._grad_fn, t._out_nr) for t in ins]
    create = parent is not None and parent.create_graph
    if not ins:
        # nothing to capture, but parameters inside still need their gradients: stage them all
        keys, ins = [], []
    return await _grad(rt, outs, grads, ins, keys, create, create, True, parent)
