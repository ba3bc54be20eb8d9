"""The backward engine: a graph task per `backward()` / `grad()` call.

A graph task counts each node's dependencies, then runs ready nodes (latest-created first, like
PyTorch) until none is left. Plain nodes run back to back with no ``await`` while the task holds its
device's apply lock; the lock (and the event loop) is given back on a time budget and around every
``async def`` backward, which may run a nested pass: that pass is a separate graph task in its own trio
task, so depth costs one suspended task per level, never Python stack. An async node is entered by one
pass at a time (the no-reentrant-apply invariant). Leaf gradients are staged and handed to their
owners (`_registry`) only when the whole pass succeeded.
"""

from __future__ import annotations

import heapq
import time
from typing import Any

import trio

from ..devices import Stream
from . import _grad_mode
from ._apply import (
    BackwardError,
    apply_function,
    apply_function_async,
    apply_op_graph,
    apply_op_kernel,
)
from ._dispatch import Node, OpNode
from ._tensor import Tensor

# while a pass runs nodes back to back, the loop gets control back at least this often
TIME_BUDGET_S = 0.002

RETAIN_MSG = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they "
    "have already been freed). Saved intermediate values of the graph are freed when you call "
    "backward() or grad(). Specify retain_graph=True if you need to backward through the graph a "
    "second time or if you need to access saved tensors after calling backward."
)


class GraphTask:
    """The state of one backward pass; owned by the trio task that runs it and shared with nobody."""

    __slots__ = ("capture", "create_graph", "parent", "retain_graph", "retained", "staged", "start_seq",
                 "stream", "targets")

    def __init__(
        self,
        stream: Stream,
        *,
        retain_graph: bool,
        create_graph: bool,
        targets: set[Any] | None,
        parent: GraphTask | None = None,
    ) -> None:
        self.stream = stream  # the caller's stream: nodes that ran inline queue their backward here
        self.retain_graph = retain_graph
        self.create_graph = create_graph
        self.targets = targets  # None: every leaf; else the keys of the inputs to stop at
        self.parent = parent  # leaves outside `targets` are staged into the parent (checkpoint)
        self.capture: dict[Any, Tensor] = {}
        self.staged: dict[int, list[Any]] = {}  # id(leaf) -> [leaf, summed grad]
        self.retained: list[tuple[Tensor, Tensor]] = []
        self.start_seq = stream._submitted

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

    async def run(self, outputs: list[Tensor], grads: list[Tensor]) -> None:
        """Run the pass from ``outputs`` (seeded with ``grads``) until no node is left."""
        roots = [(t._grad_fn, t._out_nr) if t._grad_fn is not None else (t, 0) for t in outputs]
        deps, runs = self._discover(roots)
        buffers: dict[Node, list[Any]] = {}
        for (node, nr), g in zip(roots, grads):
            if isinstance(node, Node):
                buf = buffers.setdefault(node, [None] * node.n_outputs)
                buf[nr] = g if buf[nr] is None else buf[nr] + g
            else:
                self._to_leaf(node, g)
        heap = [(-n.seq, n) for n in buffers if deps.get(n, 0) == 0]
        heapq.heapify(heap)
        hold = _DeviceHold(self.stream.device.apply_lock)
        await hold.acquire()
        try:
            await self._loop(heap, buffers, deps, runs, hold)
        finally:
            if hold.held:
                hold.release()
        # let the caller run at most one pass ahead of its stream: wait for the work queued before this
        # pass, not for the pass's own kernels (they overlap with whatever the caller records next)
        await self.stream.synchronize(self.start_seq)

    async def _loop(self, heap: list[Any], buffers: dict[Node, list[Any]], deps: dict[Node, int],
                    runs: set[Node] | None, lock: _DeviceHold) -> None:
        heappop, heappush, clock = heapq.heappop, heapq.heappush, time.perf_counter
        create, release, targets = self.create_graph, not self.retain_graph, self.targets
        task_stream = self.stream
        budget_end = clock() + TIME_BUDGET_S
        nxt: Any = None  # the one ready node, kept off the heap while nothing else is ready
        with _grad_mode.set_grad_enabled(create):
            while True:
                if nxt is not None:
                    node, nxt = nxt, None
                elif heap:
                    node = heappop(heap)[1]
                else:
                    break
                gouts = buffers.pop(node, None)
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
                            # give the device (and the loop) to others while this backward awaits
                            lock.release()
                            try:
                                gins = await _apply_exclusive(node, gouts)
                            finally:
                                await lock.acquire()
                            budget_end = clock() + TIME_BUDGET_S
                        else:
                            gins = apply_function(node, gouts)
                        if node._hooked and node._post_hooks:
                            gins = _run_post_hooks(node, gins, gouts)
                        if release:
                            node.release()
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
                        deps[tgt] = left
                        if left == 0:
                            if nxt is None and not heap:
                                nxt = tgt  # a chain: no priority to keep, skip the heap
                            else:
                                if nxt is not None:
                                    heappush(heap, (-nxt.seq, nxt))
                                    nxt = None
                                heappush(heap, (-tgt.seq, tgt))
                    elif g is not None:
                        self._to_leaf(tgt, g)
                if clock() > budget_end:
                    lock.release()
                    await trio.lowlevel.checkpoint()
                    await lock.acquire()
                    budget_end = clock() + TIME_BUDGET_S

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
                    self.retained.append((t, gouts[nr]))
        if node._pre_hooks:
            for fn in list(node._pre_hooks.values()):
                r = call_hook(fn, node, tuple(gouts))
                if r is not None:
                    gouts = check_hook_grads(node, "pre-hook", gouts, r)
        if self.targets is not None:
            for nr in range(len(gouts)):
                if (node, nr) in self.targets and gouts[nr] is not None:
                    self.capture[(node, nr)] = gouts[nr]
        return gouts


class _DeviceHold:
    """The device's apply lock, remembering whether this pass holds it right now."""

    __slots__ = ("held", "lock")

    def __init__(self, lock: trio.Lock) -> None:
        self.lock = lock
        self.held = False

    async def acquire(self) -> None:
        try:
            self.lock.acquire_nowait()  # uncontended: no schedule point (the pass yields on its budget)
        except trio.WouldBlock:
            await self.lock.acquire()
        self.held = True

    def release(self) -> None:
        self.held = False
        self.lock.release()


async def _apply_exclusive(node: Any, gouts: list[Any]) -> list[Any]:
    """Run an async node's backward with no other pass inside the same node at the same time."""
    while node._busy is not None:
        await node._busy.wait()
    if node._released:
        raise RuntimeError(RETAIN_MSG)  # the pass we waited for freed it
    ev = node._busy = trio.Event()
    try:
        return await apply_function_async(node, gouts)
    finally:
        node._busy = None
        ev.set()


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
    try:
        return fn(arg)
    except (trio.Cancelled, KeyboardInterrupt):
        raise
    except Exception as e:
        where = node.name() if node is not None else "a leaf tensor"
        raise BackwardError(f"exception in a hook on {where}: {type(e).__name__}: {e}") from e


def check_hook_grad(node: Node | None, old: Tensor, new: Any) -> Tensor:
    if not isinstance(new, Tensor) or new._shape != old._shape:
        where = node.name() if node is not None else "a leaf tensor"
        got = new._shape if isinstance(new, Tensor) else type(new).__name__
        raise BackwardError(
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
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception as e:
            raise BackwardError(f"exception in a hook on {node.name()}: {type(e).__name__}: {e}") from e
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
