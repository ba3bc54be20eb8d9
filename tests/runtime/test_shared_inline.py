"""Medium kernels run where their inputs are while several tasks share a CPU device (many small trainings in
one runtime), and only then; heavy ones are always queued (over the element or multiply-adds bounds, or by kind)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import trio

import asyncgrad as ag
import asyncgrad.nn.functional as F
from asyncgrad.devices import INLINE_MAX_ELEMENTS, SHARED_INLINE_MAX_ELEMENTS, SHARED_INLINE_MAX_MACS
from asyncgrad.runtime._runtime import current_stream

TIMEOUT = 30


def _mlp_grads(x: Any, ws: list[Any]) -> Any:
    h = ag.relu(x @ ws[0])
    return ((h @ ws[1]) ** 2).mean()


async def test_medium_kernels_run_inline_only_while_tasks_share_the_device() -> None:
    rng = np.random.default_rng(0)
    n = 20_000
    assert INLINE_MAX_ELEMENTS < n <= SHARED_INLINE_MAX_ELEMENTS
    xs = rng.standard_normal(n)
    a, w = rng.standard_normal((64, 256)), rng.standard_normal((256, 256))
    assert 64 * 256 * 256 <= SHARED_INLINE_MAX_MACS < 256 * 256 * 256
    async with ag.open_runtime(lanes=2) as rt:
        with trio.fail_after(TIMEOUT):
            x = ag.tensor(xs)
            await x.ready()
            y = x * 2.0
            assert y._stream is not None  # one task: queued on its lane
            np.testing.assert_array_equal((await y.ready()).numpy(), xs * 2.0)
            lone = [ag.tensor(v, requires_grad=True) for v in (a, w, w * 0.5)]
            loss = _mlp_grads(lone[0], lone[1:])
            await loss.backward()
            await rt.synchronize()
            lone_grads = [t.grad.numpy().copy() for t in lone]
            img, wk = rng.standard_normal((1, 1, 48, 48)), rng.standard_normal((2, 1, 3, 3))
            ci, cw = ag.tensor(img, requires_grad=True), ag.tensor(wk, requires_grad=True)
            c = F.conv2d(ci, cw)
            assert c._stream is not None  # one task: queued
            lone_conv, lone_pool = (await c.ready()).numpy().copy(), F.max_pool2d(c, 2).numpy().copy()
            await (F.max_pool2d(c, 2) ** 2).sum().backward()
            await rt.synchronize()
            lone_conv_grads = [ci.grad.numpy().copy(), cw.grad.numpy().copy()]

            started, done = trio.Event(), trio.Event()

            async def other() -> None:
                current_stream(rt.cpu)  # a second task takes a stream of the device
                started.set()
                await done.wait()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(other)
                await started.wait()
                assert rt.cpu.shared_inline_max == SHARED_INLINE_MAX_ELEMENTS
                z = x * 2.0
                assert z._stream is None  # ran here, on the loop thread
                np.testing.assert_array_equal(z.numpy(), xs * 2.0)
                ta, tw = ag.tensor(a), ag.tensor(w)
                p = ta @ tw
                assert p._stream is None  # a product within the multiply-adds bound
                np.testing.assert_allclose(p.numpy(), a @ w, rtol=1e-12, atol=1e-12)
                big = ag.tensor(rng.standard_normal((256, 256))) @ tw
                assert big._stream is not None  # 256^3 multiply-adds: queued
                huge = ag.tensor(rng.standard_normal(SHARED_INLINE_MAX_ELEMENTS + 1)) * 2.0
                assert huge._stream is not None  # over the element bound: queued
                # a convolution and a pool within the multiply-adds bound run here too (their cost is bounded
                # by multiply-adds and window reads, not by their elements)
                conv = F.conv2d(ag.tensor(img), ag.tensor(wk))
                assert INLINE_MAX_ELEMENTS < conv.numel() <= SHARED_INLINE_MAX_ELEMENTS
                assert conv._stream is None
                np.testing.assert_allclose(conv.numpy(), lone_conv, rtol=1e-12, atol=1e-12)
                pool = F.max_pool2d(conv, 2)
                assert pool._stream is None
                np.testing.assert_array_equal(pool.numpy(), lone_pool)
                # within the element bound, over the multiply-adds one: 12544 outputs x 576 products, queued
                xw, ww = rng.standard_normal((1, 64, 16, 16)), rng.standard_normal((64, 64, 3, 3))
                wide = F.conv2d(ag.tensor(xw), ag.tensor(ww))
                assert max(wide.numel(), ww.size, xw.size) <= SHARED_INLINE_MAX_ELEMENTS
                assert wide.numel() * 576 > SHARED_INLINE_MAX_MACS
                assert wide._stream is not None
                # the convolution's backward here gives the lone task's gradients
                ci, cw = ag.tensor(img, requires_grad=True), ag.tensor(wk, requires_grad=True)
                await (F.max_pool2d(F.conv2d(ci, cw), 2) ** 2).sum().backward()
                await rt.synchronize()
                for t, g in zip((ci, cw), lone_conv_grads):
                    np.testing.assert_allclose(t.grad.numpy(), g, rtol=1e-12, atol=1e-12)
                # a backward pass here gives the lone task's gradients
                shared = [ag.tensor(v, requires_grad=True) for v in (a, w, w * 0.5)]
                loss = _mlp_grads(shared[0], shared[1:])
                await loss.backward()
                await rt.synchronize()
                for t, g in zip(shared, lone_grads):
                    np.testing.assert_allclose(t.grad.numpy(), g, rtol=1e-12, atol=1e-14)
                done.set()
            # the other task is gone and its stream back in the pool: queued again
            assert rt.cpu.shared_inline_max == 0
            y = x * 2.0
            assert y._stream is not None
            np.testing.assert_array_equal((await y.ready()).numpy(), xs * 2.0)


def test_runtimes_in_threads_share_the_inline_mode_while_more_than_one_stream_is_in_use() -> None:
    """Runtimes of their own threads (one training each) take the one GIL as tasks of one runtime do: while
    the process has more than one stream in use, every CPU device runs medium kernels inline; when only one
    is left, it queues them again."""
    xs = np.arange(20_000, dtype=np.float64)
    assert INLINE_MAX_ELEMENTS < xs.size <= SHARED_INLINE_MAX_ELEMENTS
    taken = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]
    seen: dict[str, Any] = {}
    errors: list[BaseException] = []

    async def training(i: int) -> None:
        with trio.fail_after(TIMEOUT):
            rt = ag.current_runtime()
            current_stream(rt.cpu)  # this thread's training takes a stream of its runtime's device
            taken[i].set()
            while not taken[1 - i].is_set():
                await trio.sleep(0.001)
            seen[f"limit{i}"] = rt.cpu.shared_inline_max
            x = ag.tensor(xs)
            await x.ready()
            y = x * 2.0
            seen[f"inline{i}"] = y._stream is None  # ran on this loop thread
            np.testing.assert_array_equal(y.numpy(), xs * 2.0)
            if i == 0:
                leave[1].set()  # the other training ends and its runtime closes
                while not leave[0].is_set():
                    await trio.sleep(0.001)
                seen["limit_alone"] = rt.cpu.shared_inline_max
                z = x * 3.0
                seen["inline_alone"] = z._stream is None
                np.testing.assert_array_equal((await z.ready()).numpy(), xs * 3.0)
            else:
                while not leave[1].is_set():
                    await trio.sleep(0.001)

    def thread_main(i: int) -> None:
        try:
            ag.run(training, i, lanes=2)
        except BaseException as e:
            errors.append(e)
        finally:
            if i == 1:
                leave[0].set()

    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    assert not any(th.is_alive() for th in threads)
    if errors:
        raise errors[0]
    assert seen["limit0"] == seen["limit1"] == SHARED_INLINE_MAX_ELEMENTS
    assert seen["inline0"] and seen["inline1"]
    assert seen["limit_alone"] == 0
    assert not seen["inline_alone"]
