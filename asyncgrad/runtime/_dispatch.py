"""Op definitions and the forward dispatcher.

An `Op` couples a numpy kernel, a *meta* function (output shape and dtype, computed before the kernel
runs, so an op can return a tensor whose value is still being computed on a lane) and a backward *rule*.
Rules are written once against a small array namespace ``xp`` and run two ways: with numpy arrays as
one fused kernel on the node's stream (plain backward), or with Tensors on the loop thread so the
backward itself is recorded (``create_graph=True``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..devices import HOST_CACHE_MIN_BYTES, INLINE_MAX_ELEMENTS, Stream, lane_empty
from . import _grad_mode
from ._runtime import _NO_RUNTIME, NoRuntimeError, _current, current_stream

Rule = Callable[..., tuple[Any, ...]]
EMPTY: dict[str, Any] = {}
_node_seq = itertools.count(1)


_NUMERIC_DTYPES = [np.dtype(c) for c in "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]]
_FLOAT_DTYPES = frozenset(d for d in _NUMERIC_DTYPES if d.kind == "f")


class Op:
    """A differentiable (or not) operation: kernel, meta and backward rule, registered by name."""

    __slots__ = (
        "any_kind", "cast_in", "fast_dtypes", "fast_kinds", "fills_out", "kernel", "meta", "name", "rule",
        "save_out", "saves", "saves0", "saves_none", "view",
    )

    def __init__(
        self,
        name: str,
        kernel: Callable[..., Any],
        meta: Callable[..., tuple[tuple[int, ...], np.dtype[Any]]],
        rule: Rule | None = None,
        save_out: bool = False,
        cast_in: bool = False,
        fast_kinds: str = "",
        saves: tuple[int, ...] | None = None,
        view: bool = False,
    ) -> None:
        self.name = name
        # the kernel returns a view of arg 0 (reshape, permute, ...): the output shares its version counter
        self.view = view
        self.kernel = kernel
        self.meta = meta
        self.rule = rule
        self.save_out = save_out
        # the positional args whose values the rule reads (None: every tensor arg, the safe default): their
        # versions are recorded with the node and checked before its backward runs (PyTorch's "modified by
        # an inplace operation"); () for rules that read only shapes, dtypes or devices
        self.saves = saves
        self.saves_none = saves == ()
        self.saves0 = saves is None or 0 in saves  # reads arg 0 (the fast initialisers' one tensor)
        # the kernel computes in the result dtype: array operands of another dtype are cast first
        # (int / 2 divides in float32 like PyTorch, instead of in float64 and casting the result)
        self.cast_in = cast_in
        # elementwise ops (`apply1`/`apply2`): the dtype kinds for which the kernel, given operands of
        # one dtype (or a Python int/bool, or for "f"/"c" any Python number), already returns PyTorch's
        # result dtype, so the inline fast paths may skip the meta function
        self.fast_kinds = fast_kinds
        # the same as dtypes: a set lookup costs half of `dtype.kind in fast_kinds` on the per-op path
        self.fast_dtypes = frozenset(d for d in _NUMERIC_DTYPES if d.kind in fast_kinds)
        self.any_kind = fast_kinds == "biufc"  # then same-dtype operands skip the dtype test
        # a ufunc can write a large result into a buffer from the lane's host cache (see `_enqueue`)
        self.fills_out = isinstance(kernel, np.ufunc)

    def __repr__(self) -> str:
        return f"<Op {self.name}>"


OPS: dict[str, Op] = {}


def defop(
    name: str,
    kernel: Callable[..., Any],
    meta: Callable[..., Any],
    rule: Rule | None = None,
    *,
    save_out: bool = False,
    cast_in: bool = False,
    fast_kinds: str = "",
    saves: tuple[int, ...] | None = None,
    view: bool = False,
) -> Op:
    """Register an op in the table (one entry per name; rules live next to their forwards)."""
    if name in OPS:
        raise ValueError(f"op {name!r} is already registered")
    op = OPS[name] = Op(name, kernel, meta, rule, save_out, cast_in, fast_kinds, saves, view)
    return op


class OpError(ValueError):
    """Bad input to an op: wrong shapes, dtypes or devices."""


Tensor: Any = None  # set by _tensor once the class exists (avoids an import per op)


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

    def register_prehook(self, fn: Callable[..., Any]) -> Any:
        """``fn(grad_outputs) -> new grad_outputs or None`` runs before this node; returns a handle."""
        from ._hooks import HookTable, add_hook

        if self._pre_hooks is None:
            self._pre_hooks = HookTable()
        self._hooked = True
        return add_hook(self._pre_hooks, fn)

    def register_hook(self, fn: Callable[..., Any]) -> Any:
        """``fn(grad_inputs, grad_outputs) -> new grad_inputs or None`` runs after; returns a handle."""
        from ._hooks import HookTable, add_hook

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

    __slots__ = ("args", "kw", "needs", "op", "ver")

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
        self.ver = a._version if op.saves0 else 0
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
        self.ver = a._version if op.saves0 else 0
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
            self.ver = a._version + (b._version << 32)
        else:
            self.ver = 0 if op.saves_none else saved_versions(sv, args)

    def name(self) -> str:
        return f"{_camel(self.op.name)}Backward0"

    def tensor_positions(self) -> list[int]:
        # a released node no longer has its args; then every edge that exists counts
        if self.args is None:
            return [i for i, e in enumerate(self.next) if e is not None]
        pos = self.__dict__.get("_tpos")  # released down to shape stand-ins (`release`)
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
            if "_tpos" not in self.__dict__:
                self.__dict__["_tpos"] = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
                self.args = tuple(_shape_of(a) if isinstance(a, Tensor) else a for a in args)
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
            if isinstance(a, Tensor):
                x = a._version
                if x:
                    v += x << sh
            sh += 32
    else:
        for i in saves:
            a = args[i]
            if isinstance(a, Tensor):
                v += a._version << (i << 5)
    return v


def check_saved_versions(node: OpNode) -> None:
    """Raise if a tensor ``node``'s backward reads was changed in place since the forward recorded it."""
    args: tuple[Any, ...] = node.args  # type: ignore[assignment]  # never called on a released node
    op = node.op
    if op.saves_none and node.out is None:
        return
    now = 0 if op.saves_none else saved_versions(op.saves, args)
    out = node.out
    n = len(args)
    if out is not None:
        now += out._version << (n << 5)  # the output was saved at version 0, when it was made
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


