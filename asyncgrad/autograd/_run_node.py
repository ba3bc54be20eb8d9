"""Applying one backward node: the engine calls these, and checks what rules and Functions return.

A built-in node's rule runs on numpy arrays as ONE kernel on the node's stream (inline when tiny and
ready), or, under ``create_graph``, on Tensors so that the backward is itself recorded. A `Function`'s
backward runs on the loop thread (its ops queue kernels like any other code).
"""

from __future__ import annotations

import contextvars
from typing import Any

from ..devices import INLINE_MAX_ELEMENTS, Stream
from ..runtime import _capture
from ..runtime._dispatch import shared_inline_ok, wait_for
from ..runtime._node import _NEEDS1, _NEEDS_TS, OpNode, check_saved_versions
from ..runtime._op import camel
from ..runtime._tensor import Tensor
from ..runtime._xp import AG, NP, sum_to


class BackwardError(RuntimeError):
    """The engine rejected what a backward function or hook returned (count, type or shape of gradients).

    The pass was abandoned and no `.grad` was changed. An exception raised *by* user code in a backward
    function or hook is not wrapped: it reaches the caller as itself, with a note naming where it was
    raised (see `note_failure`).
    """


def note_failure(exc: BaseException, where: str) -> None:
    """Add a note naming the node or hook ``exc`` was raised in (``exc.__notes__``); the caller re-raises.

    The exception keeps its type and traceback, as in PyTorch; an exception that passes through several
    nested passes gets one note per node on its way out, innermost first.
    """
    try:
        exc.add_note(where)
    except TypeError:  # the user set __notes__ to something that is not a list: leave it alone
        pass


_NOT_READY = object()

_wrap = Tensor._wrap  # bound once (a classmethod looked up per node makes a bound-method object)

# set while a plain (non-async) Function backward runs, to catch it starting a nested pass
in_plain_backward: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "asyncgrad_in_plain_backward", default=None
)


def apply_op_kernel(node: OpNode, g: Tensor, task_stream: Stream) -> list[Any]:
    """Run the node's rule on numpy arrays: inline when tiny and ready, else as one kernel on its stream."""
    rec = _capture.active
    if rec is not None and rec.wants():  # a compiled step records (`autograd._compile`)
        return rec.rule(node, g, task_stream)  # type: ignore[no-any-return]
    out = node.out
    if out is not None or not node.op.saves_none:  # (else nothing to check: its test, without the call)
        check_saved_versions(node)  # here on the loop, before anything is queued (the kernel reads `_data` later)
    args: tuple[Any, ...] = node.args  # type: ignore[assignment]  # the engine never applies a released node
    gd = g._data
    s = g._stream
    needs = node.needs
    if (
        (needs is _NEEDS1 or needs is _NEEDS_TS)  # the fast initialisers' nodes: one tensor (and a number)
        and gd is not None
        and gd.size <= INLINE_MAX_ELEMENTS
        and (s is None or s.completed >= g._seq)
    ):
        # `_run_plain`'s usual case (W2's every node), written out: one array in, one gradient out
        a = args[0]
        if isinstance(a, Tensor):
            ad = a._data
            s = a._stream
            if s is not None and s.completed < a._seq:
                ad = None
        else:  # a released node's shape stand-in (`OpNode.release`)
            ad = a
        if ad is not None:
            if out is None:
                od = None
            elif out._data is not None and ((s := out._stream) is None or s.completed >= out._seq):
                od = out._data
            else:
                od = _NOT_READY
            if od is not _NOT_READY:
                op = node.op
                arrays = [ad] if needs is _NEEDS1 else [ad, args[1]]
                gs = op.rule(NP, gd, arrays, od, node.kw, needs)  # type: ignore[misc]  # a node's op has one
                x = gs[0] if len(gs) == len(arrays) else None
                if x is not None and x.shape == ad.shape and x.dtype == ad.dtype:
                    return [_wrap(x, g._dev)] if needs is _NEEDS1 else [_wrap(x, g._dev), None]
                gs = checked_rule_grads(op, NP, gs, needs, arrays)  # (raises, or fixes shape or dtype)
                return [None if x is None else _wrap(x, g._dev) for x in gs]
    # readiness (`is_ready`) written out on this per-node path: a call per tensor costs ~3% of W2
    if (
        gd is not None
        and (
            gd.size <= INLINE_MAX_ELEMENTS
            or (gd.size <= g._dev.shared_inline_max and shared_inline_ok(node.op, args, gd.size, node.kw))
        )
        and (s is None or s.completed >= g._seq)
    ):
        arrays = []
        for a in args:
            if isinstance(a, Tensor):
                s = a._stream
                if (s is not None and s.completed < a._seq) or a._data is None:
                    break
                arrays.append(a._data)
            else:
                arrays.append(a)
        else:
            if out is None:
                gs = run_rule(node, NP, gd, arrays, None)
            elif out._data is not None and ((s := out._stream) is None or s.completed >= out._seq):
                gs = run_rule(node, NP, gd, arrays, out._data)
            else:
                gs = None
            if gs is not None:
                dev = g._dev
                # wrapped in place: `run_rule` made the list (one list per node fewer)
                for i, x in enumerate(gs):
                    if x is not None:
                        gs[i] = _wrap(x, dev)
                return gs
    stream = node.stream or task_stream
    wait_for(g, stream)
    for a in args:
        if isinstance(a, Tensor):
            wait_for(a, stream)
    if out is not None:
        wait_for(out, stream)
    dev = stream.device
    results = [
        Tensor._pending(tuple(a.shape), a.dtype, dev, stream) if need else None
        for a, need in zip(args, node.needs)
    ]
    view = _NodeView(node.op, node.kw, node.needs)

    def job() -> None:
        arrays = [a._data if isinstance(a, Tensor) else a for a in args]
        gd = g._data
        gs = run_rule(view, NP, gd, arrays, None if out is None else out._data)
        seen: list[Any] = [gd, *arrays]
        for r, x in zip(results, gs):
            if r is not None:
                r._data = x
                # a rule may hand back the incoming grad or one array for two inputs: such an array
                # has other owners, so accumulation must not steal it
                if any(x is y for y in seen):
                    r.__dict__["_aliased"] = True
                seen.append(x)

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
        return f"{camel(self.op.name)}Backward0"


