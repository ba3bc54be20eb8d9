"""Registration servers: the actors that own shared autograd state.

Ownership (who may change what):

* A graph task owns its own state (dependency counts, gradient buffers, staged leaf gradients). Nothing
  else touches it, so the per-node path takes no lock.
* A leaf's gradient accumulator (`.grad` as written by backward passes), the tensor hooks and
  post-accumulate hooks on that leaf, and the record of which graph tasks committed into it are owned
  by ONE `LeafOwner` actor. Graph tasks never write them directly: they send `Prepare` / `Commit`
  messages, and hook registrations on an owned leaf are `AddHook` / `RemoveHook` messages. The owner
  handles its mailbox one message at a time, so two passes committing into a shared leaf are applied
  one after the other (no lost update, no mutex).
* A pass commits all of its leaves or none. If a post-accumulate-grad hook raises, every `.grad` the
  pass committed is put back as it was (an undo log, kept only by passes whose leaves have such hooks:
  the `.grad` objects, and a copy of the values of those accumulated in place) and the hook's exception
  reaches the caller. A pass whose leaves have several owners commits to all of them with no `await`
  in between (it first waits until every one of them is idle), so no other pass's commit can land
  between its commit and its undo.
* Owners are partitioned by stream: a leaf is owned by the owner of the stream of the first graph task
  that committed into it. Concurrent trainings run on different streams, so independent trainings
  never share an owner (burn's lesson: one global server behind a channel is still one choke point).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from ..actors import Actor, ActorClosedError, read_record
from ..devices import private_base
from ..runtime._hooks import HookTable
from ._accumulate import accumulate, submit_steals, undo, undo_record
from ._hooks import call_hook, check_hook_grad, run_post_accumulate_hooks


@attrs.frozen
class Prepare:
    """Run the leaves' tensor hooks on staged gradients; reply with the (possibly replaced) gradients."""

    entries: list[list[Any]]  # [leaf, grad] pairs, updated in place


@attrs.frozen
class Commit:
    """Fold prepared gradients into `.grad`, then run post-accumulate hooks.

    ``keep_undo``: reply with the undo log (for a `Rollback`, should another owner's hook fail).
    """

    entries: list[list[Any]]
    create_graph: bool
    task_id: int
    keep_undo: bool = False


@attrs.frozen
class Rollback:
    """Undo a `Commit` of this owner (another owner of the same pass failed after it)."""

    records: list[Any]


class _Queued:
    """Callbacks queued by the post-accumulate hooks of one pass, and how to undo its commits."""

    __slots__ = ("callbacks", "undo")

    def __init__(self) -> None:
        self.callbacks: list[Any] = []
        self.undo: list[tuple[LeafOwner, list[Any]]] = []


# the pass whose post-accumulate hooks are running right now (hooks are sync: no other pass can interleave)
_committing: int | None = None
_queued: dict[int, _Queued] = {}


def queue_callback(fn: Any) -> None:
    """Run ``fn()`` (sync, or async and awaited) when the backward pass now committing has committed.

    Call it from a post-accumulate-grad hook (PyTorch's ``Variable._execution_engine.queue_callback``).
    ``await loss.backward()`` returns only after every queued callback returned. If a callback raises, or
    the pass is cancelled while it runs, every `.grad` the pass committed is put back as it was and the
    error reaches the caller of backward.
    """
    if not callable(fn):
        raise TypeError(f"queue_callback expects a callable, got {type(fn).__name__}")
    if _committing is None:
        raise RuntimeError(
            "queue_callback() can only be called from a post-accumulate-grad hook, while a backward pass "
            "commits its gradients"
        )
    q = _queued.get(_committing)
    if q is None:
        q = _queued[_committing] = _Queued()
    q.callbacks.append(fn)


def take_queued(task_id: int) -> _Queued | None:
    """The callbacks (and undo logs) queued for pass ``task_id``, removed from the table."""
    return _queued.pop(task_id, None)


async def run_queued(q: _Queued) -> None:
    """Run the callbacks of a committed pass in order; if one fails (or the pass is cancelled meanwhile),
    put back every `.grad` the pass committed, then raise."""
    try:
        for fn in q.callbacks:
            r = fn()
            if hasattr(r, "__await__"):
                await r
    except BaseException:
        with trio.CancelScope(shield=True):
            await _roll_back(reversed(q.undo))
        raise
    finally:
        q.callbacks.clear()
        q.undo.clear()


class _Sync:
    """A message that does nothing: its reply means the messages queued before it were handled."""


_SYNC = _Sync()


@attrs.frozen
class PrepareAndCommit:
    """`Prepare` then `Commit` in one message (a pass whose leaves all have the same owner)."""

    entries: list[list[Any]]
    create_graph: bool
    task_id: int


@attrs.frozen
class AddHook:
    table: HookTable
    hook_id: int
    fn: Any


@attrs.frozen
class RemoveHook:
    table: HookTable
    hook_id: int