def _camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in name.split("_"))


def _no_runtime(op: Op) -> None:
    raise NoRuntimeError(_NO_RUNTIME.format(what=op.name))


def apply(op: Op, args: tuple[Any, ...], kw: dict[str, Any] = EMPTY) -> Any:
    """Run ``op`` on ``args``: inline when tiny and its inputs are ready, else queued on the task's stream."""
    rt = _current.get()
    if rt is None or rt.closed:
        _no_runtime(op)
    T = Tensor
    dev = None
    ready = True
    rg = False
    for a in args:
        if isinstance(a, T):
            if dev is None:
                dev = a._dev
            elif a._dev is not dev:
                _device_mismatch(op, args)
            s = a._stream
            # no array on a completed stream: its kernel was dropped (a failed stream, a closing runtime)
            if (s is not None and s._completed < a._seq) or a._data is None:
                ready = False
            if a._rg:
                rg = True
    if dev is None:
        raise TypeError(f"{op.name}: expected at least one Tensor argument")
    shape, dtype = op.meta(*args, **kw)
    kernel = _cast_kernel(op.kernel, args, dtype) if op.cast_in else op.kernel
    stream = None
    # inline needs only ready inputs: a new output cannot race with queued work (in-place updates mark
    # their tensor pending, so readers of it queue behind them)
    if ready and math.prod(shape) <= INLINE_MAX_ELEMENTS:
        res = kernel(*[a._data if isinstance(a, T) else a for a in args], **kw)
        # the meta dtype is the result's (PyTorch's promotion), whatever numpy would have given
        rd = res.dtype
        if rd is not dtype and rd != dtype:
            res = res.astype(dtype)
        out = T._wrap(res, dev)
    else:
        stream = current_stream(dev)
        out = _enqueue(op, kernel, args, kw, shape, dtype, dev, stream, T)
    if op.view:
        share_version(args[0], out)
    if rg and op.rule is not None and _grad_mode._grad_enabled.get():
        node = OpNode(op, args, kw, stream)
        if op.save_out:
            node.out = out
        out._grad_fn = node
        out._rg = True
    return out


