"""Distributed autograd: a remote call is one async node of the caller's graph (issue 19).

A call whose tensor arguments require grad (`Worker.call`), or a method call on an `RRef` that carries
a tensor while grad mode is on, runs on the worker under `enable_grad`; the worker keeps the graph it
built (keyed by a forward id) and returns its outputs detached. The caller records one `_RemoteCall`
node whose ``backward`` is ``async def``: it sends the incoming gradients to the worker, which runs
``grad()`` through its part of the graph (a graph task of the worker's runtime) and returns the input
gradients. So ``await loss.backward()`` stays a plain await and chains, fan-out and repeated calls are
just more nodes.

Atomicity (prepare, then commit): the worker never writes `.grad` during the backward; the gradients of
its leaves that are not inputs of the call (the parameters of the object behind an RRef, say) are
STAGED under a stage id. Each remote node has a hidden local leaf (its *token*); the node's backward
gives the token a gradient equal to the stage id, so the token is committed by the local engine
exactly when the whole pass succeeds (all or none, with every other leaf). The token's
post-accumulate hook then posts the commit to the worker (a message that gets no reply: one round trip
per remote node and pass, the backward's); a pass that fails, is cancelled, or loses a worker commits no
token, so every worker's `.grad` stays as it was (the staged entries are dropped when
the forward's graph is freed). Commits travel on the same connection ahead of any later call, so
``await opt.step()`` after ``await loss.backward()`` sees them.

Chains: code running on a worker that calls another worker itself (``await dist.rpc("worker1", g, h)``,
`_mesh`) records that call in its own graph, so the backward goes worker to worker directly; the
callee's staged gradients are committed by the caller's token, which the caller commits (with its own
staged gradients, `autograd.commit_gradients`) only when the trainer commits.

Arguments and results may nest tensors in lists, tuples and dicts at any depth (`_flatten`).

Limits: ``create_graph=True`` through a remote node raises a clear error. A post-accumulate-grad hook
that raises on a worker at commit cannot fail the trainer's pass (which has committed): that worker's
`.grad` of the pass are put back and its next distributed-autograd call raises the error.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from typing import Any

import attrs
import numpy as np
import trio

from .. import autograd, runtime
from ._peer import CALL, POST, this_node

# `_workers.Worker` and `_rref.RRef` call into this module, so it names their types without importing them
Worker = Any
RRef = Any


_THIS = "asyncgrad.distributed._dist_autograd"


# ---- the caller side ------------------------------------------------------------------------------


def wants_grad(args: tuple[Any, ...], kwargs: dict[str, Any], *, any_tensor: bool = False) -> bool:
    """Whether a call must be recorded: grad mode on and a tensor argument that requires grad (or, for
    a method of a remote object, whose parameters may need gradients, any tensor at all)."""
    if not runtime.is_grad_enabled():
        return False
    for a in itertools.chain(args, kwargs.values()):
        for t in _tensors_in(a):
            if any_tensor or t.requires_grad:
                return True
    return False


def _tensors_in(a: Any) -> list[runtime.Tensor]:
    """The tensors anywhere in ``a`` (nested lists, tuples and dicts)."""
    if isinstance(a, runtime.Tensor):
        return [a]
    if isinstance(a, (list, tuple)):
        return [t for x in a for t in _tensors_in(x)]
    if isinstance(a, dict):
        return [t for x in a.values() for t in _tensors_in(x)]
    return []


# markers of a flattened structure: a tensor (its index in the flat list), a list, a tuple, a dict (as
# key/value pairs: the wire keeps any key type that way), or any other value as it is
_T, _L, _U, _D, _V = "__ag_T__", "__ag_L__", "__ag_U__", "__ag_D__", "__ag_V__"


def _flatten(a: Any, flat: list[Any]) -> Any:
    """``a`` with every tensor (at any depth) replaced by a marker of its index in ``flat``."""
    if isinstance(a, runtime.Tensor):
        flat.append(a)
        return [_T, len(flat) - 1]
    if isinstance(a, list):
        return [_L, [_flatten(x, flat) for x in a]]
    if isinstance(a, tuple):
        return [_U, [_flatten(x, flat) for x in a]]
    if isinstance(a, dict):
        return [_D, [[k, _flatten(v, flat)] for k, v in a.items()]]
    return [_V, a]


def _rebuild(m: Any, flat: list[Any]) -> Any:
    """The inverse of `_flatten`: the structure with ``flat``'s tensors put back."""
    tag, v = m
    if tag == _T:
        return flat[v]
    if tag == _L:
        return [_rebuild(x, flat) for x in v]
    if tag == _U:
        return tuple(_rebuild(x, flat) for x in v)
    if tag == _D:
        return {k: _rebuild(x, flat) for k, x in v}
    return v