def run_rule(node: Any, xp: Any, g: Any, arrays: list[Any], out: Any) -> list[Any]:
    """Call the op's rule, then check and fix up what it returned (count, broadcast shape, dtype)."""
    op, needs = node.op, node.needs
    return checked_rule_grads(op, xp, op.rule(xp, g, arrays, out, node.kw, needs), needs, arrays)


def checked_rule_grads(op: Any, xp: Any, gs: Any, needs: Any, arrays: list[Any]) -> list[Any]:
    """What ``op``'s rule returned, checked (one gradient per input wanted) and fixed up (reduced to each
    input's broadcast shape, cast to its dtype); None for the inputs not wanted."""
    if len(gs) != len(arrays):
        raise RuntimeError(
            f"backward rule of {op.name} returned {len(gs)} gradients, expected {len(arrays)} (one per input)"
        )
    res: list[Any] = []
    for x, need, a in zip(gs, needs, arrays):
        if not need:
            res.append(None)
            continue
        if x is None:
            raise RuntimeError(f"backward rule of {op.name} returned no gradient for input {len(res)}")
        if x.shape != a.shape:
            try:
                x = sum_to(xp, x, tuple(a.shape))
            except ValueError as e:
                raise RuntimeError(f"backward rule of {op.name}, input {len(res)}: {e}") from None
        if x.dtype != a.dtype:
            x = xp.astype(x, a.dtype)
        res.append(x)
    return res


def apply_op_graph(node: OpNode, g: Tensor) -> list[Any]:
    """``create_graph=True``: run the rule with asyncgrad ops so the backward is recorded."""
    check_saved_versions(node)
    return run_rule(node, AG, g, list(node.args or ()), node.out)


def apply_function(node: Any, gouts: list[Any]) -> list[Any]:
    """Run a `Function`'s plain backward."""
    grads = node.prepare_grads(gouts)
    token = in_plain_backward.set(node.name())
    try:
        r = node.fn_cls.backward(node.ctx, *grads)
    except Exception as e:  # the user's own exception, re-raised as it is (trio.Cancelled is no Exception)
        note_failure(e, f"raised in the backward of {node.name()}")
        raise
    finally:
        in_plain_backward.reset(token)
    return check_function_grads(node, r)


def check_function_grads(node: Any, r: Any) -> list[Any]:
    """One gradient (or None) per forward input, each reduced to its input's shape."""
    grads = list(r) if isinstance(r, tuple) else [r]
    n = node.n_args
    if len(grads) > n and all(g is None for g in grads[n:]):
        grads = grads[:n]
    if len(grads) != n:
        raise BackwardError(
            f"{node.name()}: backward returned {len(grads)} gradients, but forward had {n} inputs; "
            "return one gradient (or None) per forward input"
        )
    out: list[Any] = []
    for i, (g, e) in enumerate(zip(grads, node.next)):
        if g is not None and node.in_shapes[i] is None:
            raise BackwardError(
                f"{node.name()}: backward returned a gradient for input {i}, but that forward input is not "
                "a Tensor; return None in its place"
            )
        if e is None or g is None:
            out.append(None)
            continue
        if not isinstance(g, Tensor):
            raise BackwardError(
                f"{node.name()}: backward returned {type(g).__name__} for input {i}, expected a Tensor"
            )
        shape = node.in_shapes[i]
        if g._shape != shape:
            try:
                g = sum_to(AG, g, shape)
            except ValueError:
                raise BackwardError(
                    f"{node.name()}: backward returned a gradient of shape {g._shape} for input {i}, "
                    f"which has shape {shape}"
                ) from None
        out.append(g)
    return out