def share_version(base: Any, view: Any) -> None:
    """``view`` shares ``base``'s memory: give it ``base``'s version counter (PyTorch's views), so an in-place
    write through either one is seen by a backward that saved the other."""
    vc = base._vc
    if vc is None:
        vc = base._vc = [0]
    view._vc = vc


_SCALARS = (int, float, bool)
_INT_SCALARS = (int, bool)


def _cast_kernel(kernel: Callable[..., Any], args: tuple[Any, ...], dtype: np.dtype[Any]) -> Callable[..., Any]:
    """``kernel``, computing in ``dtype``: array (and numpy scalar) operands of another dtype are cast first.

    Python numbers stay as they are (numpy treats them as weakly typed, like PyTorch's wrapped numbers)."""
    for a in args:
        if type(a) in _SCALARS:
            continue
        d = a._dtype if isinstance(a, Tensor) else getattr(a, "dtype", None)
        if d is not None and d is not dtype and d != dtype:
            break
    else:
        return kernel
    if isinstance(kernel, np.ufunc):
        # "unsafe": a lower-priority operand converts even across kinds (uint8 tensor + zero-dim int8
        # is uint8 in PyTorch, the int8 value wrapping), as PyTorch's conversion does
        ufunc = kernel
        return lambda *xs, **kw: ufunc(*xs, dtype=dtype, casting="unsafe", **kw)

    def cast(*xs: Any, **kw: Any) -> Any:
        return kernel(
            *[x.astype(dtype) if isinstance(x, (np.ndarray, np.generic)) and x.dtype != dtype else x for x in xs],
            **kw,
        )

    return cast


def apply1(op: Op, a: Any) -> Any:
    """`apply` for a unary elementwise op (the hot path of small graphs)."""
    rt = _current.get()
    if rt is None or rt.closed:
        _no_runtime(op)
    s = a._stream
    data = a._data
    if (
        (s is None or s._completed >= a._seq)
        and data is not None
        and data.size <= INLINE_MAX_ELEMENTS
        and (op.any_kind or a._dtype in op.fast_dtypes)  # else the meta decides (sqrt of an int: float32)
    ):
        out = Tensor._wrap(op.kernel(data), a._dev)
        if a._rg and op.rule is not None and _grad_mode._grad_enabled.get():
            node = OpNode.__new__(OpNode)
            node._fast1(op, a)
            if op.save_out:
                node.out = out
            out._grad_fn = node
            out._rg = True
        return out
    return apply(op, (a,))


def apply2(op: Op, a: Any, b: Any) -> Any:
    """`apply` for a binary elementwise op: inline when both operands are ready, small and same-shaped,
    of one dtype (or a tensor and a Python number) for which numpy's result dtype is PyTorch's."""
    rt = _current.get()
    if rt is None or rt.closed:
        _no_runtime(op)
    T = Tensor
    if type(a) is T:
        if type(b) is T:
            s, t = a._stream, b._stream
            if (
                a._shape == b._shape
                and a._dtype is b._dtype
                and (op.any_kind or a._dtype in op.fast_dtypes)
                and a._dev is b._dev
                and (s is None or s._completed >= a._seq)
                and (t is None or t._completed >= b._seq)
                and a._data is not None
                and b._data is not None
                and a._data.size <= INLINE_MAX_ELEMENTS
            ):
                out = T._wrap(op.kernel(a._data, b._data), a._dev)
                if (a._rg or b._rg) and op.rule is not None and _grad_mode._grad_enabled.get():
                    node = OpNode.__new__(OpNode)
                    node._fast2t(op, a, b)
                    out._grad_fn = node
                    out._rg = True
                return out
        elif type(b) in _SCALARS:
            s = a._stream
            if (
                (s is None or s._completed >= a._seq)
                and a._data is not None
                and a._data.size <= INLINE_MAX_ELEMENTS
                and (a._dtype in _FLOAT_DTYPES or _scalar_fast(op, a._dtype.kind, b))
            ):
                out = T._wrap(op.kernel(a._data, b), a._dev)
                if a._rg and op.rule is not None and _grad_mode._grad_enabled.get():
                    node = OpNode.__new__(OpNode)
                    node._fast2s(op, a, b)
                    out._grad_fn = node
                    out._rg = True
                return out
    elif type(b) is T and type(a) in _SCALARS:
        s = b._stream
        if (
            (s is None or s._completed >= b._seq)
            and b._data is not None
            and b._data.size <= INLINE_MAX_ELEMENTS
            and (b._dtype in _FLOAT_DTYPES or _scalar_fast(op, b._dtype.kind, a))
        ):
            out = T._wrap(op.kernel(a, b._data), b._dev)
            if b._rg and op.rule is not None and _grad_mode._grad_enabled.get():
                out._grad_fn = OpNode(op, (a, b), EMPTY, None)
                out._rg = True
            return out
    return apply(op, (a, b))