@attrs.define(eq=False)
class _Handle:
    """What the caller's node knows of one remote forward."""

    worker: Worker
    fid: int
    outs: list[runtime.Tensor]
    what: str
    timeout: Any


async def call(worker: Worker, target: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: Any) -> Any:
    """`Worker.call` for a call that is to be differentiated."""
    return await _recorded(worker, "fn", target, None, args, kwargs, timeout, f"the call of {target}")


async def rref_call(rref: RRef, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: Any) -> Any:
    """`RRef.call` for a call that is to be differentiated."""
    return await _recorded(
        rref.owner, "method", method, rref, args, kwargs, timeout, f"{rref.type_name}.{method}()"
    )


async def _recorded(
    worker: Worker, kind: str, target: str, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
    timeout: Any, what: str,
) -> Any:
    flat, spec = _flatten_inputs(args, kwargs)
    # tensors as positional slots of the wire call; the worker rebuilds args/kwargs from the spec
    reply = await _plain_call(worker, "_forward", (kind, target, obj, spec, *flat), timeout)
    fid, result, outs, diff = reply
    if fid == 0:  # nothing on the worker required grad: a plain result
        return result
    handle = _Handle(worker, fid, [o for o, d in zip(outs, diff) if d], what, timeout)
    token = runtime.zeros((), dtype=np.float64, requires_grad=True)
    token.register_post_accumulate_grad_hook(_committer(handle))
    ins = [t for t in flat if isinstance(t, runtime.Tensor)]
    got = _RemoteCall.apply(handle, token, *ins)
    it = iter((got,) if not isinstance(got, tuple) else got)
    return _rebuild(result, [next(it) if d else o for o, d in zip(outs, diff)])


async def _plain_call(worker: Worker, fn: str, args: tuple[Any, ...], timeout: Any) -> Any:
    """A call of one of this module's functions on the worker, never itself recorded."""
    t = worker._timeout(timeout)
    peer = worker._live_peer()
    out = peer.prepare(CALL, [f"{_THIS}:{fn}"], args, {}, f"{fn} on {worker.name}")
    return await peer.roundtrip(out, t)