@attrs.frozen
class OwnerStatistics:
    """Counters of one leaf owner."""

    name: str
    leaves_committed: int
    commits: int
    graph_tasks_seen: int
    hook_messages: int


class LeafOwner(Actor):
    """Owns the accumulators and hooks of the leaves assigned to it (see the module docstring)."""

    def __init__(self, rt: Any, name: str) -> None:
        super().__init__(name)
        self._rt = rt
        self._commits = 0
        self._leaves_committed = 0
        self._hook_messages = 0
        # graph tasks that committed here: a pass sends one commit per owner, so counting the changes of
        # task id counts distinct tasks (without keeping every id: a deep reentrant chain commits once
        # per level)
        self._tasks_seen = 0
        self._last_task_id: int | None = None

    def handle(self, msg: Any) -> Any:
        if type(msg) is PrepareAndCommit:
            _prepare(msg.entries)
            return self._commit(msg.entries, msg.create_graph, msg.task_id)
        if isinstance(msg, Prepare):
            return _prepare(msg.entries)
        if isinstance(msg, Commit):
            return self._commit(msg.entries, msg.create_graph, msg.task_id, msg.keep_undo)
        if isinstance(msg, AddHook):
            self._hook_messages += 1
            msg.table[msg.hook_id] = msg.fn
            return None
        if isinstance(msg, RemoveHook):
            self._hook_messages += 1
            msg.table.pop(msg.hook_id, None)
            return None
        if isinstance(msg, Rollback):
            undo(msg.records)
            return None
        if msg is _SYNC:
            return None
        raise TypeError(f"{self.name}: unknown message {msg!r}")

    def _commit(
        self, entries: list[list[Any]], create_graph: bool, task_id: int, keep_undo: bool = False
    ) -> list[Any] | None:
        """Fold ``entries`` into their leaves' `.grad`, then run their post-accumulate hooks; if one raises,
        put every `.grad` back and raise it. Returns the undo log if ``keep_undo``, else None."""
        self._commits += 1
        self._leaves_committed += len(entries)
        if task_id != self._last_task_id:
            self._last_task_id = task_id
            self._tasks_seen += 1
        if not keep_undo:
            for entry in entries:
                if entry[0]._post_hooks:
                    break
            else:  # no post-accumulate hook: nothing to undo (the common path keeps no log)
                self._accumulate(entries, create_graph, None)
                return None
        global _committing
        records: list[Any] = []
        outer = _committing
        try:
            post = self._accumulate(entries, create_graph, records)
            # in the order the gradients were staged (produced), as PyTorch runs them as each one lands
            post.reverse()
            _committing = task_id
            run_post_accumulate_hooks(post, "this backward pass")
        except Exception:
            undo(records)
            raise
        finally:
            _committing = outer
        q = _queued.get(task_id)
        if q is not None:  # a hook queued a callback: keep the undo log until the callbacks have run
            q.undo.append((self, records))
        return records if keep_undo else None

    def _accumulate(self, entries: list[list[Any]], create_graph: bool, records: list[Any] | None) -> list[Any]:
        """Fold each entry's gradient into its leaf (logging how to undo it in ``records``, if given);
        returns the leaves that have post-accumulate hooks."""
        post = []
        batches: dict[Any, list[Any]] = {}
        try:
            while entries:
                entry = entries.pop()
                leaf, g = entry
                entry.clear()
                # a gradient may be stolen only if nobody else holds it: here the references are the local
                # `g` and getrefcount's argument; its array is held by g alone (its base by the array alone)
                arr = g._data
                unique: bool | None
                if arr is not None:
                    unique = sys.getrefcount(g) == 2 and sys.getrefcount(arr) == 3 and private_base(arr)
                else:  # still computing (its kernel holds it now): decided in stream order, once it is computed
                    unique = None
                del arr
                if records is not None:
                    records.append(undo_record(leaf, g, create_graph))  # holds .grad as it is, never g
                accumulate(self._rt, leaf, g, create_graph, unique, batches)
                g = None  # a queued steal-or-copy kernel counts the references left to g
                if leaf._post_hooks:
                    post.append(leaf)
        finally:
            # before any hook runs (hooks see .grad tensors whose kernels are queued), and also when a leaf
            # failed: the .grad tensors already set must get their values
            submit_steals(batches)
        return post

    def owner_statistics(self) -> OwnerStatistics:
        return read_record(OwnerStatistics, self, name=self.name, graph_tasks_seen=self._tasks_seen)


def _prepare(entries: list[list[Any]]) -> None:
    for entry in entries:
        leaf, g = entry
        hooks = leaf._hooks
        if hooks:
            for fn in list(hooks.values()):
                r = call_hook(fn, None, g)
                if r is not None:
                    g = check_hook_grad(None, g, r)
            entry[1] = g


