"""Module-level functions and classes the tests call on workers (sent by name, imported there)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist

# what a worker saw, read back by later calls (module state lives per process)
SEEN: dict[str, Any] = {}


def add(a: Any, b: Any = 0) -> Any:
    return a + b


async def async_add(a: Any, b: Any) -> Any:
    await trio.sleep(0.001)
    return a + b


def echo(*args: Any, **kwargs: Any) -> Any:
    return args, kwargs


def identity(x: Any) -> Any:
    return x


def double(x: Any) -> Any:
    return x * 2


def describe(x: Any) -> Any:
    """How a value arrived: its type, dtype, shape, strides, requires_grad."""
    if isinstance(x, ag.Tensor):
        a = x.numpy()
        return ["tensor", str(a.dtype), list(a.shape), list(a.strides), x.requires_grad, a.flags.writeable]
    if isinstance(x, np.ndarray):
        return ["ndarray", str(x.dtype), list(x.shape), list(x.strides), False, x.flags.writeable]
    return [type(x).__name__]


def environment() -> dict[str, Any]:
    return {
        "dtype": str(ag.get_default_dtype()),
        "grad": ag.is_grad_enabled(),
        "pid": os.getpid(),
        "default_float": ag.tensor([1.5]).dtype.str,
    }


def raise_value_error(msg: str) -> None:
    raise ValueError(msg)


def raise_key_error() -> None:
    {}["missing"]


class CustomError(Exception):
    pass


def raise_custom() -> None:
    raise CustomError("a custom failure")


async def raise_in_nursery() -> None:
    async def child() -> None:
        raise ZeroDivisionError("in a child task")

    async with trio.open_nursery() as n:
        n.start_soon(child)


def raise_system_exit() -> None:
    raise SystemExit(3)


def return_a_set() -> Any:
    return [1, {2, 3}]


def pid() -> int:
    return os.getpid()


def sleep_sync(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


async def sleep(seconds: float, value: Any = None) -> Any:
    await trio.sleep(seconds)
    return value


async def wait_to_be_cancelled(key: str) -> None:
    """Sleeps until cancelled; records in SEEN that it saw trio.Cancelled."""
    SEEN[key] = "started"
    try:
        await trio.sleep(3600)
    except trio.Cancelled:
        SEEN[key] = "cancelled"
        raise


def seen(key: str) -> Any:
    return SEEN.get(key)


async def wait_seen(key: str, value: Any, timeout: float = 10.0) -> Any:
    with trio.move_on_after(timeout):
        while SEEN.get(key) != value:
            await trio.sleep(0.01)
    return SEEN.get(key)


_concurrent = {"now": 0, "max": 0}


async def hold(seconds: float, payload: Any = None) -> int:
    """Counts how many of these run at once (for the backpressure test); returns the count it saw."""
    _concurrent["now"] += 1
    _concurrent["max"] = max(_concurrent["max"], _concurrent["now"])
    try:
        await trio.sleep(seconds)
    finally:
        _concurrent["now"] -= 1
    return _concurrent["max"]


def max_concurrent() -> int:
    return _concurrent["max"]


def threads() -> list[str]:
    return [t.name for t in threading.enumerate()]


def stats() -> Any:
    return dist.statistics().frames_rejected, dist.statistics().connections_refused


class Counter:
    """An object that lives on a worker behind an RRef."""

    def __init__(self, start: int = 0, *, step: int = 1) -> None:
        self.value = start
        self.step = step
        self.weights = ag.zeros(3, 4)

    def incr(self, by: int | None = None) -> int:
        self.value += self.step if by is None else by
        return self.value

    async def slow_incr(self) -> int:
        await trio.sleep(0.01)
        return self.incr()

    def scale(self, k: float) -> ag.Tensor:
        with ag.no_grad():
            self.weights += k
        return self.weights

    def fail(self) -> None:
        raise RuntimeError("counter failed")


def counter_value(counter: Counter) -> int:
    """Receives an RRef's object itself when the RRef is passed to its owner."""
    return counter.value


def objects_alive() -> int:
    return dist.statistics().objects


def shape_of(x: Any) -> list[int]:
    return list(x.shape)


def stream_report() -> dict[str, Any]:
    """The stream this call runs on, and the worker's stream pool."""
    s = ag.current_stream()
    pool = dist.statistics().pool
    return {
        "stream": s.name,
        "draining": pool.streams_draining,
        "in_use": pool.streams_in_use,
        "rpc_in_use": dist.statistics().rpc_streams_in_use,
    }


def leave_slow_work(seconds: float) -> str:
    """Queue slow work on this call's stream and return at once (no synchronisation)."""
    s = ag.current_stream()
    s.submit(lambda: time.sleep(seconds))
    return s.name


async def on_the_call_stream(x: Any) -> Any:
    """Queue slow work, then ``x * 2`` behind it, on the current stream; return without waiting."""
    s = ag.current_stream()
    s.submit(lambda: time.sleep(0.3))
    y = x * 2
    report = stream_report()
    report["pending"] = s.statistics().pending
    return y, report



async def stream_steps(n: int) -> str:
    """Sends n messages to its caller while it runs (the building block of streamed reports)."""
    call = dist.current_call.get()
    assert call is not None
    for i in range(n):
        await call.notify({"step": i, "value": ag.full((2,), float(i))})
        await trio.sleep(0.01)
    return "finished"