def _scalar_fast(op: Op, kind: str, x: Any) -> bool:
    """Whether numpy gives PyTorch's dtype for a tensor of a non-float dtype kind and a Python number:
    only an int or bool number with an int or bool tensor (int + 0.5 is float32 in PyTorch, float64 in
    numpy; a float tensor, tested first, meets any Python number as itself)."""
    return kind in op.fast_kinds and (kind == "c" or type(x) in _INT_SCALARS)


def _enqueue(
    op: Op,
    kernel: Callable[..., Any],
    args: tuple[Any, ...],
    kw: dict[str, Any],
    shape: tuple[int, ...],
    dtype: Any,
    dev: Any,
    stream: Stream,
    T: type[Tensor],
) -> Tensor:
    for a in args:
        if isinstance(a, T):
            wait_for(a, stream)
    out = T._pending(shape, dtype, dev, stream)
    if op.fills_out and math.prod(shape) * dtype.itemsize >= HOST_CACHE_MIN_BYTES:

        def job() -> None:
            if out._defer:  # an in-place update took this kernel over (`_inplace.scaled_update`)
                return
            arrays = [a._data if isinstance(a, T) else a for a in args]
            # only where the ufunc would compute in `dtype` and give a C-ordered result anyway
            if all(x.dtype == dtype and x.flags.c_contiguous for x in arrays if isinstance(x, np.ndarray)):
                out._data = kernel(*arrays, out=lane_empty(shape, dtype), **kw)
                return
            res = kernel(*arrays, **kw)
            out._data = res if res.dtype == dtype else res.astype(dtype)

    else:

        def job() -> None:
            res = kernel(*[a._data if isinstance(a, T) else a for a in args], **kw)
            if res.dtype != dtype:
                res = res.astype(dtype)
            out._data = res

    out._seq = stream.submit(job)
    return out


def wait_for(t: Tensor, stream: Stream) -> None:
    """Order ``stream`` after the pending work that produces ``t`` (a cross-stream event, if needed)."""
    s = t._stream
    if s is not None and s is not stream and s._completed < t._seq:
        if s.device is not stream.device:
            s.synchronize_blocking(t._seq)  # cross-device: host-side wait (rare)
        else:
            stream.wait_event(s.record_event())


def _device_mismatch(op: Op, args: tuple[Any, ...]) -> None:
    T = Tensor
    devs = [str(a.device) for a in args if isinstance(a, T)]
    shapes = [tuple(a.shape) for a in args if isinstance(a, T)]
    raise OpError(
        f"{op.name}: expected all tensors on one device, got devices {devs} (shapes {shapes}); "
        "move them with .to(device) first"
    )


# ---- meta helpers shared by the op families ----------------------------------------------------------


def norm_dim(op: str, x: Any, dim: Any) -> int:
    """``dim`` as a non-negative index of one of ``x``'s dims (a 0-dim tensor has dim 0 and -1)."""
    n = max(len(x.shape), 1)
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    if not -n <= dim < n:
        raise OpError(
            f"{op}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)} "
            f"(expected a dim in [{-n}, {n - 1}])"
        )
    return int(dim) % n

_bcast_cache: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ...] | None] = {}


def broadcast_shapes(op: str, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if a == b:
        return a
    key = (a, b)
    r = _bcast_cache.get(key)
    if r is None:
        try:
            r = tuple(np.broadcast_shapes(a, b))
        except ValueError:
            raise OpError(
                f"{op}: shapes {a} and {b} cannot be broadcast together; make each dimension "
                "equal or 1 (reshape or unsqueeze one operand)"
            ) from None
        if len(_bcast_cache) < 4096:
            _bcast_cache[key] = r
    return r
