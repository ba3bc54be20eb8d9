"""The backward engine: a graph task per `backward()` / `grad()` call.

A graph task counts each node's dependencies, then runs ready nodes (latest-created first, like
PyTorch) until none is left. Plain nodes run back to back with no ``await`` while the task holds its
device's apply lock; the lock (and the event loop) is given back on a time budget and around every
``async def`` backward, which may run a nested pass: that pass is a separate graph task, run on the
trampoline of the task that awaits it (`_Trampoline`), so depth costs two suspended coroutines and a few
objects per level, never Python stack. An async node is entered by one pass at a time (the
no-reentrant-apply invariant). Leaf gradients are staged and handed to their
owners (`_registry`) only when the whole pass succeeded.
"""

from __future__ import annotations

import contextvars
import heapq
import time
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import trio

from ..devices import Stream
from . import _grad_mode
from ._apply import (
    BackwardError,
    apply_function,
    apply_op_graph,
    apply_op_kernel,
    check_function_grads,
    note_failure,
)
from ._dispatch import Node, OpNode
from ._runtime import current_stream
from ._tensor import Tensor

# while a pass runs nodes back to back, the loop gets control back at least this often
TIME_BUDGET_S = 0.002

# alone on its device, a caller may record up to this many passes (training steps) per wake-up of the loop
# (at most the pass marks a stream keeps, `devices._stream.PASS_MARKS`)
RUN_AHEAD = 2

RETAIN_MSG = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they "
    "have already been freed). Saved intermediate values of the graph are freed when you call "
    "backward() or grad(). Specify retain_graph=True if you need to backward through the graph a "
    "second time or if you need to access saved tensors after calling backward."
)


