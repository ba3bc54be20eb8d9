"""The backward engine: one graph task per `backward()` / `grad()` call.

A graph task counts each node's dependencies, then runs ready nodes (latest-created first, like
PyTorch) until none is left. A built-in node's rule runs as a single kernel on the node's stream (or
inline when tiny); plain nodes run back to back with no ``await``, and the loop gets control back on a
time budget. Leaf gradients are *staged* and committed only when the whole pass succeeded, so a
failed or cancelled pass leaves every `.grad` as it was.
"""

from __future__ import annotations

import heapq
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

from ..devices import INLINE_MAX_ELEMENTS, Stream
from . import _grad_mode
from ._dispatch import Node, OpNode, wait_for
from ._layout import accumulate
from ._runtime import Runtime, current_runtime, current_stream
from ._tensor import Tensor
from ._xp import AG, NP, sum_to

# the loop gets control back at least this often while a pass runs nodes back to back
TIME_BUDGET_S = 0.002

_RETAIN_MSG = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they "
    "have already been freed). Saved intermediate values of the graph are freed when you call "
    "backward() or grad(). Specify retain_graph=True if you need to backward through the graph a "
    "second time or if you need to access saved tensors after calling backward."
)


class BackwardError(RuntimeError):
    """A backward function or hook raised; the pass was abandoned and no `.grad` was changed."""


def _edge(t: Tensor) -> tuple[Any, int]:
    return (t._grad_fn, t._out_nr) if t._grad_fn is not None else (t, 0)


