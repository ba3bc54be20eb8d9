"""ag.autograd.queue_callback (run when the committing backward pass has committed) and ag.runtime.submit_on."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.devices import Lane, Stream


async def test_callbacks_run_before_backward_returns_in_order(rt: ag.Runtime) -> None:
    with trio.fail_after(10):
        w = ag.tensor([1.0, 2.0], requires_grad=True)
        seen: list[str] = []

        async def later() -> None:
            await trio.sleep(0.01)
            seen.append(f"async grad={w.grad.numpy().tolist()}")

        def hook(p: ag.Tensor) -> None:
            ag.autograd.queue_callback(lambda: seen.append("sync"))
            ag.autograd.queue_callback(later)

        w.register_post_accumulate_grad_hook(hook)
        await (w * w).sum().backward()
        assert seen == ["sync", "async grad=[2.0, 4.0]"]


async def test_a_failing_callback_undoes_the_pass(rt: ag.Runtime) -> None:
    with trio.fail_after(10):
        w = ag.tensor([1.0, 2.0], requires_grad=True)
        v = ag.tensor([3.0], requires_grad=True)
        await (w * 3).sum().backward()

        def boom() -> None:
            raise ValueError("callback failed")

        h = w.register_post_accumulate_grad_hook(lambda p: ag.autograd.queue_callback(boom))
        with pytest.raises(ValueError, match="callback failed"):
            await ((w * w).sum() + v.sum()).backward()
        np.testing.assert_array_equal(w.grad.numpy(), [3.0, 3.0])  # as before the failed pass
        assert v.grad is None
        h.remove()
        await (w * w).sum().backward()
        np.testing.assert_array_equal(w.grad.numpy(), [5.0, 7.0])


async def test_a_cancelled_callback_undoes_the_pass(rt: ag.Runtime) -> None:
    with trio.fail_after(10):
        w = ag.tensor([1.0, 2.0], requires_grad=True)
        w.register_post_accumulate_grad_hook(lambda p: ag.autograd.queue_callback(trio.sleep_forever))
        with trio.move_on_after(0.05) as cs:
            await (w * w).sum().backward()
        assert cs.cancelled_caught
        assert w.grad is None


def test_queue_callback_outside_a_commit_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="only be called from a post-accumulate-grad hook"):
        ag.autograd.queue_callback(lambda: None)


async def test_submit_on_orders_after_producers_and_before_readers(rt: ag.Runtime) -> None:
    with trio.fail_after(10):
        lane = Lane("test-comm", 0)
        try:
            s = Stream(rt.cpu, lane)
            a = ag.from_numpy(np.random.default_rng(0).standard_normal((200, 200)))
            y = a @ a  # pending on this task's stream
            log: list[float] = []

            def job(arr: np.ndarray) -> None:
                log.append(float(arr[0, 0]))
                arr *= 2

            seq = ag.runtime.submit_on(s, job, [y])
            assert ag.runtime.stream_work(y)[0] is s and ag.runtime.stream_work(y)[1] == seq
            z = y + 0  # a later op waits for the job by an event
            want = (a.numpy() @ a.numpy())
            np.testing.assert_allclose(z.numpy(), 2 * want, rtol=1e-12)
            assert log == [pytest.approx(want[0, 0])]
            await s.synchronize(seq)
        finally:
            lane.stop()
            lane.join()