def _flatten_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The tensors anywhere in the arguments (nested lists, tuples, dicts), and a spec to put them back."""
    flat: list[Any] = []
    spec = [[_flatten(a, flat) for a in args], [[k, _flatten(v, flat)] for k, v in kwargs.items()]]
    return flat, spec


def _unflatten(spec: list[Any], flat: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    sargs, skw = spec
    return [_rebuild(m, flat) for m in sargs], {k: _rebuild(m, flat) for k, m in skw}


_stage_ids = itertools.count(1)


class _RemoteCall(autograd.Function):
    @staticmethod
    def forward(ctx: Any, handle: _Handle, token: runtime.Tensor, *ins: runtime.Tensor) -> Any:
        ctx.handle = handle
        ctx.save_for_backward(token)  # its freeing makes a second backward without retain_graph raise
        weakref.finalize(ctx, _free_later, _token_or_none(), handle.worker, handle.fid)
        return tuple(handle.outs)

    @staticmethod
    async def backward(ctx: Any, *grads: Any) -> Any:
        ctx.saved_tensors  # noqa: B018  (raises as locally on a second backward without retain_graph)
        h: _Handle = ctx.handle
        if runtime.is_grad_enabled():
            raise RuntimeError(
                f"backward with create_graph=True through the remote call {h.what} on {h.worker.name} is "
                "not supported (a remote call's backward is not itself recorded); use create_graph=False, "
                "or compute the higher derivative on the worker"
            )
        stage = next(_stage_ids)
        gins = await _plain_call(h.worker, "_backward", (h.fid, list(grads), stage), h.timeout)
        return (None, runtime.tensor(float(stage), dtype=np.float64), *gins)


def _committer(handle: _Handle) -> Any:
    def commit(token: runtime.Tensor) -> None:
        # the engine commits this token only when the whole pass succeeded; its gradient is the
        # stage id of this pass (reset below, so the next pass's commit reads its own id)
        g = token.grad
        token.grad = None
        if g is None:
            return
        stage = round(g.item())
        _post(handle.worker, "_commit", handle.fid, stage)

    return commit


def _post(worker: Worker, fn: str, *args: Any) -> None:
    """Post a call: no reply comes back (an error is logged on the worker); a plain message that travels
    in order with every later call on the connection."""
    peer = worker.peer
    if peer is None or peer.death is not None or peer.conn.closed:
        return
    out = peer.prepare(POST, [f"{_THIS}:{fn}"], args, {}, f"{fn} on {worker.name}")
    try:
        peer.send(out.enc)
    except Exception:  # the connection is gone: the worker's state went with it
        pass


def _token_or_none() -> Any:
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None


def _free_later(token: Any, worker: Worker, fid: int) -> None:
    # may run in any thread (the garbage collector): hand the send to the loop
    if token is None:
        return
    try:
        token.run_sync_soon(_post, worker, "_free", fid)
    except trio.RunFinishedError:
        pass


# ---- the worker side ------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Forward:
    outs: list[runtime.Tensor]
    ins: list[runtime.Tensor]
    leaves: list[runtime.Tensor]
    n_flat: int  # the call's tensor arguments: one gradient (or None) is returned per each
    in_pos: list[int]  # where each of ``ins`` is among them
    stages: dict[int, list[list[Any]]] = attrs.field(factory=dict)


_FORWARDS: dict[int, _Forward] = {}
_fids = itertools.count(1)


def _forward(kind: str, target: str, obj: Any, spec: list[Any], *flat: Any) -> Any:
    # plain, not async: a plain function's forward (an embedding lookup) is served inline in the
    # connection's reader, without a task; an async one's goes on in the task of `_forward_async`
    _raise_failed_commit()
    args, kwargs = _unflatten(spec, list(flat))
    fn = getattr(obj, target) if kind == "method" else this_node().resolve(target)
    with runtime.enable_grad():
        result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        return _forward_async(result, flat)
    return _recorded_reply(result, flat)


async def _forward_async(result: Any, flat: tuple[Any, ...]) -> Any:
    with runtime.enable_grad():
        result = await result
    return _recorded_reply(result, flat)


def _recorded_reply(result: Any, flat: tuple[Any, ...]) -> Any:
    """The forward's reply; its graph kept under a new forward id when an output requires grad."""
    outs: list[Any] = []
    rspec = _flatten(result, outs)
    diff = [o.requires_grad for o in outs]
    if not any(diff):
        return [0, result, None, None]
    tensors = [t for t in flat if isinstance(t, runtime.Tensor)]
    in_pos = [i for i, t in enumerate(tensors) if t.requires_grad]
    ins = [tensors[i] for i in in_pos]
    outs_d = [o for o, d in zip(outs, diff) if d]
    fid = next(_fids)
    _FORWARDS[fid] = _Forward(outs_d, ins, _leaves_of(outs_d, ins), len(tensors), in_pos)
    return [fid, rspec, [o.detach() if d else o for o, d in zip(outs, diff)], diff]


