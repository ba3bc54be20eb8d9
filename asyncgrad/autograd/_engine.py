"""The backward engine: a graph task per `backward()` / `grad()` call.

A graph task counts each node's dependencies, then runs ready nodes (latest-created first, like
PyTorch) until none is left. Plain nodes run back to back with no ``await`` while the task holds its
device's apply lock; the lock (and the event loop) is given back on a time budget and around every
``async def`` backward, which may run a nested pass: that pass is a separate graph task, run on the
trampoline of the task that awaits it (`_Trampoline`), so depth costs two suspended coroutines and a few
objects per level, never Python stack. An async node is entered by one pass at a time (the
no-reentrant-apply invariant). Leaf gradients are staged and handed to their
owners (`_leaf_owner`) only when the whole pass succeeded.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Coroutine
from typing import Any

import trio

from ..devices import Stream
from ..runtime import _grad_mode
from ..runtime._node import Node, OpNode
from ..runtime._runtime import current_stream
from ..runtime._tensor import Tensor
from ._deps import RETAIN_MSG, count_dependencies
from ._hooks import run_post_hooks, run_pre_hooks
from ._run_node import (
    apply_function,
    apply_op_graph,
    apply_op_kernel,
    check_function_grads,
    note_failure,
)
from ._trampoline import (
    TIME_BUDGET_S,
    NestedPass,
    _drive,
    _Trampoline,
    _trampoline,
    current_graph_task,
    trampoline_here,
)

# alone on its device, a caller may record up to this many passes (training steps) per wake-up of the loop
# (at most the pass marks a stream keeps, `devices._stream.PASS_MARKS`)
RUN_AHEAD = 2



class GraphTask(NestedPass):
    """One backward pass: its state, the coroutine that runs it, and the awaitable that callers await.

    The state is owned by the trio task that runs the pass and shared with nobody. `backward()` and
    `grad()` return the graph task itself (as `_api.Pass`): awaiting it runs ``coro`` (`run`) where
    the awaiting task is (see `_api.Pass.__await__`); a pass nested on this task's trampoline is
    awaited as a plain iterator that hands itself to `_drive` (one object per nested pass besides its
    coroutine).
    """

    __slots__ = ("ahead_seq", "busy_event", "capture", "create_graph", "finish", "finish_args", "held",
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

    async def run(self, outputs: list[Tensor], grads: list[Tensor]) -> Any:
        """The pass: run the graph from ``outputs`` (seeded with ``grads``) until no node is left, then
        ``finish`` (commit or collect the gradients); returns what ``finish`` returns."""
        rt = self.rt
        outer = current_graph_task.get()
        tramp = await self._enter(outer)
        task_stream = self._start()
        current_graph_task.set(self)
        rt.graph_tasks_started += 1
        try:
            deps, runs, buffers, heap, nxt = self._seed(outputs, grads)
            del outputs, grads  # not kept alive while the loop is suspended (a deep chain holds every level)
            await self._acquire()
            # the loop runs with grad mode = create_graph (restored on the way out)
            create = bool(self.create_graph)
            mode_before = _grad_mode._grad_enabled.get()
            if mode_before is not create:
                _grad_mode._grad_enabled.set(create)
            try:
                await self._run_nodes(deps, runs, buffers, heap, nxt, task_stream, tramp)
            finally:
                if mode_before is not create or tramp is not None:
                    # nested: the enclosing backward finds its grad mode as it left it
                    _grad_mode._grad_enabled.set(mode_before)
                if self.held:
                    self._release()
            # hold nothing of the graph while finishing: a gradient still referenced here could not be
            # stolen by its leaf (the owner checks that it is the only holder)
            del deps, runs, buffers, heap, nxt
            await self._wait_ahead(task_stream)
            return await self.finish(self, *self.finish_args)
        finally:
            rt.graph_tasks_finished += 1
            current_graph_task.set(outer)

    # ---- the steps of a pass, in order ---------------------------------------------------------------

    async def _enter(self, outer: GraphTask | None) -> _Trampoline | None:
        """A pass is a checkpoint on entry; returns the task's trampoline if the pass is nested on it."""
        if outer is None:
            return None
        tramp = _trampoline.get()
        if tramp is None or tramp.task is not trio.lowlevel.current_task():
            await trio.lowlevel.checkpoint()  # a nested pass in its own task, as any trio call
            return None
        # nested on this task's trampoline: a cancel point, and a schedule point when another task is ready
        # to run or this one has run for its time budget (a deep chain alone on the loop does not pay a
        # scheduler round per level)
        clock = time.perf_counter
        if clock() > tramp.budget_end:
            await trio.lowlevel.checkpoint()
            tramp.budget_end = clock() + TIME_BUDGET_S
        elif trio.lowlevel.current_statistics().tasks_runnable:
            await trio.lowlevel.checkpoint()
            # the tasks we yielded to may run after us in the loop's next batch (which we cannot see in the
            # statistics): the next pass entered yields once more
            tramp.budget_end = 0.0
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        return tramp

    def _start(self) -> Stream:
        """Take the awaiting task's stream and its device's apply lock, and set how far the caller may run
        ahead of its stream (see `_wait_ahead`)."""
        self.stream = task_stream = current_stream(self.rt.cpu)  # nodes that ran inline queue their backward here
        # alone on its lane, a stream lets its caller record up to RUN_AHEAD passes per wake-up of the loop;
        # on a shared lane the loop has the other streams' work to record meanwhile, and a deeper queue only
        # adds to the contention for the GIL (W3)
        marks = task_stream.pass_marks
        if task_stream.lane_to_itself():
            # the deeper run-ahead only for a training alone on its device: beside others, its longer
            # recording bursts would stall their lanes on the GIL too (measured on W3 at P=2 and 4)
            ahead = RUN_AHEAD if task_stream.device.pool.in_use <= 1 else 1
            self.start_seq, self.ahead_seq = marks[-1], marks[-ahead]
        else:
            self.start_seq = self.ahead_seq = task_stream.submitted
        marks.append(task_stream.submitted)
        del marks[0]
        self.lock = task_stream.device.apply_lock
        return task_stream

    async def _run_nodes(
        self, deps: Any, runs: set[Node] | None, buffers: Any, heap: list[Any] | None, nxt: Node | None,
        task_stream: Stream, tramp: _Trampoline | None,
    ) -> None:
        """Run ready nodes, latest-created first, until none is left; plain ones back to back with no
        ``await``, giving the loop back on the time budget."""
        heappop = heapq.heappop
        clock = time.perf_counter
        targets = self.targets
        release = not self.retain_graph
        kernels = not self.create_graph  # built-in nodes run their rule as one kernel
        node: Any
        gouts: Any
        gins: Any
        budget_end = clock() + TIME_BUDGET_S if tramp is None else tramp.budget_end
        while True:
            # nxt: the one ready node, kept off the heap while nothing else is ready
            if nxt is not None:
                node, nxt = nxt, None
            elif heap:
                node = heappop(heap)[1]
            else:
                return
            gouts = buffers.pop(node, None) if buffers is not None else None
            gins = None
            if gouts is not None and (gouts[0] is not None or any(g is not None for g in gouts)):
                if node._hooked or targets is not None:
                    gouts = run_pre_hooks(self, node, gouts)
                if runs is None or node in runs:
                    if kernels and type(node) is OpNode:  # the usual node: `_run_plain`'s first case, inline
                        gins = apply_op_kernel(node, gouts[0], task_stream)
                    elif not node.is_async:
                        gins = self._run_plain(node, gouts, task_stream)
                    else:
                        if not deps and not buffers:
                            # nothing left to count or to sum (a chain's usual state here): no node sends to
                            # another from now on, so keep no (tracked) dicts per level while it awaits
                            deps = buffers = None
                        gins = await self._run_async(node, gouts, tramp)
                        budget_end = clock() + TIME_BUDGET_S if tramp is None else tramp.budget_end
                    if node._hooked and node._post_hooks:
                        gins = run_post_hooks(node, gins, gouts)
                    if release:
                        node.release()
                gouts = None
            heap, nxt = self._send(node, gins, deps, buffers, heap, nxt)
            if clock() > budget_end:
                await self._yield_lock()
                budget_end = clock() + TIME_BUDGET_S
                if tramp is not None:
                    tramp.budget_end = budget_end

    def _run_plain(self, node: Node, gouts: list[Any], task_stream: Stream) -> list[Any]:
        """A built-in op's rule (one kernel, or recorded ops under create_graph) or a plain Function."""
        if type(node) is OpNode:
            if self.create_graph:
                return apply_op_graph(node, gouts[0])
            return apply_op_kernel(node, gouts[0], task_stream)
        return apply_function(node, gouts)

    async def _run_async(self, node: Any, gouts: list[Any], tramp: _Trampoline | None) -> list[Any]:
        """An ``async def`` backward: the device (and the loop) go to others while it awaits, and no other
        pass enters the node until it is done (the no-reentrant-apply invariant)."""
        self._release()
        try:
            if node._busy is not None:
                await self._wait_until_free(node)
            node._busy = self
            try:
                # the backward runs right in this coroutine (the passes it awaits are handed to this task's
                # trampoline); the first async node of a task starts the trampoline (see `_Trampoline`)
                try:
                    r = node.fn_cls.backward(node.ctx, *node.prepare_grads(gouts))
                    r = await (r if tramp is not None or trampoline_here() else _drive(r))
                except Exception as exc:
                    # the user's exception as it is, naming this node on its way out of every pass it crosses
                    note_failure(exc, f"raised in the backward of {node.name()}")
                    raise
                return check_function_grads(node, r)
            finally:
                self._leave(node)
        finally:
            await self._acquire()

    def _send(
        self, node: Node, gins: list[Any] | None, deps: Any, buffers: Any, heap: list[Any] | None,
        nxt: Node | None,
    ) -> tuple[list[Any] | None, Node | None]:
        """Send ``node``'s input gradients along its edges: sum them into the next nodes' buffers (a node
        whose senders have all sent becomes ready) or stage them for the leaves. Returns (heap, nxt)."""
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
                    continue
                del deps[tgt]  # ready: nothing else sends to it (a suspended pass keeps less)
                if nxt is None and not heap:
                    nxt = tgt  # a chain: no priority to keep, skip the heap
                    continue
                if heap is None:
                    heap = []
                if nxt is not None:
                    heapq.heappush(heap, (-nxt.seq, nxt))
                    nxt = None
                heapq.heappush(heap, (-tgt.seq, tgt))
            elif g is not None:
                self._to_leaf(tgt, g)
        return heap, nxt

    async def _wait_ahead(self, task_stream: Stream) -> None:
        """Let the caller run ahead of its stream, never waiting for the pass's own kernels.

        Shared, wait for the work queued before this pass. Alone on a lane, wait only once the lane is
        behind the start of the pass RUN_AHEAD back, and then until it reaches the previous pass's start:
        the caller then records RUN_AHEAD steps per wake-up, and each wake-up (the loop's trio round trip,
        the lane stalled on the GIL meanwhile) is paid once per RUN_AHEAD steps (W1).
        """
        if not task_stream.is_done(self.ahead_seq):
            await task_stream.synchronize(self.start_seq)
            self.slept = True
        else:
            task_stream.check_error()

    # ---- the device's apply lock ----------------------------------------------------------------------

    async def _acquire(self) -> None:
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            await self.lock.acquire()
        self.held = True

    def _release(self) -> None:
        self.held = False
        self.lock.release()

    async def _yield_lock(self) -> None:
        """Give the device and the loop to others for a moment (the time budget ran out)."""
        self._release()
        await trio.lowlevel.checkpoint()
        await self._acquire()

    def _seed(
        self, outputs: list[Tensor], grads: list[Tensor]
    ) -> tuple[dict[Node, int], set[Node] | None, dict[Node, list[Any]], list[Any] | None, Node | None]:
        """Dependency counts, the nodes to run (None: all), the gradient buffers seeded with ``grads``, and
        the heap of the nodes ready to run (None when at most one is: then that node, else None)."""
        roots = [(t._grad_fn, t._out_nr) if t._grad_fn is not None else (t, 0) for t in outputs]
        deps, runs = count_dependencies(roots, self.targets if self.parent is None else None)
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