def _root_grads(
    what: str, outputs: Sequence[Tensor], grads: Sequence[Any] | None
) -> list[Tensor]:
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
                raise RuntimeError(
                    f"{what}: grad can be implicitly created only for scalar outputs, but the output has shape "
                    f"{t._shape}; pass gradient= (a tensor of shape {t._shape}) to backward()"
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


class GraphTask:
    """The state of one backward pass. Owned by the task that awaits it; never shared."""

    def __init__(self, rt: Runtime, *, retain_graph: bool, create_graph: bool, targets: Any) -> None:
        self.rt = rt
        self.retain_graph = retain_graph
        self.create_graph = create_graph
        self.targets = targets  # None: accumulate into every leaf; else a set of target keys
        self.capture: dict[Any, Tensor] = {}
        self.staged: dict[int, list[Any]] = {}  # id(leaf) -> [leaf, grad]
        self.retained: list[tuple[Tensor, Tensor]] = []
        self.streams: set[Stream] = set()
        self.stream = current_stream(rt.cpu)  # the caller's stream: default for nodes that ran inline
        self.streams.add(self.stream)

    # -- discovery ---------------------------------------------------------------------------------

    def _discover(self, roots: list[tuple[Any, int]]) -> tuple[dict[Node, int], set[Node] | None]:
        deps: dict[Node, int] = {}
        seen: set[Node] = set()
        stack = [n for n, _ in roots if isinstance(n, Node)]
        seen.update(stack)
        order: list[Node] = []
        while stack:
            node = stack.pop()
            if node._released:
                raise RuntimeError(_RETAIN_MSG)
            order.append(node)
            for e in node.next:
                if e is None:
                    continue
                tgt = e[0]
                if isinstance(tgt, Node):
                    deps[tgt] = deps.get(tgt, 0) + 1
                    if tgt not in seen:
                        seen.add(tgt)
                        stack.append(tgt)
        if self.targets is None:
            return deps, None
        # with explicit inputs, run only nodes from which some input is reachable
        runs: set[Node] = set()
        targets = self.targets
        for node in reversed(_topo(order)):
            for e in node.next:
                if e is None:
                    continue
                tgt = e[0]
                if isinstance(tgt, Node):
                    if tgt in runs or (tgt, e[1]) in targets:
                        runs.add(node)
                        break
                elif id(tgt) in targets:
                    runs.add(node)
                    break
        return deps, runs

    # -- execution ---------------------------------------------------------------------------------

    async def run(self, outputs: list[Tensor], grads: list[Tensor]) -> None:
        roots = [_edge(t) for t in outputs]
        deps, runs = self._discover(roots)
        create = self.create_graph
        buffers: dict[Node, list[Any]] = {}
        heap: list[tuple[int, Node]] = []
        for (node, nr), g in zip(roots, grads):
            if isinstance(node, Node):
                self._add_to_buffer(buffers, node, nr, g)
            else:
                self._to_leaf(node, g)
        for node in buffers:
            if deps.get(node, 0) == 0:
                heapq.heappush(heap, (-node.seq, node))
        budget_end = time.perf_counter() + TIME_BUDGET_S
        heappop, heappush, clock = heapq.heappop, heapq.heappush, time.perf_counter
        release = not self.retain_graph
        targets = self.targets
        apply_plain = self._apply_plain
        streams, task_stream = self.streams, self.stream
        with _grad_mode.set_grad_enabled(create):
            while heap:
                node = heappop(heap)[1]
                gouts = buffers.pop(node, None)
                gins = None
                if gouts is not None and (gouts[0] is not None or any(g is not None for g in gouts)):
                    if node._tensor_pre_hooks or node._pre_hooks or node._retained or targets is not None:
                        gouts = self._pre(node, gouts)
                    if runs is None or node in runs:
                        if type(node) is OpNode and not create:
                            st = node.stream
                            if st is not None and st not in streams:
                                streams.add(st)
                            gins = _apply_op_kernel(node, gouts[0], task_stream)
                        elif node.is_async:
                            gins = await self._apply(node, gouts)
                        else:
                            gins = apply_plain(node, gouts)
                        if node._post_hooks:
                            gins = _run_post_hooks(node, gins, gouts)
                        if release:
                            node.release()
                i = -1
                for e in node.next:
                    i += 1
                    if e is None:
                        continue
                    tgt = e[0]
                    g = gins[i] if gins is not None else None
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
                            heappush(heap, (-tgt.seq, tgt))
                    elif g is not None:
                        self._to_leaf(tgt, g)
                if clock() > budget_end:
                    await trio.lowlevel.checkpoint()
                    budget_end = clock() + TIME_BUDGET_S
            self._leaf_hooks()
        for st in self.streams:
            await st.synchronize()

    def _add_to_buffer(self, buffers: dict[Node, list[Any]], node: Node, nr: int, g: Tensor) -> None:
        buf = buffers.get(node)
        if buf is None:
            buf = buffers[node] = [None] * node.n_outputs
        old = buf[nr]
        buf[nr] = g if old is None else old + g

    def _to_leaf(self, leaf: Tensor, g: Tensor) -> None:
        if self.targets is not None and id(leaf) not in self.targets:
            return
        entry = self.staged.get(id(leaf))
        if entry is None:
            self.staged[id(leaf)] = [leaf, g]
        else:
            entry[1] = entry[1] + g

    def _pre(self, node: Node, gouts: list[Any]) -> list[Any]:
        tph = node._tensor_pre_hooks
        if tph:
            for nr, table in tph.items():
                for fn in list(table.values()):
                    r = _call_hook(fn, node, gouts[nr])
                    if r is not None:
                        gouts[nr] = _check_hook_grad(node, gouts[nr], r)
        if node._pre_hooks:
            for fn in list(node._pre_hooks.values()):
                r = _call_hook(fn, node, tuple(gouts))
                if r is not None:
                    gouts = list(r)
        if node._retained:
            for nr, ref in node._retained.items():
                t = ref()
                if t is not None and gouts[nr] is not None:
                    self.retained.append((t, gouts[nr]))
        if self.targets is not None:
            for nr in range(len(gouts)):
                if (node, nr) in self.targets and gouts[nr] is not None:
                    self.capture[(node, nr)] = gouts[nr]
        return gouts

    def _leaf_hooks(self) -> None:
        for entry in self.staged.values():
            leaf, g = entry
            if leaf._hooks:
                for fn in list(leaf._hooks.values()):
                    r = _call_hook(fn, None, g, leaf)
                    if r is not None:
                        g = _check_hook_grad(None, g, r, leaf)
                entry[1] = g

    def _apply_plain(self, node: Node, gouts: list[Any]) -> list[Any]:
        if type(node) is OpNode:
            if self.create_graph:
                return _apply_op_graph(node, gouts[0])
            st = node.stream
            if st is not None and st not in self.streams:
                self.streams.add(st)
            return _apply_op_kernel(node, gouts[0], self.stream)
        return _apply_function(node, gouts, self)

    async def _apply(self, node: Node, gouts: list[Any]) -> list[Any]:
        from ._function import FunctionNode

        assert isinstance(node, FunctionNode)
        ctx = node.ctx
        grads = node.prepare_grads(gouts)
        try:
            r = await node.fn_cls.backward(ctx, *grads)
        except (trio.Cancelled, BackwardError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise BackwardError(f"exception in the backward of {node.name()}: {type(e).__name__}: {e}") from e
        return _check_function_grads(node, r)

    # -- commit ------------------------------------------------------------------------------------

    def commit(self) -> None:
        """Write staged gradients into `.grad` (no await inside: atomic with respect to other tasks)."""
        items = list(self.staged.values())
        self.staged.clear()
        post: list[Tensor] = []
        while items:
            entry = items.pop()
            leaf, g = entry
            entry.clear()
            # who else holds g? here: the local `g` and getrefcount's argument; a stealable array is
            # referenced by g alone (and owns its memory, or its base is referenced by it alone)
            arr = g._data
            unique = (
                sys.getrefcount(g) == 2
                and arr is not None
                and sys.getrefcount(arr) == 3
                and (arr.base is None or sys.getrefcount(arr.base) == 2)
            )
            del arr
            accumulate(self.rt, leaf, g, self.create_graph, unique)
            if leaf._post_hooks:
                post.append(leaf)
        for t, g in self.retained:
            t._grad = g if self.create_graph else g.detach()
        self.retained.clear()
        for leaf in post:
            for fn in list(leaf._post_hooks.values()):
                fn(leaf)


def _topo(order: list[Node]) -> list[Node]:
    """Nodes in an order where every node comes before the nodes it sends gradients to."""
    indeg: dict[Node, int] = {}
    for n in order:
        for e in n.next:
            if e is not None and isinstance(e[0], Node):
                indeg[e[0]] = indeg.get(e[0], 0) + 1
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


def _call_hook(fn: Any, node: Node | None, *args: Any) -> Any:
    try:
        return fn(*args[:1])
    except (trio.Cancelled, KeyboardInterrupt):
        raise
    except Exception as e:
        where = node.name() if node is not None else "a leaf tensor"
        raise BackwardError(f"exception in a hook on {where}: {type(e).__name__}: {e}") from e


def _check_hook_grad(node: Node | None, old: Tensor, new: Any, leaf: Tensor | None = None) -> Tensor:
    if not isinstance(new, Tensor) or new._shape != old._shape:
        where = node.name() if node is not None else "a leaf tensor"
        got = new._shape if isinstance(new, Tensor) else type(new).__name__
        raise BackwardError(
            f"a hook on {where} returned {got} but the gradient has shape {old._shape}; "
            "a hook must return None or a Tensor of the same shape"
        )
    return new


def _run_post_hooks(node: Node, gins: list[Any], gouts: list[Any]) -> list[Any]:
    for fn in list(node._post_hooks.values()):
        try:
            r = fn(tuple(gins), tuple(gouts))
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception as e:
            raise BackwardError(f"exception in a hook on {node.name()}: {type(e).__name__}: {e}") from e
        if r is not None:
            gins = list(r)
    return gins


# ---- applying built-in nodes ----------------------------------------------------------------------


def _ready(t: Any) -> bool:
    s = t._stream
    return s is None or s._completed >= t._seq


def _apply_op_kernel(node: OpNode, g: Tensor, task_stream: Stream) -> list[Any]:
    """Run the node's rule on numpy arrays: inline when tiny and ready, else as one kernel on its stream."""
    args, out = node.args, node.out
    gd = g._data
    s = g._stream
    if gd is not None and gd.size <= INLINE_MAX_ELEMENTS and (s is None or s._completed >= g._seq):
        arrays = []
        for a in args:
            if isinstance(a, Tensor):
                s = a._stream
                if s is not None and s._completed < a._seq:
                    break
                arrays.append(a._data)
            else:
                arrays.append(a)
        else:
            if out is None:
                gs = _run_rule(node, NP, gd, arrays, None)
            elif _ready(out):
                gs = _run_rule(node, NP, gd, arrays, out._data)
            else:
                gs = None
            if gs is not None:
                dev = g._dev
                wrap = Tensor._wrap
                return [None if x is None else wrap(x, dev) for x in gs]
    stream = node.stream or task_stream
    wait_for(g, stream)
    for a in args:
        if isinstance(a, Tensor):
            wait_for(a, stream)
    if out is not None:
        wait_for(out, stream)
    dev = stream.device
    results = [
        Tensor._pending(a._shape, a._dtype, dev, stream) if need else None
        for a, need in zip(args, node.needs)
    ]
    view = _NodeView(node.op, node.kw, node.needs)

    def job() -> None:
        arrays = [a._data if isinstance(a, Tensor) else a for a in args]
        gs = _run_rule(view, NP, g._data, arrays, None if out is None else out._data)
        for r, x in zip(results, gs):
            if r is not None:
                r._data = x

    seq = stream.submit(job)
    for r in results:
        if r is not None:
            r._seq = seq
    return results


class _NodeView:
    """What a queued rule kernel needs of its node (the node itself may be released meanwhile)."""

    __slots__ = ("kw", "needs", "op")

    def __init__(self, op: Any, kw: Any, needs: Any) -> None:
        self.op, self.kw, self.needs = op, kw, needs

    def name(self) -> str:
        from ._dispatch import _camel

        return f"{_camel(self.op.name)}Backward"


def _run_rule(node: Any, xp: Any, g: Any, arrays: list[Any], out: Any) -> list[Any]:
    """Call the op's rule, then check and fix up what it returned (count, broadcast shape, dtype)."""
    op, needs = node.op, node.needs
    gs = op.rule(xp, g, arrays, out, node.kw, needs)
    if len(gs) != len(arrays):
        raise RuntimeError(
            f"backward rule of {op.name} returned {len(gs)} gradients, expected {len(arrays)} (one per input)"
        )
    res: list[Any] = []
    for i, x in enumerate(gs):
        if not needs[i]:
            res.append(None)
            continue
        a = arrays[i]
        if x is None:
            raise RuntimeError(f"backward rule of {op.name} returned no gradient for input {i}")
        shape = a.shape
        if x.shape != shape:
            try:
                x = sum_to(xp, x, tuple(shape))
            except ValueError as e:
                raise RuntimeError(f"backward rule of {op.name}, input {i}: {e}") from None
        if x.dtype != a.dtype:
            x = xp.astype(x, a.dtype)
        res.append(x)
    return res


def _apply_op_graph(node: OpNode, g: Tensor) -> list[Any]:
    """``create_graph=True``: run the rule with asyncgrad ops so the backward is recorded."""
    if not hasattr(AG, "sum"):
        AG._bind()
    return _run_rule(node, AG, g, list(node.args), node.out)


def _apply_function(node: Any, gouts: list[Any], task: GraphTask) -> list[Any]:
    from ._function import FunctionNode

    assert isinstance(node, FunctionNode)
    grads = node.prepare_grads(gouts)
    token = _in_plain_backward.set(node.name())
    try:
        r = node.fn_cls.backward(node.ctx, *grads)
    except (trio.Cancelled, BackwardError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise BackwardError(f"exception in the backward of {node.name()}: {type(e).__name__}: {e}") from e
    finally:
        _in_plain_backward.reset(token)
    return _check_function_grads(node, r)


def _check_function_grads(node: Any, r: Any) -> list[Any]:
    grads = list(r) if isinstance(r, tuple) else [r]
    n = node.n_args
    if len(grads) > n and all(g is None for g in grads[n:]):
        grads = grads[:n]
    if len(grads) != n:
        raise BackwardError(
            f"{node.name()}: backward returned {len(grads)} gradients, but forward had {n} inputs; "
            "return one gradient (or None) per forward input"
        )
    out = []
    for i, (g, e) in enumerate(zip(grads, node.next)):
        if e is None or g is None:
            out.append(None)
            continue
        if not isinstance(g, Tensor):
            raise BackwardError(f"{node.name()}: backward returned {type(g).__name__} for input {i}, expected a Tensor")
        tgt = e[0]
        shape = tgt._shape if isinstance(tgt, Tensor) else None
        if shape is None:
            shape = _input_shape(node, i)
        if shape is not None and g._shape != shape:
            try:
                g = sum_to(_ag(), g, shape)
            except ValueError:
                raise BackwardError(
                    f"{node.name()}: backward returned a gradient of shape {g._shape} for input {i}, "
                    f"which has shape {shape}"
                ) from None
        out.append(g)
    return out


def _input_shape(node: Any, i: int) -> tuple[int, ...] | None:
    shapes = getattr(node.ctx, "_input_shapes", None)
    return None if shapes is None else shapes[i]


def _ag() -> Any:
    if not hasattr(AG, "sum"):
        AG._bind()
    return AG


import contextvars  # noqa: E402

_in_plain_backward: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "asyncgrad_in_plain_backward", default=None
)


def _check_not_plain(what: str) -> None:
    name = _in_plain_backward.get()
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


async def _run_task(task: GraphTask, outputs: list[Tensor], grads: list[Tensor]) -> None:
    rt = task.rt
    rt.graph_tasks_started += 1
    try:
        await task.run(outputs, grads)
        if task.targets is None or task.staged or task.retained:
            task.commit()
    finally:
        rt.graph_tasks_finished += 1


def backward(
    tensors: Sequence[Tensor],
    grad_tensors: Sequence[Any] | None = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> Any:
    """Start a backward pass from ``tensors``; returns an awaitable. See `Tensor.backward`."""
    _check_not_plain("backward()")
    rt = current_runtime("backward()")
    outputs = _as_list(tensors)
    grads = _root_grads("backward", outputs, None if grad_tensors is None else _as_list(grad_tensors))
    targets = None
    if inputs is not None:
        ins = _as_list(inputs)
        if not ins:
            raise RuntimeError("backward: inputs= must be a non-empty sequence of tensors")
        targets = set()
        for t in ins:
            if not isinstance(t, Tensor) or not t._rg:
                raise RuntimeError("backward: every tensor in inputs= must require grad")
            if t._grad_fn is None:
                targets.add(id(t))
            else:
                t.retain_grad()
                targets.add((t._grad_fn, t._out_nr))
    task = GraphTask(
        rt,
        retain_graph=create_graph if retain_graph is None else retain_graph,
        create_graph=create_graph,
        targets=targets,
    )
    return _run_task(task, outputs, grads)


def grad(
    outputs: Any,
    inputs: Any,
    grad_outputs: Any = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
) -> Any:
    """Gradients of ``outputs`` w.r.t. ``inputs``, returned (not accumulated into `.grad`); await it.

    Returns a tuple with one entry per input. An input the outputs do not depend on raises, unless
    ``allow_unused=True`` (then its entry is None).
    """
    _check_not_plain("grad()")
    rt = current_runtime("grad()")
    outs = _as_list(outputs)
    ins = _as_list(inputs)
    if not ins:
        raise RuntimeError("grad: inputs must be a non-empty sequence of tensors")
    for t in ins:
        if not isinstance(t, Tensor) or not t._rg:
            raise RuntimeError("grad: One of the differentiated Tensors does not require grad")
    grads = _root_grads("grad", outs, None if grad_outputs is None else _as_list(grad_outputs))
    keys = [id(t) if t._grad_fn is None else (t._grad_fn, t._out_nr) for t in ins]
    task = GraphTask(
        rt,
        retain_graph=create_graph if retain_graph is None else retain_graph,
        create_graph=create_graph,
        targets=set(keys),
    )
    return _grad(task, outs, grads, ins, keys, allow_unused)


async def _grad(
    task: GraphTask, outs: list[Tensor], grads: list[Tensor], ins: list[Tensor], keys: list[Any], allow_unused: bool
) -> tuple[Tensor | None, ...]:
    # leaf targets are captured instead of accumulated: take them out of the staging area
    task.rt.graph_tasks_started += 1
    try:
        await task.run(outs, grads)
    finally:
        task.rt.graph_tasks_finished += 1
    res: list[Tensor | None] = []
    for t, k in zip(ins, keys):
        if t._grad_fn is None:
            entry = task.staged.get(k)
            g = None if entry is None else entry[1]
        else:
            g = task.capture.get(k)
        if g is None and not allow_unused:
            raise RuntimeError(
                "grad: one of the differentiated Tensors appears to not have been used in the graph; "
                "set allow_unused=True if this is the desired behavior"
            )
        if g is not None and not task.create_graph:
            g = g.detach()
        res.append(g)
    return tuple(res)
