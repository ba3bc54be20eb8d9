"""`Worker.remote` and `RRef`: objects that live on a worker."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist

from . import _fns
from .conftest import TIMEOUT


async def test_remote_objects_and_their_methods(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(2) as workers:
            w = workers[0]
            r = await w.remote(_fns.Counter, 10, step=5)
            assert isinstance(r, dist.RRef) and r.owner is w and "Counter" in repr(r)
            assert await r.call("incr") == 15
            assert await r.call("incr", by=2) == 17
            assert await r.call("slow_incr") == 22  # an async method: a task there
            assert await r.call_nowait("incr") == 27
            w1 = await r.call("scale", 0.5)
            np.testing.assert_array_equal(w1.numpy(), np.full((3, 4), 0.5, np.float32))
            w2 = await r.call("scale", 0.5)  # the object's tensor changed there; our copy did not
            np.testing.assert_array_equal(w2.numpy(), np.full((3, 4), 1.0, np.float32))
            np.testing.assert_array_equal(w1.numpy(), np.full((3, 4), 0.5, np.float32))
            with pytest.raises(RuntimeError, match="counter failed"):
                await r.call("fail")
            with pytest.raises(AttributeError):
                await r.call("no_such_method")
            # passed to its owner, an RRef arrives as the object itself
            assert await w.call(_fns.counter_value, r) == 27
            with pytest.raises(LookupError, match="pass it to its owner"):
                await workers[1].call(_fns.counter_value, r)
            # two objects, independent
            r2 = await w.remote(_fns.Counter)
            assert await r2.call("incr") == 1 and await r.call("incr") == 32


async def test_fetch_copies_the_object_back(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            w = workers[0]
            r = await w.remote(_fns.Counter)
            with pytest.raises(TypeError, match="Counter"):  # not something the wire carries
                await r.fetch()
            d = await w.remote(dict, a=1, b=[2, 3])
            assert await d.fetch() == {"a": 1, "b": [2, 3]}
            t = await w.remote(_fns.identity, ag.arange(6.0, dtype=ag.float64).reshape(2, 3).t())
            back = await t.fetch()
            np.testing.assert_array_equal(back.numpy(), np.arange(6.0).reshape(2, 3).T)
            assert back.numpy().strides == (8, 24)  # the Fortran-ordered view kept its layout


async def test_an_rref_that_goes_away_frees_its_object(rt) -> None:
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            w = workers[0]
            before = await w.call(_fns.objects_alive)
            r = await w.remote(_fns.Counter)
            keep = await w.remote(_fns.Counter)
            assert await w.call(_fns.objects_alive) == before + 2
            del r
            gc.collect()
            with trio.fail_after(10):
                while await w.call(_fns.objects_alive) != before + 1:
                    await trio.sleep(0.01)
            keep.close()
            with trio.fail_after(10):
                while await w.call(_fns.objects_alive) != before:
                    await trio.sleep(0.01)
            with pytest.raises(LookupError, match="no object"):
                await keep.call("incr")


async def test_an_rref_to_a_dead_worker_raises_worker_died(rt) -> None:
    import os
    import signal

    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1) as workers:
            w = workers[0]
            r = await w.remote(_fns.Counter)
            os.kill(w.pid, signal.SIGKILL)
            with pytest.raises(dist.WorkerDied):
                await r.call("slow_incr")
            with pytest.raises(dist.WorkerDied):
                await r.call("incr")
