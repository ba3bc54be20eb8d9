"""Polling the RPC sockets for a moment before the event loop sleeps (the way MPI progress engines do).

A small call's round trip is mostly two wake-ups: each end sleeps in ``epoll_wait`` until the other's frame
arrives, and waking a sleeping process (on a virtual machine: an idle virtual CPU) costs tens of
microseconds of latency and CPU at each end, more than the Python work of the call. So when the loop is
about to sleep right after frames went out or came in, `Spinner` (a trio instrument of the loop) polls the
RPC connections' sockets without sleeping, for at most ``SPIN_S``; a reply that arrives meanwhile is
picked up at once, and the loop's own ``epoll_wait`` then returns without sleeping.

It spins only when it can pay off and costs nobody else:

- only right after RPC traffic (frames sent or received since the loop last slept), never when idle;
- never while kernels are queued or running on this process's devices (the lanes need the cores, and
  their completions wake the loop through its wake-up socket, which the spin does not watch);
- never past the loop's next deadline;
- after spins that found nothing, it skips the following ones (twice as many after each miss, up to
  ``MAX_SKIP``): a peer that answers slowly costs at most one spin in ``MAX_SKIP`` sleeps.

Other file descriptors (a child's exit, a thread's result) wait at most ``SPIN_S`` longer to be seen.
"""

from __future__ import annotations

import select
import time
from typing import Any

import trio

from . import _connection

SPIN_S = 150e-6  # the longest spin
MAX_SKIP = 64  # sleeps without a spin after repeated misses


class Spinner(trio.abc.Instrument):
    """The instrument of one trio run: the sockets of the connections that run the RPC protocol in it."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._fds: dict[int, int] = {}  # fd -> connections using it
        self._devices: list[Any] = []
        self._seen = -1  # `_connection.ACTIVITY` when the loop last slept
        self._skip = 0  # sleeps left to skip spinning
        self._misses = 0
        self.spins = 0
        self.hits = 0

    def watch(self, fd: int, device: Any) -> None:
        n = self._fds.get(fd, 0)
        if not n:
            self._poll.register(fd, select.POLLIN | select.POLLPRI)
        self._fds[fd] = n + 1
        if device is not None and device not in self._devices:
            self._devices.append(device)

    def unwatch(self, fd: int) -> None:
        n = self._fds.get(fd, 0) - 1
        if n > 0:
            self._fds[fd] = n
            return
        self._fds.pop(fd, None)
        try:
            self._poll.unregister(fd)
        except (KeyError, ValueError, OSError):
            pass

    def before_io_wait(self, timeout: float) -> None:
        if timeout <= 0:
            return
        act = _connection.ACTIVITY[0]
        if act == self._seen or not self._fds:
            return
        self._seen = act
        if self._skip:
            self._skip -= 1
            return
        for dev in self._devices:
            for s in dev.pool.all_streams():
                if not s.query():
                    return
        self.spins += 1
        poll = self._poll.poll
        clock = time.perf_counter
        end = clock() + min(SPIN_S, timeout)
        while True:
            if poll(0):
                self.hits += 1
                self._misses = 0
                return
            if clock() >= end:
                break
        self._misses += 1
        self._skip = min(MAX_SKIP, 1 << (self._misses - 1)) if self._misses > 1 else 0


_SPINNER: trio.lowlevel.RunVar[Spinner | None] = trio.lowlevel.RunVar("asyncgrad_rpc_spinner", default=None)


def spinner() -> Spinner:
    """This trio run's spinner (installed on first use)."""
    s = _SPINNER.get()
    if s is None:
        s = Spinner()
        trio.lowlevel.add_instrument(s)
        _SPINNER.set(s)
    return s
