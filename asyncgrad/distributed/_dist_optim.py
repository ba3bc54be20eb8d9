"""`DistributedOptimizer`: step parameters where they live, every worker in parallel (issue 19)."""

from __future__ import annotations

import weakref
from typing import Any

import trio

from ._connection import ConnectionClosed
from ._peer import RCALL, UNSET, Peer, Pending, target_of, this_node
from ._rref import RRef


class _LocalOptimizer:
    """Made on a worker: the worker's own optimizer over the parameters of the objects given."""

    def __init__(self, optim: str, kwargs: dict[str, Any], *objects: Any) -> None:
        cls = this_node().resolve(optim)
        params: list[Any] = []
        for obj in objects:
            got = obj.parameters() if hasattr(obj, "parameters") else [obj]
            params.extend(got)
        self.opt = cls(params, **kwargs)

    def step(self) -> None:
        self.opt.step()

    # plain, not async (both): the worker's reader runs them inline, before it reads the next frame of
    # the connection (`Peer._serve`), which is what lets `DistributedOptimizer.step` and `zero_grad`
    # not wait for them
    def zero_grad(self) -> None:
        self.opt.zero_grad()


class _Sent:
    """A ``step`` or ``zero_grad`` sent to one worker and not waited for: its reply, read at a later settle."""

    __slots__ = ("call_id", "method", "peer", "pending", "timeout", "what")

    def __init__(
        self, peer: Peer, call_id: int, pending: Pending | None, timeout: float | None, what: str, method: str
    ) -> None:
        self.method = method
        self.peer = peer
        self.call_id = call_id
        self.pending = pending  # None: the connection was gone when it was to be sent
        self.timeout = timeout
        self.what = what


