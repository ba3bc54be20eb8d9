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
- while fewer than ``MIN_HIT_RATE`` of the recent spins found a frame (a running average), it spins only
  once in ``PROBE_EVERY`` chances (for up to ``PROBE_S``, long enough for a round trip to a peer that
  sleeps too): a peer that answers slowly costs a spin now and then, not every time.

Other file descriptors (a child's exit, a thread's result) wait at most ``PROBE_S`` longer to be seen.
"""

from __future__ import annotations

import os
import select
import time
from typing import Any

import trio

from . import _connection


def _spin_s() -> float:
    """``ASYNCGRAD_RPC_SPIN_US`` (microseconds; 0 turns spinning off, e.g. on a machine shared with busy
    processes, where a spinner may hold the core its peer needs), 150 by default."""
    try:
        return max(0.0, float(os.environ.get("ASYNCGRAD_RPC_SPIN_US", "150"))) * 1e-6
    except ValueError:
        return 150e-6


SPIN_S = _spin_s()  # the longest spin
MIN_HIT_RATE = 0.25  # spin every time while at least this share of recent spins found a frame
PROBE_EVERY = 16  # below it: one spin in this many chances,
PROBE_S = 2 * SPIN_S  # and that one longer: a round trip to a peer that sleeps too (two wake-ups) fits in it
_DECAY = 0.9  # weight of the past in the running hit rate


class Spinner(trio.abc.Instrument):
    """The instrument of one trio run: the sockets of the connections that run the RPC protocol in it."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._fds: dict[int, int] = {}  # fd -> connections using it
        self._devices: dict[Any, int] = {}  # the devices the served calls run on -> connections using them
        self._seen = -1  # `_connection.ACTIVITY` when the loop last slept
        self._rate = 1.0  # running share of spins that found a frame
        self._chances = 0  # chances passed up since the rate fell low
        self.spins = 0
        self.hits = 0

    def watch(self, fd: int, device: Any) -> None:
        """Poll ``fd`` from now on; never while ``device`` (None: none) has kernels queued."""
        n = self._fds.get(fd, 0)
        if not n:
            self._poll.register(fd, select.POLLIN | select.POLLPRI)
        self._fds[fd] = n + 1
        if device is not None:
            self._devices[device] = self._devices.get(device, 0) + 1

    def unwatch(self, fd: int, device: Any) -> None:
        """The connection on ``fd`` (watched with ``device``) is done."""
        if device is not None:
            m = self._devices.get(device, 0) - 1
            if m > 0:
                self._devices[device] = m
            else:
                self._devices.pop(device, None)
        n = self._fds.get(fd, 0) - 1
        if n > 0:
            self._fds[fd] = n
            return
        self._fds.pop(fd, None)
        try:
            self._poll.unregister(fd)
        except (KeyError, ValueError, OSError):
            pass
        if not self._fds:  # the last connection: out of the loop's way until another one runs
            try:
                if _SPINNER.get() is self:
                    _SPINNER.set(None)
                trio.lowlevel.remove_instrument(self)
            except (KeyError, RuntimeError):  # removed already, or the run is over
                pass

    def before_io_wait(self, timeout: float) -> None:
        if timeout <= 0:
            return
        act = _connection.ACTIVITY[0]
        if act == self._seen or not self._fds:
            return
        self._seen = act
        spin = SPIN_S
        if self._rate < MIN_HIT_RATE:
            self._chances += 1
            if self._chances < PROBE_EVERY:
                return
            self._chances = 0
            spin = PROBE_S
        for dev in self._devices:
            for s in dev.pool.all_streams():
                if not s.query():
                    return
        self.spins += 1
        poll = self._poll.poll
        clock = time.perf_counter
        end = clock() + min(spin, timeout)
        while True:
            if poll(0):
                self.hits += 1
                self._rate = self._rate * _DECAY + (1.0 - _DECAY)
                return
            if clock() >= end:
                break
        self._rate *= _DECAY


_SPINNER: trio.lowlevel.RunVar[Spinner | None] = trio.lowlevel.RunVar("asyncgrad_rpc_spinner", default=None)


def spinner() -> Spinner:
    """This trio run's spinner (installed on first use)."""
    s = _SPINNER.get()
    if s is None:
        s = Spinner()
        if SPIN_S > 0:
            trio.lowlevel.add_instrument(s)
        _SPINNER.set(s)
    return s