class GraphTask:
    """One backward pass: its state, the coroutine that runs it, and the awaitable that callers await.

    The state is owned by the trio task that runs the pass and shared with nobody. `backward()` and
    `grad()` return the graph task itself (as `_autograd.Pass`): awaiting it runs ``coro`` (`run`) where
    the awaiting task is (see `_autograd.Pass.__await__`); a pass nested on this task's trampoline is
    awaited as a plain iterator that hands itself to `_drive` (one object per nested pass besides its
    coroutine).
    """

    __slots__ = ("ahead_seq", "busy_event", "capture", "coro", "create_graph", "finish", "finish_args", "held",
                 "lock", "parent", "retain_graph", "retained", "rt", "slept", "staged", "start_seq", "stream",
                 "targets")

    def __init__(
        self,
        rt: Any,
        outputs: list[Tensor],
        grads: list[Tensor],
        *,
        retain_graph: bool,
        create_graph: bool,
        targets: set[Any] | None,
        finish: Callable[..., Coroutine[Any, Any, Any]],
        finish_args: tuple[Any, ...] = (),
        parent: GraphTask | None = None,
    ) -> None:
        self.rt = rt
        self.retain_graph = retain_graph
        self.create_graph = create_graph
        self.targets = targets  # None: every leaf; else the keys of the inputs to stop at
        self.parent = parent  # leaves outside `targets` are staged into the parent (checkpoint)
        self.finish = finish  # `await finish(self, *finish_args)` once the graph ran: the pass's result
        self.finish_args = finish_args
        self.capture: dict[Any, Tensor] | None = None  # made on first use (only with targets)
        self.staged: dict[int, list[Any]] = {}  # id(leaf) -> [leaf, summed grad]
        self.retained: list[tuple[Tensor, Tensor]] | None = None  # made on first use (retain_grad)
        # the awaiting task's stream and its device's apply lock are looked up when the pass starts
        self.stream: Stream = None  # type: ignore[assignment]
        self.start_seq = self.ahead_seq = 0
        self.slept = False  # the pass waited for its stream (so it has been a schedule point)
        self.lock: Any = None  # the device's apply lock; `held`: this pass holds it now
        self.held = False
        # while this pass is inside an async node (it is then that node's `_busy`), a pass that waits
        # for the node waits on this event, made by the first such waiter
        self.busy_event: trio.Event | None = None
        # the pass, not started yet (a never-awaited pass warns as a never-awaited coroutine does)
        self.coro: Coroutine[Any, Any, Any] | None = self.run(outputs, grads)

    # ---- awaited on this task's trampoline: a plain iterator that hands itself to `_drive` ----------

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        if self.coro is not None:
            return self  # to `_drive`, which takes `coro` and runs it on top of its stack
        raise StopIteration(value)  # the nested pass's result, sent back by `_drive`

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if val is None:
            val = typ if isinstance(typ, BaseException) else typ()
        raise val

    def close(self) -> None:
        coro, self.coro = self.coro, None
        if coro is not None:  # never started
            coro.close()

    def _discover(self, roots: list[tuple[Any, int]]) -> tuple[dict[Node, int], set[Node] | None]:
        deps: dict[Node, int] = {}
        stack = [n for n, _ in roots if isinstance(n, Node)]
        seen: set[Node] = set(stack)
        order: list[Node] | None = None if self.targets is None or self.parent is not None else []
        get = deps.get
        while stack:
            node = stack.pop()
            if (node.args is None) if type(node) is OpNode else node._released:
                raise RuntimeError(RETAIN_MSG)
            if order is not None:
                order.append(node)
            for e in node.next:
                if e is not None:
                    tgt = e[0]
                    if isinstance(tgt, Node):
                        deps[tgt] = get(tgt, 0) + 1
                        if tgt not in seen:
                            seen.add(tgt)
                            stack.append(tgt)
        if order is None:
            return deps, None
        # with explicit inputs, run only nodes from which some input is reachable (reverse topological)
        runs: set[Node] = set()
        targets: set[Any] = self.targets  # type: ignore[assignment]  # order exists only with targets
        for node in reversed(_topo(order, deps)):
            for e in node.next:
                if e is not None and (
                    e[0] in runs or (e[0], e[1]) in targets
                    if isinstance(e[0], Node)
                    else id(e[0]) in targets
                ):
                    runs.add(node)
                    break
        return deps, runs

    async def run(self, outputs: list[Tensor], grads: list[Tensor]) -> Any:
        """The pass: run the graph from ``outputs`` (seeded with ``grads``) until no node is left, then
        ``finish`` (commit or collect the gradients); returns what ``finish`` returns."""
        rt = self.rt
        outer = current_graph_task.get()
        clock = time.perf_counter
        tramp: _Trampoline | None = None
        if outer is not None:
            tramp = _trampoline.get()
            if tramp is not None and tramp.task is trio.lowlevel.current_task():
                # nested on this task's trampoline: a cancel point, and a schedule point when another
                # task is ready to run or this one has run for its time budget (a deep chain alone on
                # the loop does not pay a scheduler round per level)
                if clock() > tramp.budget_end:
                    await trio.lowlevel.checkpoint()
                    tramp.budget_end = clock() + TIME_BUDGET_S
                elif trio.lowlevel.current_statistics().tasks_runnable:
                    await trio.lowlevel.checkpoint()
                    # the tasks we yielded to may run after us in the loop's next batch (which we cannot
                    # see in the statistics): the next pass entered yields once more
                    tramp.budget_end = 0.0
                else:
                    await trio.lowlevel.checkpoint_if_cancelled()
            else:
                tramp = None
                # a nested pass in its own task is a checkpoint on entry, as any trio call
                await trio.lowlevel.checkpoint()
        self.stream = task_stream = current_stream(rt.cpu)  # nodes that ran inline queue their backward here
        # backpressure (see the end of the pass): alone on its lane, a stream lets its caller record up to
        # RUN_AHEAD passes per wake-up of the loop; on a shared lane the loop has the other streams' work to
        # record meanwhile, and a deeper queue only adds to the contention for the GIL (W3)
        marks = task_stream.pass_marks
        if task_stream.lane_to_itself():
            # the deeper run-ahead only for a training alone on its device: beside others, its longer
            # recording bursts would stall their lanes on the GIL too (measured on W3 at P=2 and 4)
            ahead = RUN_AHEAD if task_stream.device.pool.in_use <= 1 else 1
            self.start_seq, self.ahead_seq = marks[-1], marks[-ahead]
        else:
            self.start_seq = self.ahead_seq = task_stream._submitted
        marks.append(task_stream._submitted)
        del marks[0]
        lock = self.lock = task_stream.device.apply_lock
        current_graph_task.set(self)
        rt.graph_tasks_started += 1
        try:
            deps: Any
            buffers: Any
            deps, runs, buffers, heap, nxt = self._seed(outputs, grads)
            del outputs, grads  # not kept alive while the loop is suspended (a deep chain holds every level)
            heappop, heappush = heapq.heappop, heapq.heappush
            create, release, targets = bool(self.create_graph), not self.retain_graph, self.targets
            # nxt: the one ready node, kept off the heap while nothing else is ready
            node: Any
            gouts: Any
            gins: Any
            g: Any
            buf: Any
            e: Any
            tgt: Any
            old: Any
            r: Any
            try:
                lock.acquire_nowait()
            except trio.WouldBlock:
                await lock.acquire()
            self.held = True
            # the loop runs with grad mode = create_graph (restored on the way out)
            mode_before = _grad_mode._grad_enabled.get()
            if mode_before is not create:
                _grad_mode._grad_enabled.set(create)
            try:
                budget_end = clock() + TIME_BUDGET_S if tramp is None else tramp.budget_end
                while True:
                    if nxt is not None:
                        node, nxt = nxt, None
                    elif heap:
                        node = heappop(heap)[1]
                    else:
                        break
                    gouts = buffers.pop(node, None) if buffers is not None else None
                    gins = None
                    if gouts is not None and (gouts[0] is not None or any(g is not None for g in gouts)):
                        if node._hooked or targets is not None:
                            gouts = self._pre(node, gouts)
                        if runs is None or node in runs:
                            if type(node) is OpNode and not create:
                                gins = apply_op_kernel(node, gouts[0], task_stream)
                            elif type(node) is OpNode:
                                gins = apply_op_graph(node, gouts[0])
                            elif node.is_async:
                                # give the device (and the loop) to others while this backward awaits; drop
                                # the previous node's loop variables, which a deep chain would keep per level
                                e = tgt = g = buf = old = r = None
                                if not deps and not buffers:
                                    # nothing left to count or to sum (a chain's usual state here): no node
                                    # sends to another from now on, so keep no (tracked) dicts per level
                                    deps = buffers = None
                                self.held = False
                                lock.release()
                                try:
                                    if node._busy is not None:
                                        await self._wait_until_free(node)
                                    node._busy = self  # no other pass enters this node until we are out
                                    try:
                                        # the backward runs right in this coroutine (the passes it awaits
                                        # are handed to this task's trampoline); the first async node of a
                                        # task starts the trampoline (see `_Trampoline`)
                                        try:
                                            r = node.fn_cls.backward(node.ctx, *node.prepare_grads(gouts))
                                            r = await (r if tramp is not None or trampoline_here() else _drive(r))
                                        except Exception as exc:
                                            # the user's exception as it is, naming this node on its way
                                            # out of every pass it crosses
                                            note_failure(exc, f"raised in the backward of {node.name()}")
                                            raise
                                        gins = check_function_grads(node, r)
                                        r = None
                                    finally:
                                        self._leave(node)
                                finally:
                                    try:
                                        lock.acquire_nowait()
                                    except trio.WouldBlock:
                                        await lock.acquire()
                                    self.held = True
                                budget_end = clock() + TIME_BUDGET_S if tramp is None else tramp.budget_end
                            else:
                                gins = apply_function(node, gouts)
                            if node._hooked and node._post_hooks:
                                gins = _run_post_hooks(node, gins, gouts)
                            if release:
                                node.release()
                        gouts = None
                    for e, g in zip(node.next, gins) if gins is not None else ((e, None) for e in node.next):
                        if e is None:
                            continue
                        tgt = e[0]
                        if isinstance(tgt, Node):
                            if g is not None:
                                buf = buffers.get(tgt)
                                if buf is None:
                                    buf = buffers[tgt] = [None] * tgt.n_outputs
                                old = buf[e[1]]
                                buf[e[1]] = g if old is None else old + g
                            left = deps[tgt] - 1
                            if left:
                                deps[tgt] = left
                            else:
                                del deps[tgt]  # ready: nothing else sends to it (a suspended pass keeps less)
                                if nxt is None and not heap:
                                    nxt = tgt  # a chain: no priority to keep, skip the heap
                                else:
                                    if heap is None:
                                        heap = []
                                    if nxt is not None:
                                        heappush(heap, (-nxt.seq, nxt))
                                        nxt = None
                                    heappush(heap, (-tgt.seq, tgt))
                        elif g is not None:
                            self._to_leaf(tgt, g)
                    if clock() > budget_end:
                        self.held = False
                        lock.release()
                        await trio.lowlevel.checkpoint()
                        try:
                            lock.acquire_nowait()
                        except trio.WouldBlock:
                            await lock.acquire()
                        self.held = True
                        budget_end = clock() + TIME_BUDGET_S
                        if tramp is not None:
                            tramp.budget_end = budget_end
            finally:
                if mode_before is not create or tramp is not None:
                    # nested: the enclosing backward finds its grad mode as it left it
                    _grad_mode._grad_enabled.set(mode_before)
                if self.held:
                    self._release()
            # hold nothing of the graph while finishing: a gradient still referenced here could not be
            # stolen by its leaf (the owner checks that it is the only holder)
            del deps, runs, buffers, heap
            node = gouts = gins = g = buf = e = tgt = old = nxt = None
            # let the caller run ahead of its stream, never waiting for the pass's own kernels. Shared, wait
            # for the work queued before this pass. Alone on a lane, wait only once the lane is behind the
            # start of the pass RUN_AHEAD back, and then until it reaches the previous pass's start: the
            # caller then records RUN_AHEAD steps per wake-up, and each wake-up (the loop's trio round
            # trip, the lane stalled on the GIL meanwhile) is paid once per RUN_AHEAD steps (W1)
            if task_stream._completed < self.ahead_seq:
                await task_stream.synchronize(self.start_seq)
                self.slept = True
            else:
                task_stream.check_error()
            return await self.finish(self, *self.finish_args)
        finally:
            rt.graph_tasks_finished += 1
            current_graph_task.set(outer)

    def _seed(
        self, outputs: list[Tensor], grads: list[Tensor]
    ) -> tuple[dict[Node, int], set[Node] | None, dict[Node, list[Any]], list[Any] | None, Node | None]:
        """Dependency counts, the nodes to run (None: all), the gradient buffers seeded with ``grads``, and
        the heap of the nodes ready to run (None when at most one is: then that node, else None)."""
        roots = [(t._grad_fn, t._out_nr) if t._grad_fn is not None else (t, 0) for t in outputs]
        deps, runs = self._discover(roots)
        buffers: dict[Node, list[Any]] = {}
        for (node, nr), g in zip(roots, grads):
            if isinstance(node, Node):
                buf = buffers.setdefault(node, [None] * node.n_outputs)
                buf[nr] = g if buf[nr] is None else buf[nr] + g
            else:
                self._to_leaf(node, g)
        heap: list[Any] | None = [(-n.seq, n) for n in buffers if deps.get(n, 0) == 0]
        first = heap[0][1] if heap is not None and len(heap) == 1 else None  # the one ready node
        if heap and len(heap) > 1:
            heapq.heapify(heap)
        else:
            heap = None  # made when two nodes are ready at once (a chain never needs it)
        return deps, runs, buffers, heap, first

    def _release(self) -> None:
        self.held = False
        self.lock.release()

    async def _wait_until_free(self, node: Any) -> None:
        """Wait until no other pass is inside the async node ``node`` (the no-reentrant-apply invariant)."""
        while node._busy is not None:
            other: GraphTask = node._busy
            if other.busy_event is None:
                other.busy_event = trio.Event()
            await other.busy_event.wait()
        if node._released:
            raise RuntimeError(RETAIN_MSG)  # the pass we waited for freed it

    def _leave(self, node: Any) -> None:
        node._busy = None
        ev = self.busy_event
        if ev is not None:
            self.busy_event = None
            ev.set()

    def _to_leaf(self, leaf: Tensor, g: Tensor) -> None:
        task: GraphTask | None = self
        # checkpoint: a leaf the nested pass does not capture (a parameter) belongs to the nearest
        # enclosing pass that accumulates it
        while task is not None and task.targets is not None and id(leaf) not in task.targets:
            task = task.parent
        if task is None:
            return
        staged = task.staged
        entry = staged.get(id(leaf))
        if entry is None:
            staged[id(leaf)] = [leaf, g]
        else:
            entry[1] = entry[1] + g

    def _pre(self, node: Node, gouts: list[Any]) -> list[Any]:
        """Tensor hooks, node pre-hooks, retain_grad and capture, in PyTorch's order."""
        tph = node._tensor_pre_hooks
        if tph:
            for nr, table in tph.items():
                for fn in list(table.values()):
                    r = call_hook(fn, node, gouts[nr])
                    if r is not None:
                        gouts[nr] = check_hook_grad(node, gouts[nr], r)
        if node._retained:
            for nr, ref in node._retained.items():
                t = ref()
                if t is not None and gouts[nr] is not None:
                    if self.retained is None:
                        self.retained = []
                    self.retained.append((t, gouts[nr]))
        if node._pre_hooks:
            for fn in list(node._pre_hooks.values()):
                r = call_hook(fn, node, tuple(gouts))
                if r is not None:
                    gouts = check_hook_grads(node, "pre-hook", gouts, r)
        if self.targets is not None:
            for nr in range(len(gouts)):
                if (node, nr) in self.targets and gouts[nr] is not None:
                    if self.capture is None:
                        self.capture = {}
                    self.capture[(node, nr)] = gouts[nr]
        return gouts


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
current_graph_task: contextvars.ContextVar[GraphTask | None] = contextvars.ContextVar(
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
            if isinstance(y, GraphTask):
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


def _topo(order: list[Node], deps: dict[Node, int]) -> list[Node]:
    """Nodes such that each comes before the nodes it sends gradients to (Kahn's algorithm)."""
    indeg = dict(deps)
    ready = [n for n in order if indeg.get(n, 0) == 0]
    out = []
    while ready:
        n = ready.pop()
        out.append(n)
        for e in n.next:
            if e is not None and isinstance(e[0], Node):
                indeg[e[0]] -= 1
                if indeg[e[0]] == 0:
                    ready.append(e[0])
    return out


def call_hook(fn: Any, node: Node | None, arg: Any) -> Any:
    """Call a tensor hook or a node pre-hook; an exception it raises propagates as itself, with a note."""
    try:
        return fn(arg)
    except Exception as e:
        if node is not None:
            note_failure(e, f"raised in a hook on {node.name()}")
        else:
            note_failure(e, f"raised in a hook on a leaf tensor of shape {arg._shape}")
        raise


def check_hook_grad(node: Node | None, old: Tensor, new: Any) -> Tensor:
    if not isinstance(new, Tensor) or new._shape != old._shape:
        where = node.name() if node is not None else "a leaf tensor"
        got = new._shape if isinstance(new, Tensor) else type(new).__name__
        # PyTorch: a TypeError for a non-Tensor, a RuntimeError for a wrong size
        err = BackwardError if isinstance(new, Tensor) else TypeError
        raise err(
            f"a hook on {where} returned {got} but the gradient has shape {old._shape}; "
            "a hook must return None or a Tensor of the same shape"
        )
    return new


def _run_post_hooks(node: Node, gins: list[Any], gouts: list[Any]) -> list[Any]:
    # hooks see one gradient per tensor input, as in PyTorch (Python numbers are not inputs there)
    pos = node.tensor_positions()
    full = gins
    gins = [full[i] for i in pos]
    for fn in list(node._post_hooks.values()):
        try:
            r = fn(tuple(gins), tuple(gouts))
        except Exception as e:
            note_failure(e, f"raised in a hook on {node.name()}")
            raise
        if r is not None:
            gins = check_hook_grads(node, "hook", gins, r)
    full = list(full)
    for i, g in zip(pos, gins):
        full[i] = g
    return full


def check_hook_grads(node: Node, kind: str, old: list[Any], new: Any) -> list[Any]:
    """A node hook must return one Tensor (or None) per gradient, each of the old one's shape."""
    new = list(new) if isinstance(new, (tuple, list)) else [new]
    if len(new) != len(old):
        raise BackwardError(
            f"a {kind} on {node.name()} returned {len(new)} gradients, expected {len(old)}"
        )
    for o, n in zip(old, new):
        if n is None:
            continue
        if not isinstance(n, Tensor) or (o is not None and n._shape != o._shape):
            got = n._shape if isinstance(n, Tensor) else type(n).__name__
            want = o._shape if o is not None else "a Tensor"
            raise BackwardError(
                f"a {kind} on {node.name()} returned {got} where a gradient of shape {want} was expected; "
                "return None or Tensors of the same shapes"
            )
    return new