class DistributedOptimizer:
    """An optimizer over parameters on several workers: one local optimizer per owner, stepped there.

    Args:
        optimizer_class: A module-level optimizer class, e.g. ``ag.optim.SGD`` (sent by name).
        params_rref: RRefs of remote objects with a ``parameters()`` method (or of tensors).
        **kwargs: The optimizer's arguments (``lr=...``).

    Example::

        opt = dist.optim.DistributedOptimizer(ag.optim.SGD, [table_rref], lr=0.1)
        await loss.backward()
        await opt.step()
    """

    def __init__(self, optimizer_class: Any, params_rref: list[RRef], **kwargs: Any) -> None:
        if not params_rref:
            raise ValueError("DistributedOptimizer needs at least one RRef of parameters")
        for r in params_rref:
            if not isinstance(r, RRef):
                raise TypeError(f"DistributedOptimizer takes RRefs of remote parameters, got {type(r).__name__}")
        self._target = target_of(optimizer_class)
        self._kwargs = kwargs
        self._by_owner: dict[str, list[RRef]] = {}
        for r in params_rref:
            self._by_owner.setdefault(r.owner.name, []).append(r)
        self._remote: dict[str, RRef] | None = None
        self._unsettled: list[_Sent] = []  # calls of the last step / zero_grad whose outcome is not read yet
        # an optimizer dropped with its last zero_grad unread leaves no reply waiting on the connections
        weakref.finalize(self, _forget, self._unsettled)

    async def _ensure(self) -> dict[str, RRef]:
        if self._remote is None:
            made: dict[str, RRef] = {}

            async def make(name: str, refs: list[RRef]) -> None:
                made[name] = await refs[0].owner.remote(
                    _LocalOptimizer, self._target, self._kwargs, *refs  # top level: each arrives as the object
                )

            async with trio.open_nursery() as n:
                for name, refs in self._by_owner.items():
                    n.start_soon(make, name, refs)
            self._remote = made
        return self._remote

    async def step(self) -> None:
        """One step of every worker's optimizer (all of them at once).

        Like `zero_grad`, it does not wait for the workers: it returns once the ``step`` call is queued on
        each owner's connection, ahead of every call this process sends that worker later. Each worker
        serves a connection's calls in the order they were sent, and runs this one (a plain function,
        as every asyncgrad optimizer's ``step`` is) in its reader before it reads the next frame; the
        update's kernels mark the parameters pending, so every later call from this process (a forward,
        ``to_here``, a method reading the parameters) sees them stepped. Calls that other processes make
        to the owner are not ordered after it.

        The outcome is read later, without a round trip of its own: at the next `step` (waiting for the
        reply if it is not in yet, which it is unless the worker is slow), or at a `zero_grad` once the
        reply is in. The error a worker's ``step`` raised, or `WorkerDied` for a worker that died, is
        raised there, with a note naming the call. Raises first the outcome of the last `zero_grad`.
        """
        remote = await self._ensure()
        await self._settle(steps=True)
        for r in remote.values():
            self._unsettled.append(_send(r, "step"))

    async def zero_grad(self) -> None:
        """Reset the gradients of every remote parameter.

        It does not wait for the workers: it returns once the ``zero_grad`` call is queued on each
        owner's connection, ahead of every call this process sends that worker later. Each worker serves
        the calls of a connection in the order they were sent, and runs this one (a plain function) in
        its reader before it reads the next frame, so every later call from this process (a forward, a
        backward's commit, `step`) sees the gradients reset. The outcome is read at the next `step` or
        `zero_grad` of this optimizer: the error a worker's ``zero_grad`` raised, or `WorkerDied` for a
        worker that died, is raised there (its reply came ahead of the replies to the later calls, so
        that costs no wait). Calls that other processes (another worker, over `dist.rpc`) make to the
        owner are not ordered after it. Raises first the outcome of an earlier `step` whose reply is in.
        """
        remote = await self._ensure()
        await self._settle(steps=False)
        for r in remote.values():
            self._unsettled.append(_send(r, "zero_grad"))

    async def _settle(self, *, steps: bool) -> None:
        """Read the outcomes of the calls sent and not read yet, waiting for a reply not in yet, except
        (``steps`` False) a step's: that one is left for later."""
        if not self._unsettled:
            return
        sent = list(self._unsettled)
        self._unsettled.clear()
        error: BaseException | None = None
        for i, s in enumerate(sent):
            if not steps and s.method == "step" and s.pending is not None and not s.pending.done:
                self._unsettled.append(s)
                continue
            try:
                await _outcome(s)
            except BaseException as e:
                if isinstance(e, trio.Cancelled):  # the others are read at the next settle
                    self._unsettled.extend(sent[i + 1 :])
                    raise
                if error is None:
                    e.add_note(
                        f"(the outcome of {s.what} on {s.peer.name}, sent by an earlier "
                        f"DistributedOptimizer.{s.method}() and read at this call)"
                    )
                    error = e
        if error is not None:
            raise error


def _forget(unsettled: list[_Sent]) -> None:
    for s in unsettled:
        s.peer.pending.pop(s.call_id, None)


def _send(r: RRef, method: str) -> _Sent:
    """Send ``r.call(method)`` now (in connection order), without waiting for its reply."""
    worker = r.owner
    timeout = worker._timeout(UNSET)
    peer = worker._live_peer()
    what = f"{r.type_name}.{method}()"
    out = peer.prepare(RCALL, [r._id, method], (), {}, what)
    p = peer.pending[out.call_id] = Pending(None)
    try:
        peer.send(out.enc)
    except ConnectionClosed:
        del peer.pending[out.call_id]
        return _Sent(peer, out.call_id, None, timeout, what, method)
    peer.node.calls_sent += 1
    return _Sent(peer, out.call_id, p, timeout, what, method)


async def _outcome(s: _Sent) -> None:
    peer, p = s.peer, s.pending
    try:
        if p is None:
            await peer._check_alive(wait=True)
            return
        if not p.done:
            if s.timeout is None:
                await p.wait()
            else:
                with trio.move_on_after(s.timeout):
                    await p.wait()
                if not p.done:
                    peer._cancel_remote(s.call_id)
                    raise TimeoutError(f"{s.what} on {peer.name} did not answer within {s.timeout:g} s")
    finally:
        peer.pending.pop(s.call_id, None)
    if p.error is not None:
        raise p.error