def owner_for(rt: Any, leaf: Any, stream: Any) -> LeafOwner:
    """The leaf's owner, assigning it the owner of ``stream`` on first use."""
    owner = leaf.__dict__.get("_owner")
    if owner is not None and not owner.closed:
        return owner  # type: ignore[no-any-return]
    owner = rt.owners.get(stream)
    if owner is None:
        owner = rt.owners[stream] = LeafOwner(rt, f"leaf-owner[{stream.name}]")
        rt.nursery.start_soon(owner.run)
    leaf._owner = owner
    return owner


async def prepare_and_commit(
    rt: Any, stream: Any, staged: list[list[Any]], *, commit: bool, create_graph: bool, task_id: int
) -> None:
    """Send staged leaf gradients to their owners: all `Prepare`s first, then (if ``commit``) all `Commit`s.

    A hook failing in the prepare phase aborts before anything is written. The commit phase is shielded
    from cancellation, and a post-accumulate hook failing in it undoes the whole commit (see the module
    docstring), so a pass commits all of its leaves or none.
    """
    by_owner: dict[LeafOwner, list[list[Any]]] = {}
    for entry in staged:
        by_owner.setdefault(owner_for(rt, entry[0], stream), []).append(entry)
    if commit and len(by_owner) == 1:
        # one owner: prepare and commit in one message (a failing hook still commits nothing)
        ((owner, entries),) = by_owner.items()
        staged.clear()
        by_owner.clear()
        msg = PrepareAndCommit(entries, create_graph, task_id)
        try:
            owner.call_nowait(msg)  # the owner is idle: it handles the message right here, in order
        except trio.WouldBlock:
            # the owner will apply all of it: wait for it even if cancelled, so that a cancelled caller
            # never sees Cancelled for a pass that was in fact committed
            await _call(owner, msg, shield=True)
        return
    for owner, entries in by_owner.items():
        try:
            owner.call_nowait(Prepare(entries))
        except trio.WouldBlock:
            await _call(owner, Prepare(entries))
    if not commit:
        return
    staged.clear()
    # wait until every owner is idle at once, then commit to all of them without an `await` in between:
    # no other pass's commit can land between this pass's commit and its undo (should a post-accumulate
    # hook raise in a later owner). Cancelled meanwhile: nothing is committed, the caller sees Cancelled
    owners = list(by_owner)
    while True:
        busy = next((o for o in owners if not o.idle), None)
        if busy is None:
            break
        await _call(busy, _SYNC)
    keep_undo = any(entry[0]._post_hooks for entries in by_owner.values() for entry in entries)
    done: list[tuple[LeafOwner, Any]] = []
    try:
        for owner, entries in by_owner.items():
            cmsg = Commit(entries, create_graph, task_id, keep_undo)
            try:
                records = owner.call_nowait(cmsg)
            except trio.WouldBlock:  # a hook of an earlier owner sent it a message: still in order
                records = await _call(owner, cmsg, shield=True)
            if records is not None:
                done.append((owner, records))
    except Exception:
        # a post-accumulate hook raised (its owner has put its own leaves back): put back the others
        await _roll_back(done)
        raise
    finally:
        by_owner.clear()


async def _roll_back(undo: Iterable[tuple[LeafOwner, Any]]) -> None:
    """Have each owner put back the `.grad`s of its commit records, in the given order."""
    for owner, records in undo:
        try:
            owner.call_nowait(Rollback(records))
        except trio.WouldBlock:
            await _call(owner, Rollback(records), shield=True)


async def _call(owner: LeafOwner, msg: Any, *, shield: bool = False) -> Any:
    """Ask ``owner`` and wait for its reply (``shield``: even if cancelled meanwhile)."""
    closed = False
    with trio.CancelScope(shield=shield):
        try:
            return await owner.call(msg)
        except ActorClosedError:
            closed = True
    if closed:
        # owners stop only when the runtime shuts down; if that is cancelling us, say so as trio does
        await trio.lowlevel.checkpoint_if_cancelled()
    raise RuntimeError(
        f"{owner.name} has stopped: the runtime is closing, so this backward pass cannot be committed"
    )


def register_leaf_hook(leaf: Any, table: HookTable, hook_id: int, fn: Any) -> None:
    """Add a hook to an owned leaf through its owner (in order with that owner's commits)."""
    owner = leaf.__dict__.get("_owner")
    if owner is None or owner.closed:
        table[hook_id] = fn
    else:
        _tell(owner, AddHook(table, hook_id, fn))


def remove_leaf_hook(leaf: Any, table: HookTable, hook_id: int) -> None:
    owner = leaf.__dict__.get("_owner")
    if owner is None or owner.closed:
        table.pop(hook_id, None)
    else:
        _tell(owner, RemoveHook(table, hook_id))


def _tell(owner: LeafOwner, msg: Any) -> None:
    # an idle owner applies it at once (so a removed hook is gone when remove() returns); a busy one
    # applies it right after the messages already queued
    try:
        owner.call_nowait(msg)
    except trio.WouldBlock:
        owner.send_nowait(msg)
