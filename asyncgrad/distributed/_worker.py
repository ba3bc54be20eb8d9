"""A worker process: connect to the parent, prove the secret, open a runtime, serve calls until told to stop.

    python -m asyncgrad.distributed.worker --connect HOST:PORT --token-file FILE [--name NAME] [--cpus 0,1]

Local workers started by `open_workers` run exactly this, with ``--token-file -`` (the secret on stdin).
The worker also listens on loopback for peers (other connections that prove the same secret); a
malformed frame on any connection closes that connection only. The worker ends, with exit status 0,
when its parent asks it to (also in answer to its joining, when the parent is closing already) or when
the connection to its parent goes away.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import socket
import sys
from typing import Any

import numpy as np
import trio

from ..runtime import open_runtime, set_default_dtype, set_grad_enabled
from . import _mesh
from ._connection import Connection, Listener, client_handshake, connect
from ._errors import ProtocolError
from ._peer import HELLO, JOIN, READY, SHUTDOWN, Node, Peer, read_message, send_message, serve_connections, set_node
from ._wire import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_META_BYTES

log = logging.getLogger("asyncgrad.distributed")


def _read_token(path: str) -> bytes:
    if path == "-":
        data = sys.stdin.buffer.readline()
    else:
        with open(path, "rb") as f:
            data = f.read()
    data = data.strip()
    if not data:
        raise SystemExit(f"asyncgrad worker: no secret in {'stdin' if path == '-' else path}")
    return data


def pin_to_cpus(cpus: list[int]) -> None:
    """Run this process on ``cpus`` only: every thread it has now (OpenBLAS's pool, started when numpy
    loaded) and, through the main thread's mask, every thread it starts later (the runtime's lanes).

    Linux only (``/proc/self/task``); elsewhere, or for CPUs this process may not use, nothing changes.
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that just ended, or CPUs outside this process's cpuset
            pass


def _cpu_list(text: str) -> list[int]:
    try:
        cpus = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cpus takes CPU numbers separated by commas, got {text!r}") from None
    if not cpus or cpus[0] < 0:
        raise argparse.ArgumentTypeError(f"--cpus takes CPU numbers separated by commas, got {text!r}")
    return cpus


def _apply_config(config: dict[str, Any], node: Node) -> None:
    # the parent's import path, in its order, so its modules (and test modules) resolve the same here
    theirs = [
        p for p in config.get("sys_path") or [] if isinstance(p, str) and (os.path.isdir(p) or p.endswith(".zip"))
    ]
    if theirs:
        sys.path[:] = [*dict.fromkeys(theirs), *(p for p in sys.path if p not in theirs)]
    node.main_path = config.get("main_path") if isinstance(config.get("main_path"), str) else None
    node.main_name = config.get("main_name") if isinstance(config.get("main_name"), str) else None
    dtype = config.get("dtype")
    if isinstance(dtype, str):
        set_default_dtype(np.dtype(dtype))


async def serve(address: str, secret: bytes, name: str | None = None, connect_timeout: float = 30.0) -> None:
    """Join the parent at ``address`` and serve it (and peers) until shut down."""
    sock = await connect(address, connect_timeout)
    limits = {
        "max_meta_bytes": DEFAULT_MAX_META_BYTES,
        "max_frame_bytes": DEFAULT_MAX_FRAME_BYTES,
        "max_inflight_bytes": 1 << 30,
    }
    conn = Connection(
        sock, "parent", max_meta_bytes=limits["max_meta_bytes"], max_frame_bytes=limits["max_frame_bytes"]
    )
    try:
        await client_handshake(conn, secret)
        send_message(conn, [JOIN, {"name": name, "pid": os.getpid(), "host": socket.gethostname()}])
        msg = await read_message(conn, 60.0)
        if msg == [SHUTDOWN]:  # the parent closed while this worker started: there is nothing to serve
            return
        if msg[0] != HELLO or len(msg) != 2 or not isinstance(msg[1], dict):
            raise ProtocolError(f"the parent's answer is not HELLO: {msg!r:.80}")
        config = msg[1]
        got = config.get("limits")
        if isinstance(got, dict):
            limits.update({k: v for k, v in got.items() if k in limits and type(v) is int and v > 0})
            conn.max_meta_bytes = limits["max_meta_bytes"]
            conn.max_frame_bytes = limits["max_frame_bytes"]
        node = Node(str(config.get("name") or name or f"worker-{os.getpid()}"))
        node.shutdown_requested = trio.Event()
        set_node(node)
        _apply_config(config, node)
        rt_opts: dict[str, Any] = config["runtime"] if isinstance(config.get("runtime"), dict) else {}
        lanes = rt_opts.get("lanes") if type(rt_opts.get("lanes")) is int else None
        blas = rt_opts.get("blas_threads") if type(rt_opts.get("blas_threads")) is int else None
        unix_dir = config.get("unix_dir")
        async with open_runtime(lanes=lanes, blas_threads=blas):
            set_grad_enabled(bool(config.get("grad", True)))
            if isinstance(unix_dir, str) and os.path.isdir(unix_dir):
                listener = Listener(unix_path=os.path.join(unix_dir, f"{node.name}.sock"))
            else:
                listener = Listener("127.0.0.1", 0)
            # everything made so far (modules, the runtime) lives as long as the worker: keep it out of the
            # garbage collector's scans, which would otherwise walk it on every full collection
            gc.freeze()
            try:
                parent = Peer(
                    conn, node, "parent", max_inflight_bytes=limits["max_inflight_bytes"], accepts_shutdown=True
                )
                async with trio.open_nursery() as nursery:
                    await nursery.start(parent.run)
                    _mesh.install(nursery, secret, limits, parent)  # calls to peers made from here
                    nursery.start_soon(functools.partial(serve_connections, listener, secret, node, limits=limits))
                    send_message(
                        conn,
                        [READY, {"pid": os.getpid(), "host": socket.gethostname(), "address": listener.address}],
                    )
                    async with trio.open_nursery() as waiters:

                        async def until(event: trio.Event) -> None:
                            await event.wait()
                            waiters.cancel_scope.cancel()

                        waiters.start_soon(until, node.shutdown_requested)
                        waiters.start_soon(until, parent.lost)
                    nursery.cancel_scope.cancel()
            finally:
                listener.close()
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m asyncgrad.distributed.worker",
        description="An asyncgrad worker: joins the parent at HOST:PORT and serves its calls.",
    )
    ap.add_argument("--connect", required=True, metavar="HOST:PORT", help="the parent's address (or unix:PATH)")
    ap.add_argument("--token-file", required=True, metavar="FILE", help="the cluster secret ('-': read stdin)")
    ap.add_argument("--name", default=None, help="this worker's name (default: given by the parent)")
    ap.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to keep trying to connect")
    ap.add_argument(
        "--cpus", type=_cpu_list, default=None, metavar="LIST",
        help="run on these CPUs only, e.g. 0,1 (a population's local workers each get cores of their own)",
    )
    args = ap.parse_args(argv)
    if args.cpus is not None:
        pin_to_cpus(args.cpus)  # before the runtime starts its lanes: they inherit the mask
    logging.basicConfig(level=logging.WARNING, format="asyncgrad worker %(process)d: %(levelname)s %(message)s")
    secret = _read_token(args.token_file)
    try:
        trio.run(serve, args.connect, secret, args.name, args.connect_timeout)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        log.error("the worker failed: %s: %s", type(e).__name__, e, exc_info=True)
        return 1
    return 0
