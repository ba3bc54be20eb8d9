"""`open_workers`: start worker processes (each an asyncgrad runtime), connect to them, shut them down.

Local workers run ``python -m asyncgrad.distributed.worker --connect ADDRESS --token-file -`` (the secret
on their stdin); a worker on another host runs the same command with a token file and joins through the
same listener. Leaving the block, normally, on an error or on cancellation, shuts every worker down and
waits for it: no child process, thread or file descriptor is left behind.
"""

from __future__ import annotations

import copy
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, overload

import trio

from ..runtime import get_default_dtype, is_grad_enabled
from . import _dist_autograd, _mesh, _shm
from ._connection import Connection, ConnectionClosed, Listener
from ._dist_autograd import wants_grad
from ._errors import ProtocolError, WorkerDied, WorkersClosed
from ._future import Future
from ._peer import (
    CALL,
    DEFAULT_MAX_INFLIGHT_BYTES,
    HELLO,
    NEW,
    READY,
    SHUTDOWN,
    UNSET,
    Outgoing,
    Peer,
    drive_call,
    read_message,
    send_message,
    serve_connections,
    statistics_from_wire,
    target_of,
    this_node,
)
from ._rref import RRef
from ._streams import RPCStatistics
from ._wire import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_META_BYTES

log = logging.getLogger("asyncgrad.distributed")

SHUTDOWN_TIMEOUT = 10.0  # how long a worker gets to leave on its own before it is killed


class WorkerProcess(Protocol):
    """What `Workers` needs of a started worker process, whoever started it (see `Launcher`).

    ``pid`` may be None until the worker joins (it is then set from what the worker says); ``local`` says
    whether the worker shares this machine's files (so it gets this process's import path and main
    script); ``ended`` whether the process is known to be gone; ``returncode`` its exit status when known
    (None also when it ended and nobody can tell how); ``detail`` why it ended, when its launcher knows.
    """

    pid: int | None
    local: bool

    @property
    def returncode(self) -> int | None: ...

    @property
    def ended(self) -> bool: ...

    @property
    def detail(self) -> str: ...

    async def wait(self) -> int | None:
        """Until the process is gone; its exit status (None: unknown)."""
        ...

    def kill(self) -> None:
        """End it now (no goodbye)."""
        ...

    def close(self) -> None:
        """Free what watching it holds (after it ended)."""
        ...


class Launcher(Protocol):
    """Starts worker processes for `Workers.start` (`open_workers(launcher=)`): local subprocesses by
    default, Ray actors for a population on Ray. A launched worker runs `asyncgrad.distributed._worker.serve`
    (``python -m asyncgrad.distributed.worker`` or its equivalent), joins ``address`` as ``name`` and proves
    ``secret``; everything after that goes over the authenticated connection it opens."""

    def launch(self, name: str, address: str, secret: bytes) -> WorkerProcess: ...


class LocalLauncher:
    """Workers as child processes of this one: ``python -m asyncgrad.distributed.worker``, the secret on
    their stdin, this package first on their import path.

    ``core_groups``: CPU sets to run the workers on, one each (``--cpus``): a worker takes a set no live
    worker of this launcher holds (a replacement takes the dead worker's), and runs unpinned when none is
    free.
    """

    def __init__(self, core_groups: Sequence[Sequence[int]] | None = None) -> None:
        self._groups = [list(g) for g in core_groups or ()]
        self._holders: list[WorkerProcess | None] = [None] * len(self._groups)

    def launch(self, name: str, address: str, secret: bytes) -> WorkerProcess:
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([pkg_root, *(p for p in [env.get("PYTHONPATH")] if p)])
        argv = [
            sys.executable, "-m", "asyncgrad.distributed.worker",
            "--connect", address, "--token-file", "-", "--name", name,
        ]
        free = next((i for i, p in enumerate(self._holders) if p is None or p.ended), None)
        if free is not None:
            argv += ["--cpus", ",".join(str(c) for c in self._groups[free])]
        proc = _Process(argv, env, secret)
        if free is not None:
            self._holders[free] = proc
        return proc


