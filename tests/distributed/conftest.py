"""Helpers for the RPC tests: counting child processes, threads and file descriptors."""

from __future__ import annotations

import os
import threading

import pytest

import asyncgrad as ag

TIMEOUT = 60  # generous: these tests start real processes on a shared 2-core machine


def children() -> set[int]:
    """Process ids whose parent is this process (zombies included: they are not reaped yet)."""
    me = os.getpid()
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if int(fields[1]) == me:
            out.add(int(name))
    return out


def fds() -> set[str]:
    """The open file descriptors, without the ones a lane holds for a moment to read /proc (the BLAS load
    sampler reads /proc/stat every 0.25 s, on its own thread: a listing may catch it open)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing (that one, too, was only held for a moment)
            continue
        if not target.startswith("/proc/"):
            out.add(fd)
    return out


def threads() -> set[threading.Thread]:
    """The live threads. Compare with ``now <= before``: trio's idle cached threads may exit meanwhile."""
    return set(threading.enumerate())


@pytest.fixture
async def rt():
    async with ag.open_runtime(lanes=2) as r:
        yield r
