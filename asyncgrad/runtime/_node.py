"""Backward nodes: what a recorded op (or `Function`) keeps for its backward, and where gradients go next.

A node holds its edges (``next``: per input, the producing node and its output slot, the leaf itself, or
None), its creation order (later nodes run first), its stream, and, for a built-in op, the args the rule
reads with their versions at record time (PyTorch's "modified by an inplace operation" check).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..devices import Stream
from ._hooks import HookTable, RemovableHandle, add_hook
from ._op import EMPTY, Op, camel
from ._tensor import Tensor

_node_seq = itertools.count(1)



class Node:
    """A backward node: where gradients go next (``next``), hooks, and what the backward needs.

    Subclasses: `OpNode` (built-in ops, rules from the op table) and ``FunctionNode`` (`Function`).
    """

    # hot fields are slots; rarely set ones (hooks, release flag) live in __dict__ with class defaults,
    # so creating a node per op sets only what every node needs
    __slots__ = ("__dict__", "__weakref__", "next", "seq", "stream")

    next: tuple[Any, ...]  # per input: (node, output slot), (leaf tensor, 0), or None
    seq: int  # creation order: later nodes run first
    stream: Stream | None  # the forward op's stream (None: it ran inline)

    is_async = False
    n_outputs = 1
    _released = False
    _pre_hooks: Any = None
    _post_hooks: Any = None
    _tensor_pre_hooks: dict[int, Any] | None = None
    _retained: dict[int, Any] | None = None
    _busy: Any = None  # the GraphTask running this (async) node's backward now; None when no pass is inside it
    _hooked = False  # any hook or retain_grad on this node: one flag for the engine to test

    def _init_node(self, stream: Stream | None) -> None:
        self.stream = stream
        self.seq = next(_node_seq)

    def name(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name()} object>"

    def tensor_positions(self) -> list[int]:
        """Which inputs are tensors (hooks and `next_functions` leave out Python numbers, like PyTorch)."""
        return list(range(len(self.next)))

    @property
    def next_functions(self) -> tuple[tuple[Any, int], ...]:
        out: list[tuple[Any, int]] = []
        nxt = self.next
        for e in (nxt[i] for i in self.tensor_positions()):
            if e is None:
                out.append((None, 0))
            elif isinstance(e[0], Node):
                out.append(e)
            else:
                out.append((AccumulateGradView(e[0]), 0))
        return tuple(out)

    def register_prehook(self, fn: Callable[..., Any]) -> RemovableHandle:
        """``fn(grad_outputs) -> new grad_outputs or None`` runs before this node; returns a handle."""
        if self._pre_hooks is None:
            self._pre_hooks = HookTable()
        self._hooked = True
        return add_hook(self._pre_hooks, fn)

    def register_hook(self, fn: Callable[..., Any]) -> RemovableHandle:
        """``fn(grad_inputs, grad_outputs) -> new grad_inputs or None`` runs after; returns a handle."""
        if self._post_hooks is None:
            self._post_hooks = HookTable()
        self._hooked = True
        return add_hook(self._post_hooks, fn)



def edges_of(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[bool, ...]]:
    """Backward edges of a node with these inputs: (grad_fn, output slot), (leaf, 0) or None."""
    nxt: list[Any] = []
    needs: list[bool] = []
    for a in args:
        if isinstance(a, Tensor) and a._rg:
            fn = a._grad_fn
            nxt.append((fn, a._out_nr) if fn is not None else (a, 0))
            needs.append(True)
        else:
            nxt.append(None)
            needs.append(False)
    return tuple(nxt), tuple(needs)



class OpNode(Node):
    """A recorded application of a built-in op."""

    out: Any = None  # the output, saved only by ops whose rule needs it (save_out)

    __slots__ = ("_tpos", "args", "kw", "needs", "op", "ver")

    args: tuple[Any, ...] | None  # None once released
    ver: int  # the versions of the saved args when recorded, packed (see `saved_versions`)

    def __init__(self, op: Op, args: tuple[Any, ...], kw: dict[str, Any], stream: Stream | None) -> None:
        self.stream = stream
        self.seq = next(_node_seq)
        self.op = op
        self.args = args
        self.kw = kw
        self.next, self.needs = edges_of(args)
        self.ver = 0 if op.saves_none else saved_versions(op.saves, args)

    def _fast1(self, op: Op, a: Any) -> None:
        """__init__ for one tensor input that requires grad (no stream: the op ran inline)."""
        self.seq = next(_node_seq)
        self.op = op
        self.args = (a,)
        self.kw = EMPTY
        self.stream = None
        vc = a._vc  # `a._version` without the property call (per node)
        self.ver = vc[0] if vc is not None and op.saves0 else 0
        fn = a._grad_fn
        self.next = ((fn, a._out_nr) if fn is not None else (a, 0),)
        self.needs = _NEEDS1

    def _fast2s(self, op: Op, a: Any, b: Any) -> None:
        """__init__ for (tensor that requires grad, Python scalar)."""
        self.seq = next(_node_seq)
        self.op = op
        self.args = (a, b)
        self.kw = EMPTY
        self.stream = None
        vc = a._vc
        self.ver = vc[0] if vc is not None and op.saves0 else 0
        fn = a._grad_fn
        self.next = ((fn, a._out_nr) if fn is not None else (a, 0), None)
        self.needs = _NEEDS_TS

    def _fast2t(self, op: Op, a: Any, b: Any) -> None:
        """__init__ for two tensors (no stream: the op ran inline)."""
        self.seq = next(_node_seq)
        self.op = op
        args = self.args = (a, b)
        self.kw = EMPTY
        self.stream = None
        self.next, self.needs = edges_of(args)
        sv = op.saves
        if sv is None:
            va, vb = a._vc, b._vc  # `_version` without the property calls
            self.ver = (0 if va is None else va[0]) + (0 if vb is None else vb[0] << 32)
        else:
            self.ver = 0 if op.saves_none else saved_versions(sv, args)

    def name(self) -> str:
        return f"{camel(self.op.name)}Backward0"

    def tensor_positions(self) -> list[int]:
        # a released node no longer has its args; then every edge that exists counts
        if self.args is None:
            return [i for i, e in enumerate(self.next) if e is not None]
        pos = getattr(self, "_tpos", None)  # released down to shape stand-ins (`release`); a slot, unset before
        if pos is not None:
            return pos  # type: ignore[no-any-return]
        return [i for i, a in enumerate(self.args) if isinstance(a, Tensor)]

    def release(self) -> None:
        """Drop saved values (backward without retain_graph).

        A node whose rule reads no values (add, sum, reshape, indexing, ...) keeps only what its rule does
        read, its inputs' shapes and dtypes, as zero-byte stand-ins: as in PyTorch, which frees saved
        tensors only, a graph of such nodes can be run backward again.
        """
        args = self.args
        if args is not None and self.op.saves_none and self.out is None:
            # one pass over the args (this runs per node): the tensors' positions and their stand-ins; none
            # left means the args are stand-ins already (every node has a tensor input)
            pos = []
            stubs = []
            get = _shape_stubs.get
            for i, a in enumerate(args):
                if isinstance(a, Tensor):
                    pos.append(i)
                    stub = get((a._shape, a._dtype))
                    stubs.append(_shape_of(a) if stub is None else stub)
                else:
                    stubs.append(a)
            if pos:
                self._tpos = pos
                self.args = tuple(stubs)
            return
        self.args = None
        if self.out is not None:
            self.out = None

    @property
    def _released(self) -> bool:  # type: ignore[override]
        return self.args is None



_shape_stubs: dict[tuple[tuple[int, ...], Any], np.ndarray] = {}



def _shape_of(t: Any) -> np.ndarray:
    """A read-only array of ``t``'s shape and dtype holding one element (what a shape-only rule reads);
    shared per shape and dtype, since nothing writes into a rule's inputs (released nodes each step)."""
    key = (t._shape, t._dtype)
    stub = _shape_stubs.get(key)
    if stub is None:
        if len(_shape_stubs) >= 1024:
            _shape_stubs.clear()
        stub = _shape_stubs[key] = np.broadcast_to(np.empty((), t._dtype), t._shape)
    return stub