class _Process:
    """A local worker process: spawned on the loop thread, its exit awaited through a pidfd (no threads)."""

    local = True
    detail = ""

    def __init__(self, argv: list[str], env: dict[str, str], secret_hex: bytes) -> None:
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, close_fds=True)
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.write(secret_hex + b"\n")
            self.popen.stdin.close()
        except OSError:  # it died at once; its exit code says why
            pass
        self.pid: int | None = self.popen.pid
        self._pidfd: int | None = None
        # set when the task watching the pidfd stops watching, for whatever reason (the process exited,
        # or that task was cancelled): the other waiters then look again, and one of them takes over
        self._watch: trio.Event | None = None
        try:
            self._pidfd = os.pidfd_open(self.popen.pid)
        except (AttributeError, OSError):
            self._pidfd = None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    @property
    def ended(self) -> bool:
        return self.popen.poll() is not None

    async def wait(self) -> int:
        # One task at a time watches the pidfd (trio allows one reader per descriptor); the others wait
        # for it to stop. A watcher that is cancelled (the worker's monitor, when the block around the
        # workers is cancelled) wakes them too, so a shielded close still sees the exit at once: before,
        # it waited for an event that the cancelled watcher never set, and sat out the 10 s kill timeout.
        while self.popen.poll() is None:
            if self._watch is not None:
                await self._watch.wait()
                continue
            self._watch = watch = trio.Event()
            try:
                if self._pidfd is not None:
                    await trio.lowlevel.wait_readable(self._pidfd)
                else:
                    await trio.sleep(0.02)
            finally:
                self._watch = None
                watch.set()
        if self._watch is None:  # (a watcher still to wake from the readable pidfd closes it itself)
            self._close_pidfd()
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            try:
                trio.lowlevel.notify_closing(self._pidfd)
            except RuntimeError:
                pass
            os.close(self._pidfd)
            self._pidfd = None

    def close(self) -> None:
        self._close_pidfd()