def _leaves_of(outs: list[runtime.Tensor], ins: list[runtime.Tensor]) -> list[runtime.Tensor]:
    """The leaves that require grad reachable from ``outs``, other than the call's inputs."""
    skip = {id(t) for t in ins}
    seen: set[int] = set()
    leaves: list[runtime.Tensor] = []
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    for o in outs:
        if o.grad_fn is None and id(o) not in skip and id(o) not in seen:
            seen.add(id(o))
            leaves.append(o)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for e in node.next:
            if e is None:
                continue
            n = e[0]
            if isinstance(n, runtime.Tensor):
                if id(n) not in skip and id(n) not in seen:
                    seen.add(id(n))
                    leaves.append(n)
            elif id(n) not in seen:
                stack.append(n)
    return leaves


async def _backward(fid: int, grads: list[Any], stage: int) -> list[Any]:
    _raise_failed_commit()
    rec = _FORWARDS.get(fid)
    if rec is None:
        raise RuntimeError(
            f"the graph of remote forward #{fid} on {this_node().name} is gone (freed, or the worker "
            "restarted); run the forward again"
        )
    pairs = [(o, g) for o, g in zip(rec.outs, grads) if g is not None]
    targets = rec.ins + rec.leaves
    result: list[Any] = [None] * rec.n_flat
    if not pairs or not targets:
        return result
    # always retained here: the caller's node says when the graph may go (`_free`), as it alone knows
    # about retain_graph
    gs = await autograd.grad(
        [o for o, _ in pairs], targets, [g for _, g in pairs], retain_graph=True, allow_unused=True
    )
    n = len(rec.ins)
    staged = [[p, g] for p, g in zip(rec.leaves, gs[n:]) if g is not None]
    if staged:
        rec.stages[stage] = staged
    for i, g in zip(rec.in_pos, gs[:n]):
        result[i] = g
    return result


_FAILED_COMMITS: list[str] = []


def _commit(fid: int, stage: int) -> None:
    # plain (not async): it runs in the connection's reader, in order, before any later call is served
    rec = _FORWARDS.get(fid)
    if rec is None:
        return
    entries = rec.stages.pop(stage, None)
    if not entries:
        return
    try:
        with runtime.no_grad():
            # as a local pass commits: steal or copy under the layout contract, then post-accumulate hooks
            # (which is how a call this worker made to another worker commits there: its token's hook)
            fresh = autograd.commit_gradients(entries)
    except Exception as e:
        # the trainer's pass has committed already, so this cannot fail it: this worker's .grad of the pass
        # were put back, and the next distributed-autograd call to this worker raises this
        _FAILED_COMMITS.append(
            f"{type(e).__name__}: {e} (raised by a post-accumulate-grad hook on {this_node().name} while "
            f"committing the gradients of remote forward #{fid}; that worker's .grad of the pass were put back)"
        )
        return
    for p in fresh:
        if p.grad is not None:
            runtime.bind_rows(p.grad)  # an embedding's written rows stay known to the optimizer


def _raise_failed_commit() -> None:
    if _FAILED_COMMITS:
        msg = _FAILED_COMMITS.pop(0)
        raise RuntimeError(f"an earlier distributed backward could not commit here: {msg}")


def _free(fid: int) -> None:
    _FORWARDS.pop(fid, None)


def forwards_alive() -> int:
    """How many remote forwards this process keeps graphs of (for tests)."""
    return len(_FORWARDS)


def stages_pending() -> int:
    """How many staged (prepared, not committed) gradient sets this process holds (for tests)."""
    return sum(len(rec.stages) for rec in _FORWARDS.values())
