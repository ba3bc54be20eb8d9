"""Tests for asyncgrad.actors: call/reply, ordering, mailboxes, close, supervision, statistics."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from asyncgrad.actors import Actor, ActorClosedError, ActorStatistics, read_record

TIMEOUT = 5  # seconds; generous, only here to turn a hang into a failure


class Recorder(Actor):
    """Sync handler: records every message; ``("raise", exc)`` raises exc; returns msg * 2."""

    def __init__(self, name: str = "rec", *, capacity: float = math.inf) -> None:
        super().__init__(name, capacity=capacity)
        self.seen: list[Any] = []

    def handle(self, msg: Any) -> Any:
        self.seen.append(msg)
        if isinstance(msg, tuple) and msg[0] == "raise":
            raise msg[1]
        return msg * 2


class Gated(Actor):
    """Async handler: ``"wait"`` blocks until ``gate`` is set; ``"boom"`` raises ValueError."""

    def __init__(self, name: str = "gated", *, capacity: float = math.inf) -> None:
        super().__init__(name, capacity=capacity)
        self.gate = trio.Event()
        self.seen: list[Any] = []

    async def handle(self, msg: Any) -> Any:
        self.seen.append(msg)
        if msg == "wait":
            await self.gate.wait()
        elif msg == "boom":
            raise ValueError("boom")
        await trio.lowlevel.checkpoint()
        return f"got {msg}"


async def test_call_returns_handler_value_sync_and_async() -> None:
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            rec, gated = Recorder(), Gated()
            await nursery.start(rec.run)
            await nursery.start(gated.run)
            assert await rec.call(21) == 42
            assert await rec.call("ab") == "abab"
            assert await gated.call("x") == "got x"
            rec.close()
            gated.close()


async def test_messages_processed_one_at_a_time_in_arrival_order() -> None:
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            actor = Gated()
            await nursery.start(actor.run)
            actor.send_nowait("wait")  # holds the actor so everything else queues behind it
            for i in range(5):
                actor.send_nowait(i)
            await actor.send(5)
            await trio.testing.wait_all_tasks_blocked()
            assert actor.seen == ["wait"]  # one at a time: nothing overtakes the blocked handler
            actor.gate.set()
            assert await actor.call(6) == "got 6"
            assert actor.seen == ["wait", 0, 1, 2, 3, 4, 5, 6]
            actor.close()


async def test_bounded_mailbox_send_nowait_raises_wouldblock_and_send_waits() -> None:
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            actor = Gated(capacity=2)
            await nursery.start(actor.run)
            actor.send_nowait("wait")
            await trio.testing.wait_all_tasks_blocked()  # actor took "wait" and is blocked in it
            actor.send_nowait(1)
            actor.send_nowait(2)
            with pytest.raises(trio.WouldBlock):
                actor.send_nowait(3)
            assert actor.statistics().pending == 2

            sent = trio.Event()

            async def sender() -> None:
                await actor.send(3)
                sent.set()

            nursery.start_soon(sender)
            await trio.testing.wait_all_tasks_blocked()
            assert not sent.is_set()  # waiting for room
            actor.gate.set()
            await sent.wait()
            await actor.call(4)
            assert actor.seen == ["wait", 1, 2, 3, 4]
            actor.close()


async def test_close_drains_queued_messages_then_run_returns() -> None:
    with trio.fail_after(TIMEOUT):
        actor = Recorder()
        for i in range(3):
            actor.send_nowait(i)  # queued before run() even starts
        actor.close()
        with pytest.raises(ActorClosedError, match="'rec' is closed"):
            actor.send_nowait(99)
        with pytest.raises(ActorClosedError, match="'rec' is closed"):
            await actor.call(99)
        with pytest.raises(ActorClosedError):
            await actor.send(99)
        await actor.run()  # returns by itself once drained
        assert actor.seen == [0, 1, 2]
        stats = actor.statistics()
        assert stats.closed and not stats.crashed
        assert stats.pending == 0 and stats.messages_handled == 3


async def test_close_while_running_serves_queued_calls() -> None:
    with trio.fail_after(TIMEOUT):
        results: list[Any] = []
        async with trio.open_nursery() as nursery:
            actor = Gated()
            await nursery.start(actor.run)
            actor.send_nowait("wait")

            async def caller(i: int) -> None:
                results.append(await actor.call(i))

            for i in range(3):
                nursery.start_soon(caller, i)
                await trio.testing.wait_all_tasks_blocked()  # fixes arrival order
            actor.close()
            actor.gate.set()
        assert results == ["got 0", "got 1", "got 2"]


async def test_close_wakes_sender_blocked_on_full_mailbox() -> None:
    with trio.fail_after(TIMEOUT):
        actor = Recorder(capacity=0)  # never started: every send blocks
        async with trio.open_nursery() as nursery:

            async def sender() -> None:
                with pytest.raises(ActorClosedError, match="is closed"):
                    await actor.send(1)

            nursery.start_soon(sender)
            await trio.testing.wait_all_tasks_blocked()
            assert actor.statistics().pending == 1
            actor.close()
        assert actor.statistics().pending == 0
        assert actor.statistics().messages_received == 0  # it was never accepted


async def test_exception_in_call_goes_to_caller_and_actor_keeps_serving() -> None:
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            actor = Recorder()
            await nursery.start(actor.run)
            with pytest.raises(KeyError, match="nope"):
                await actor.call(("raise", KeyError("nope")))
            assert await actor.call(5) == 10
            stats = actor.statistics()
            assert not stats.closed and not stats.crashed
            assert stats.messages_handled == 2
            actor.close()


async def test_exception_in_fire_and_forget_fails_the_nursery() -> None:
    with trio.fail_after(TIMEOUT):
        actor = Gated()
        with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="boom")):
            async with trio.open_nursery() as nursery:
                await nursery.start(actor.run)
                actor.send_nowait("boom")
                await trio.sleep_forever()  # only the actor's crash can end this
        stats = actor.statistics()
        assert stats.closed and stats.crashed


async def test_callers_after_a_crash_get_actor_closed_error_chained() -> None:
    with trio.fail_after(TIMEOUT):
        actor = Gated(name="worker")
        pending_errors: list[BaseException] = []

        async def pending_caller() -> None:
            try:
                await actor.call("never answered")
            except ActorClosedError as exc:
                pending_errors.append(exc)

        # The pending caller runs outside the actor's nursery so the crash does not cancel it.
        async with trio.open_nursery() as outer:
            with pytest.RaisesGroup(ValueError):
                async with trio.open_nursery() as nursery:
                    await nursery.start(actor.run)
                    actor.send_nowait("wait")
                    actor.send_nowait("boom")
                    outer.start_soon(pending_caller)
                    await trio.testing.wait_all_tasks_blocked()
                    assert actor.statistics().pending == 2
                    actor.gate.set()
                    await trio.sleep_forever()

        assert actor.seen == ["wait", "boom"]  # the queued call was never handled
        [err] = pending_errors
        assert isinstance(err.__cause__, ValueError)
        assert "'worker' crashed" in str(err)
        with pytest.raises(ActorClosedError, match="'worker' crashed with ValueError") as info:
            await actor.call("late")
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(ActorClosedError):
            actor.send_nowait("late")
        assert actor.statistics().pending == 0


async def test_cancelled_run_fails_callers() -> None:
    with trio.fail_after(TIMEOUT):
        actor = Gated()
        errors: list[BaseException] = []

        async def caller() -> None:
            try:
                await actor.call("wait")  # in progress when run() is cancelled
            except ActorClosedError as exc:
                errors.append(exc)

        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as nursery:
                await nursery.start(actor.run)
                outer.start_soon(caller)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
        [err] = errors
        assert "cancelled" in str(err) and err.__cause__ is None
        with pytest.raises(ActorClosedError, match="cancelled"):
            actor.send_nowait(1)
        assert not actor.statistics().crashed


async def test_run_twice_and_self_call_are_errors() -> None:
    class SelfCaller(Actor):
        async def handle(self, msg: Any) -> Any:
            return await self.call(msg)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            actor = SelfCaller("selfish")
            await nursery.start(actor.run)
            with pytest.raises(RuntimeError, match="already started"):
                await actor.run()
            with pytest.raises(RuntimeError, match="cannot call itself"):
                await actor.call(1)
            actor.close()


async def test_statistics() -> None:
    with trio.fail_after(TIMEOUT):
        actor = Gated(name="stats")
        assert actor.statistics() == ActorStatistics(
            name="stats",
            messages_received=0,
            messages_handled=0,
            calls=0,
            pending=0,
            closed=False,
            crashed=False,
            max_pending_seen=0,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            actor.send_nowait("wait")
            await trio.testing.wait_all_tasks_blocked()
            actor.send_nowait(1)
            actor.send_nowait(2)
            nursery.start_soon(actor.call, 3)
            await trio.testing.wait_all_tasks_blocked()
            stats = actor.statistics()
            assert stats.messages_received == 4
            assert stats.calls == 1
            assert stats.pending == 3  # "wait" is being handled, so it is not pending
            assert stats.messages_handled == 0
            assert stats.max_pending_seen == 3
            actor.gate.set()
            await trio.testing.wait_all_tasks_blocked()
            await actor.call(4)
            actor.close()
        stats = actor.statistics()
        assert (stats.messages_received, stats.messages_handled, stats.calls) == (5, 5, 2)
        assert stats.pending == 0 and stats.max_pending_seen == 3 and stats.closed


async def test_idle_says_whether_call_nowait_would_handle_a_message_now() -> None:
    rec = Recorder()
    assert not rec.idle  # not started
    with pytest.raises(trio.WouldBlock):
        rec.call_nowait(1)
    async with trio.open_nursery() as n:
        await n.start(rec.run)
        assert rec.idle
        assert rec.call_nowait(3) == 6  # handled right here
        rec.send_nowait(4)  # queued: the actor's task has not taken it yet
        assert not rec.idle
        with pytest.raises(trio.WouldBlock):
            rec.call_nowait(5)
        with trio.fail_after(TIMEOUT):
            assert await rec.call(6) == 12  # served after the queued one
        assert rec.idle and rec.seen == [3, 4, 6]
        rec.close()
    assert not rec.idle
    gated = Gated()
    async with trio.open_nursery() as n:
        await n.start(gated.run)
        assert not gated.idle  # an async handler is never called inline
        gated.close()


def test_read_record_reads_private_then_public_fields_and_takes_given_ones() -> None:
    @attrs.frozen
    class Rec:
        hits: int
        size: int
        name: str
        total: int

    class Source:
        def __init__(self) -> None:
            self._hits = 3  # a private counter is read first
            self.hits = -1
            self.size = 7  # a public attribute, when there is no private one
            self.name = "src"

    rec = read_record(Rec, Source(), total=10)
    assert rec == Rec(hits=3, size=7, name="src", total=10)
    with pytest.raises(AttributeError):
        read_record(Rec, Source())  # `total` is neither given nor an attribute