class Worker:
    """A worker process (or a worker on another host) and the connection to it.

    ``name`` is its name (``"worker0"``...), ``pid`` its process id, ``address`` where it listens for peers.
    """

    def __init__(self, workers: Workers, name: str, index: int) -> None:
        self._workers = workers
        self.name = name
        self.index = index
        self.peer: Peer | None = None
        self.process: WorkerProcess | None = None
        self.pid: int | None = None
        self.host: str | None = None
        self.address: str | None = None
        self._ready = trio.Event()
        self._joined = False  # it connected and introduced itself (`Workers._on_join` took it)
        self._failed: BaseException | None = None
        self._failure_raised = False

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"dead (exit code {self.exitcode})"
        return f"<Worker {self.name} pid={self.pid} {state}>"

    @property
    def exitcode(self) -> int | None:
        """The worker process's exit status once it ended (negative: the signal that killed it)."""
        return self.process.returncode if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.peer is not None and self.peer.death is None and not self.peer.lost.is_set()

    def _live_peer(self) -> Peer:
        peer = self.peer
        if peer is None:
            raise WorkerDied(self.name, self.exitcode, "it never joined")
        if peer.death is not None:
            raise copy.copy(peer.death)
        return peer

    def _timeout(self, timeout: Any) -> float | None:
        t = self._workers._timeout if timeout is UNSET else timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {t!r}")
        return t  # type: ignore[no-any-return]

    # ---- calls -------------------------------------------------------------------------------------

    async def call(self, fn: Any, /, *args: Any, timeout: Any = UNSET, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the worker and return its result (copied back).

        ``fn`` is a module-level function (plain or ``async def``; an async one runs as a task of the
        worker's runtime) or a ``"module:name"`` string; it is sent by name, never pickled. Cancelling
        the caller cancels the remote task; ``timeout`` (seconds) does too, raising `TimeoutError`.
        """
        target = target_of(fn)
        if wants_grad(args, kwargs):  # recorded as a node of the caller's graph (distributed autograd)
            return await _dist_autograd.call(self, target, args, kwargs, timeout)
        t = self._timeout(timeout)
        peer = self._live_peer()
        out = peer.prepare(CALL, [target], args, kwargs, f"the call of {target}")
        return await peer.roundtrip(out, t)

    async def call_streaming(
        self, fn: Any, /, *args: Any, on_notify: Callable[[Any], None], timeout: Any = UNSET, what: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """`call`, and every message the remote function streams back while it runs
        (``await current_call().notify(msg)`` there) goes to ``on_notify(msg)`` here, in order, as it arrives.

        ``what`` names the call in errors (default: "the call of module:name").
        """
        target = target_of(fn)
        t = self._timeout(timeout)
        peer = self._live_peer()
        out = peer.prepare(CALL, [target], args, kwargs, what or f"the call of {target}")
        return await peer.roundtrip(out, t, on_notify=on_notify)

    def call_nowait(self, fn: Any, /, *args: Any, timeout: Any = UNSET, **kwargs: Any) -> Future:
        """Start ``fn(*args, **kwargs)`` on the worker; returns a `Future` of its result at once.

        The tensors in the arguments are the values queued so far (their copy-out waits only for them).
        """
        target = target_of(fn)
        t = self._timeout(timeout)
        peer = self._live_peer()
        out = peer.prepare(CALL, [target], args, kwargs, f"the call of {target}")
        return self._drive(peer, out, t, target)

    def _drive(self, peer: Peer, out: Outgoing, timeout: Any, what: str | None = None) -> Future:
        nursery = self._workers._nursery
        fut = Future(nursery, what or out.what)
        scope = trio.CancelScope()
        fut._cancel = scope.cancel
        nursery.start_soon(drive_call, peer, out, self._timeout(timeout), fut, scope)
        return fut

    async def remote(self, cls: Any, /, *args: Any, timeout: Any = UNSET, **kwargs: Any) -> RRef:
        """Create ``cls(*args, **kwargs)`` on the worker; returns an `RRef` to it."""
        target = target_of(cls)
        t = self._timeout(timeout)
        peer = self._live_peer()
        out = peer.prepare(NEW, [target], args, kwargs, f"the creation of {target}")
        object_id = await peer.roundtrip(out, t)
        return RRef(self, peer, object_id, target.partition(":")[2])

    async def statistics(self) -> RPCStatistics:
        """The worker's RPC counters and its CPU stream pool's statistics."""
        d = await self.call("asyncgrad.distributed._peer:statistics_for_wire")
        return statistics_from_wire(d)


class Workers(Sequence[Worker]):
    """The workers opened by `open_workers`: a read-only sequence (``workers[i]``, ``len(workers)``,
    iteration and ``in`` come from `Sequence`), and `by_name`."""

    def __init__(
        self,
        *,
        secret: bytes,
        timeout: float | None,
        limits: dict[str, int],
        runtime_options: dict[str, Any],
        launcher: Launcher | None = None,
    ) -> None:
        self._secret = secret
        self._launcher: Launcher = launcher if launcher is not None else LocalLauncher()
        self._timeout = timeout
        self._limits = limits
        self._runtime_options = runtime_options
        self._workers: list[Worker] = []
        self._expected_remote = 0
        self._remote: list[Worker] = []  # the workers that joined from elsewhere (`--connect`)
        self._nursery: trio.Nursery = None  # type: ignore[assignment]
        self._listener: Listener | None = None
        self._tmpdir: str | None = None
        self.closing = False
        self.address: str = ""  # where workers (and peers) connect

    @overload
    def __getitem__(self, i: int) -> Worker: ...
    @overload
    def __getitem__(self, i: slice) -> list[Worker]: ...
    def __getitem__(self, i: int | slice) -> Worker | list[Worker]:
        return self._workers[i]

    def __len__(self) -> int:
        return len(self._workers)

    def __repr__(self) -> str:
        return f"<Workers {[w.name for w in self._workers]} at {self.address}>"

    @property
    def names(self) -> list[str]:
        return [w.name for w in self._workers]

    def by_name(self, name: str) -> Worker:
        for w in self._workers:
            if w.name == name:
                return w
        raise KeyError(f"no worker named {name!r}; the workers are {self.names}")

    # ---- starting ----------------------------------------------------------------------------------

    def _config(self, w: Worker, local: bool) -> dict[str, Any]:
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        main_name = spec.name if spec is not None and getattr(spec, "name", None) not in (None, "__main__") else None
        main_path = getattr(main, "__file__", None)
        return {
            "name": w.name,
            "dtype": get_default_dtype().str,
            "grad": is_grad_enabled(),
            "sys_path": [p for p in sys.path if isinstance(p, str)] if local else [],
            "main_path": os.path.abspath(main_path) if isinstance(main_path, str) and local else None,
            "main_name": main_name,
            "runtime": self._runtime_options,
            "limits": self._limits,
            "unix_dir": self._tmpdir if local else None,
        }

    async def _on_join(self, conn: Connection, info: dict[str, Any]) -> None:
        """A worker connected and proved the secret: send its configuration, wait until it is ready."""
        if self.closing:
            # the workers are closing (a replacement the population started just before, a remote worker
            # late to join): it is not needed, and it leaves at once on this answer (exit status 0)
            log.debug("a worker joining as %r while the workers close: told to leave", info.get("name"))
            try:
                send_message(conn, [SHUTDOWN])
            except ConnectionClosed:
                pass
            conn.close()
            return
        name = info.get("name")
        w: Worker | None = None
        if isinstance(name, str):  # a local worker we started: its name and process id must match
            for cand in self._workers:
                if cand.name == name and cand.process is not None and not cand._ready.is_set():
                    # a launcher that cannot know the pid before the worker runs (a Ray actor) leaves it None
                    pid_ok = cand.process.pid is None or info.get("pid") == cand.process.pid
                    if pid_ok and cand.peer is None:
                        w = cand
                        w._joined = True
                        if cand.process.pid is None and type(info.get("pid")) is int:
                            cand.process.pid = info["pid"]
                    break
        if w is None and self._expected_remote > 0:
            self._expected_remote -= 1
            w = Worker(self, self._free_name(name), len(self._workers))
            w._joined = True
            self._workers.append(w)
            self._remote.append(w)
        if w is None:
            log.warning("refused a worker joining as %r from %s: no such worker is expected", name, conn.peer)
            conn.close()
            return
        local = w.process is not None and w.process.local
        try:
            send_message(conn, [HELLO, self._config(w, local)])
            msg = await read_message(conn, 120.0)
            if msg[0] != READY or len(msg) != 2 or not isinstance(msg[1], dict):
                raise ProtocolError(f"a worker's answer that is not READY: {msg!r:.80}")
        except (ProtocolError, ConnectionClosed, trio.TooSlowError) as e:
            log.error("worker %s could not start: %s", w.name, e)
            conn.close()
            w._failed = e
            w._ready.set()
            return
        ready = msg[1]
        w.pid = ready.get("pid") if isinstance(ready.get("pid"), int) else w.pid
        w.host = ready.get("host") if isinstance(ready.get("host"), str) else None
        w.address = ready.get("address") if isinstance(ready.get("address"), str) else None
        w.peer = Peer(conn, this_node(), w.name, max_inflight_bytes=self._limits["max_inflight_bytes"])
        if self.closing:  # the workers began to close while it started (`_close` told the others already)
            try:
                send_message(conn, [SHUTDOWN])
            except ConnectionClosed:  # gone already: its supervisor hears of it
                pass
        _mesh.note_worker(w)  # so its siblings can look its address up
        await self._nursery.start(self._supervise, w)
        w._ready.set()

    def _free_name(self, name: Any) -> str:
        taken = {w.name for w in self._workers}
        if isinstance(name, str) and name and name not in taken:
            return name
        i = len(self._workers)
        while f"worker{i}" in taken:
            i += 1
        return f"worker{i}"

    async def _supervise(self, w: Worker, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection to ``w``; when it ends, fail its calls (with its exit code, if it died)."""
        peer = w.peer
        assert peer is not None
        try:
            await peer.run(task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                code = None
                if w.process is not None and not self.closing:
                    with trio.move_on_after(1.5):
                        code = await w.process.wait()
                if self.closing:
                    err: BaseException = WorkersClosed(f"the workers closed; {w.name} is shut down")
                else:
                    err = WorkerDied(w.name, code if code is not None else w.exitcode)
                    log.error("%s", err)
                peer.fail(err)

    async def start(self, n: int, *, start_timeout: float = 60.0, launcher: Launcher | None = None) -> list[Worker]:
        """Start ``n`` more workers with ``launcher`` (default: the one these workers were opened with) and
        wait until they (and any still starting) are ready; returns the new ones.

        A worker that ends before it is ready raises `WorkerDied`; one not ready within ``start_timeout``
        seconds, `TimeoutError`.
        """
        if self.closing:
            raise WorkersClosed("the workers are closed")
        launch = (launcher or self._launcher).launch
        base = len(self._workers)
        new: list[Worker] = []
        for i in range(n):
            w = Worker(self, self._free_name(f"worker{base + i}"), base + i)
            self._workers.append(w)
            new.append(w)
            w.process = launch(w.name, self.address, self._secret)
            w.pid = w.process.pid
            self._nursery.start_soon(self._watch_exit, w)
        await self._wait_ready(start_timeout, new)
        return new

    async def _watch_exit(self, w: Worker) -> None:
        """A local worker that exits before joining fails the start at once, with its exit code."""
        assert w.process is not None
        code = await w.process.wait()
        if not w._ready.is_set():
            if self.closing:  # stopped by `_close` while it started
                w._failed = WorkersClosed(f"the workers closed while {w.name} started")
            else:
                detail = w.process.detail
                w._failed = WorkerDied(w.name, code, "before it was ready" + (f": {detail}" if detail else ""))
            w._ready.set()
        elif w.peer is not None and not w.peer.lost.is_set():
            # the process is gone but its connection lingers (should not happen): close it
            w.peer.conn.close()

    async def _wait_ready(self, timeout: float, which: list[Worker] | None = None) -> None:
        """Until ``which`` (default: every worker) and the remote workers expected are ready; raises the
        failure of the first that failed (a worker that failed to start earlier fails no later start)."""
        with trio.move_on_after(timeout) as cs:
            for w in list(self._workers) if which is None else which:
                await w._ready.wait()
                if w._failed is not None:
                    raise w._failed
            while self._expected_remote > 0:
                await trio.sleep(0.05)
            # a remote worker may have joined while the local ones started: it is ready only after HELLO
            for w in list(self._workers) if which is None else list(self._remote):
                await w._ready.wait()
                if w._failed is not None and (which is None or not w._failure_raised):
                    w._failure_raised = True  # a later start is not failed by it again
                    raise w._failed
        if cs.cancelled_caught:
            missing = [w.name for w in (self._workers if which is None else which) if not w._ready.is_set()]
            extra = f" and {self._expected_remote} remote worker(s)" if self._expected_remote else ""
            raise TimeoutError(f"workers {missing}{extra} did not start within {timeout:g} s")

    # ---- closing -----------------------------------------------------------------------------------

    async def _close(self) -> None:
        self.closing = True
        with trio.CancelScope(shield=True):
            for w in self._workers:
                if w.peer is not None and not w.peer.lost.is_set():
                    try:
                        send_message(w.peer.conn, [SHUTDOWN])
                    except ConnectionClosed:
                        pass
                elif w.process is not None and not w._joined and not w.process.ended:
                    # launched, not joined yet (a replacement for a worker that died, say): it has nothing
                    # to finish, and nothing can tell it to leave until it has booted (its interpreter
                    # and imports, a second or more), so stop it now rather than wait for it to join
                    log.debug("worker %s was still starting when the workers closed: stopping it", w.name)
                    w.process.kill()
                # (one that joined and is not ready yet is told to leave by `_on_join` once it is)
            with trio.move_on_after(SHUTDOWN_TIMEOUT):
                for w in self._workers:
                    if w.process is not None:
                        await w.process.wait()
                    elif w.peer is not None:
                        await w.peer.lost.wait()
            for w in self._workers:
                if w.process is not None and not w.process.ended:
                    log.warning("worker %s did not shut down within %g s: killing it", w.name, SHUTDOWN_TIMEOUT)
                    w.process.kill()
                    await w.process.wait()
                if w.peer is not None:
                    w.peer.fail(WorkersClosed(f"the workers closed; {w.name} is shut down"))
                if w.process is not None:
                    w.process.close()
            if self._listener is not None:
                self._listener.close()
            _shm.pool.clear()  # free shared segments kept for reuse: no descriptor left behind
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)


def _read_or_make_secret(secret: bytes | str | None, token_file: str | os.PathLike[str] | None) -> bytes:
    if secret is not None:
        out = secret.encode() if isinstance(secret, str) else bytes(secret)
        if not out or out != out.strip() or b"\n" in out:
            raise ValueError("a secret is a non-empty token without newlines or surrounding whitespace")
        return out
    if token_file is not None:
        path = os.fspath(token_file)
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read().strip()
            if not data:
                raise ValueError(f"the token file {path} is empty")
            return data
        token = secrets.token_hex(32).encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(token + b"\n")
        return token
    return secrets.token_hex(32).encode()


@asynccontextmanager
async def open_workers(
    n: int | None = None,
    *,
    lanes: int | None = None,
    blas_threads: int | None = None,
    timeout: float | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    transport: str = "auto",
    secret: bytes | str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    remote: int = 0,
    start_timeout: float = 60.0,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    launcher: Launcher | None = None,
) -> AsyncIterator[Workers]:
    """Start ``n`` local worker processes (default: one per core), each running an asyncgrad runtime,
    and connect to them; yields the `Workers`.

    Args:
        n: Local worker processes to start.
        lanes: Lanes of each worker's runtime (default: the cores divided among the local workers).
        blas_threads: BLAS threads per lane in each worker (default as `open_runtime`'s).
        timeout: Default timeout (seconds) of every call; None waits for as long as it takes.
        host, port: Where to listen for workers. Loopback unless told otherwise; give a reachable
            address (and a fixed port) for workers on other hosts.
        transport: ``"unix"`` (Unix sockets: local workers only; a large tensor's buffer is handed over
            as a shared segment, staged once, never copied again), ``"tcp"`` (TCP_NODELAY; received
            straight into the destination buffer) or ``"auto"``: unix unless ``remote`` workers join.
        secret, token_file: The cluster secret every connection proves (HMAC challenge). By default a
            fresh random one; ``token_file`` reads it from a file, or writes a new one there (mode 0600)
            for workers on other hosts: ``python -m asyncgrad.distributed.worker --connect HOST:PORT
            --token-file FILE``.
        remote: How many such workers to wait for, besides the local ones.
        start_timeout: Seconds the workers get to start and join.
        max_inflight_bytes: Backpressure: bytes of calls sent to one worker and not yet answered (a call
            waits for room; one larger than this goes alone).
        max_frame_bytes: Largest payload (tensor bytes) of one message; a larger one is refused.
        launcher: What starts the ``n`` workers (and those `Workers.start` adds): a `Launcher`; default
            local child processes. One that starts them elsewhere (Ray actors) needs ``transport="tcp"``.

    Workers start with this task's default dtype and grad mode. Leaving the block shuts them down.

    Functions defined in the main script are found by workers too: they load the script as a module (as
    multiprocessing's spawn does), so keep its top-level code under ``if __name__ == "__main__":``.
    """
    cores = os.cpu_count() or 1
    n = cores if n is None else n
    if n < 0 or remote < 0 or n + remote < 1:
        raise ValueError(f"open_workers needs at least one worker, got n={n}, remote={remote}")
    if transport not in ("tcp", "unix", "auto"):
        raise ValueError(f"transport is 'auto', 'tcp' or 'unix', got {transport!r}")
    if transport == "auto":
        transport = "tcp" if remote else "unix"
    if transport == "unix" and remote:
        raise ValueError("workers on other hosts need transport='tcp'")
    runtime_options = {
        "lanes": lanes if lanes is not None else max(1, cores // max(n, 1)),
        "blas_threads": blas_threads,
    }
    limits = {
        "max_meta_bytes": DEFAULT_MAX_META_BYTES,
        "max_frame_bytes": int(max_frame_bytes),
        "max_inflight_bytes": int(max_inflight_bytes),
    }
    ws = Workers(
        secret=_read_or_make_secret(secret, token_file),
        timeout=timeout,
        limits=limits,
        runtime_options=runtime_options,
        launcher=launcher,
    )
    ws._expected_remote = remote
    if transport == "unix":
        ws._tmpdir = tempfile.mkdtemp(prefix="asyncgrad-rpc-")
        ws._listener = Listener(unix_path=os.path.join(ws._tmpdir, "parent.sock"))
    else:
        ws._listener = Listener(host, port)
    ws.address = ws._listener.address
    body_error: list[BaseException] = []
    try:
        async with trio.open_nursery() as nursery:
            ws._nursery = nursery
            try:
                nursery.start_soon(_serve, ws)
                if n:
                    await ws.start(n, start_timeout=start_timeout)
                else:
                    await ws._wait_ready(start_timeout)
                try:
                    yield ws
                except BaseException as e:
                    body_error.append(e)
                    raise
            finally:
                await ws._close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        leaf = _sole_exception(eg)
        if leaf is not eg and (not body_error or leaf is body_error[0]):
            raise leaf from None
        raise
    finally:
        if ws._listener is not None:
            ws._listener.close()


async def _serve(ws: Workers) -> None:
    assert ws._listener is not None
    await serve_connections(
        ws._listener, ws._secret, this_node(), limits=ws._limits, on_join=ws._on_join, closing=lambda: ws.closing
    )


def _sole_exception(eg: BaseException) -> BaseException:
    while isinstance(eg, BaseExceptionGroup) and len(eg.exceptions) == 1:
        eg = eg.exceptions[0]
    return eg