def saved_versions(saves: tuple[int, ...] | None, args: tuple[Any, ...]) -> int:
    """The current versions of the saved tensor args (``saves``; None: all), packed into one int: arg i's
    version in bits 32*i and up. Versions only grow, so any in-place write to one of them changes it."""
    v = 0
    if saves is None:
        sh = 0
        for a in args:
            # `a._vc` read directly, not through the `_version` property: this runs twice per node
            if isinstance(a, Tensor) and a._vc is not None:
                v += a._vc[0] << sh
            sh += 32
    else:
        for i in saves:
            a = args[i]
            if isinstance(a, Tensor) and a._vc is not None:
                v += a._vc[0] << (i << 5)
    return v



def check_saved_versions(node: OpNode) -> None:
    """Raise if a tensor ``node``'s backward reads was changed in place since the forward recorded it."""
    args: tuple[Any, ...] = node.args  # type: ignore[assignment]  # never called on a released node
    op = node.op
    out = node.out
    if op.save_out_side:
        out = None
    if op.saves_none and out is None:
        return
    now = 0 if op.saves_none else saved_versions(op.saves, args)
    n = len(args)
    if out is not None and out._vc is not None:
        now += out._vc[0] << (n << 5)  # the output was saved at version 0, when it was made
    if now == node.ver:
        return
    for i in range(n + 1):
        t = out if i == n else args[i]
        if t is None or not isinstance(t, Tensor):
            continue
        was = (node.ver >> (i << 5)) & 0xFFFFFFFF
        cur = t._version
        if (cur & 0xFFFFFFFF) != was:
            what = "its output" if i == n else f"input {i}"
            raise RuntimeError(
                f"a tensor that {node.name()} needs for its gradient was modified by an in-place operation: "
                f"{what}, of shape {tuple(t._shape)} and dtype {t._dtype}, is at version {cur} but was at "
                f"version {was} when it was saved; use an out-of-place op instead of the in-place one, or "
                "change a clone() of the tensor in place"
            )
    raise RuntimeError(  # a version past 2**32 wrapped its field: still a change, without the details
        f"a tensor that {node.name()} needs for its gradient was modified by an in-place operation; use an "
        "out-of-place op instead of the in-place one, or change a clone() of the tensor in place"
    )



_NEEDS1 = (True,)



_NEEDS_TS = (True, False)



class AccumulateGradView:
    """What `next_functions` shows for a leaf: PyTorch's AccumulateGrad, holding the leaf as `.variable`."""

    __slots__ = ("variable",)

    def __init__(self, variable: Tensor) -> None:
        self.variable = variable

    def name(self) -> str:
        return "AccumulateGrad"
