"""Workers as Ray actors: the launcher behind ``open_population(backend="ray")``.

Each worker is one Ray actor whose process *is* the asyncgrad worker: its one method runs
`asyncgrad.distributed._worker.serve`, which connects back to the parent over TCP, proves the population's
secret (the HMAC challenge, as any worker) and serves calls until the parent shuts it down. Ray only
places the process and carries the address, the name and the secret to it as the method's arguments;
every training, report, checkpoint and result goes over our authenticated wire, never through Ray's
object store or pickle. Killing the actor kills the worker (one process), so its connection drops and its
runs fail with `WorkerDied` as for a local worker; Ray does not say how a worker process ended, so their
``exitcode`` is None.

ray is imported only here and only when the backend is used (``pip install 'asyncgrad[ray]'``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from . import _worker
from ._workers import WorkerProcess

log = logging.getLogger("asyncgrad.distributed")

GONE_TIMEOUT = 10.0  # how long a killed actor's process gets to disappear before we say so

_MISSING = "the Ray backend of asyncgrad.distributed needs ray: pip install 'asyncgrad[ray]'"


def import_ray() -> Any:
    """The ray module, or ImportError naming the extra to install."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{_MISSING} ({e})") from e
    return ray


class WorkerActor:
    """The body of a worker's Ray actor (``ray.remote`` is applied when the backend is used)."""

    def serve(self, address: str, secret: bytes, name: str) -> int:
        """Be the asyncgrad worker ``name`` of the parent at ``address`` until it lets go; returns 0."""
        trio.run(_worker.serve, address, secret, name)
        return 0


class RayActorProcess:
    """A worker's Ray actor as `Workers` sees a process (`WorkerProcess`).

    Its end is the end of the actor's ``serve`` call (Ray completes the call's future from its own thread;
    we hear of it through the trio token, so nothing here polls or blocks a thread). Once that call ended
    the actor is killed, and `wait` returns when its process is gone (checked where we can see it: a
    worker on this host).
    """

    def __init__(self, ray: Any, actor: Any, ref: Any, local: bool) -> None:
        self.pid: int | None = None  # learnt when the worker joins
        self.local = local
        self.actor = actor
        self._ray = ray
        self._killed = False
        # plain attributes, as `_Process.detail`: `WorkerProcess` only reads them, and only `wait` sets them
        self.returncode: int | None = None
        self.detail = ""
        self.ended = False
        self._call_done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def done(_: Any) -> None:
            try:
                token.run_sync_soon(self._call_done.set)
            except trio.RunFinishedError:  # the parent's loop is gone; nobody waits any more
                pass

        self._future = ref.future()
        self._future.add_done_callback(done)

    async def wait(self) -> int | None:
        await self._call_done.wait()
        if not self.ended:
            exc = self._future.exception()
            if exc is None:
                self.returncode = 0
            else:
                # the actor died (killed, crashed, or could not start): Ray tells why in words, not a status
                self.detail = " ".join(str(exc).split())[:600]
            self.kill()
            await self._gone()
            self.ended = True
        return self.returncode

    async def _gone(self) -> None:
        if not (self.local and self.pid is not None):
            return
        with trio.move_on_after(GONE_TIMEOUT):
            while _running(self.pid):
                await trio.sleep(0.02)
            return
        log.warning("the Ray actor process %d of a worker is still there %g s after ray.kill", self.pid, GONE_TIMEOUT)

    def kill(self) -> None:
        if self._killed:
            return
        self._killed = True
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception as e:  # already gone, or Ray is shutting down
            log.debug("ray.kill of a worker actor: %s", e)

    def close(self) -> None:
        self.kill()


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class RayLauncher:
    """A `Launcher` that starts each worker as a Ray actor of ``cores`` CPUs."""

    def __init__(self, ray: Any, cores: int, local: bool) -> None:
        self._ray = ray
        self.cores = cores
        self.local = local
        # max_restarts=0: a dead worker is replaced by the population (with its runs' checkpoints), not
        # restarted by Ray behind its back
        self._cls = ray.remote(num_cpus=cores, max_restarts=0, max_task_retries=0)(WorkerActor)

    def launch(self, name: str, address: str, secret: bytes) -> WorkerProcess:
        actor = self._cls.remote()
        ref = actor.serve.remote(address, secret, name)
        return RayActorProcess(self._ray, actor, ref, self.local)


class RaySession:
    """The Ray this population runs on: its CPUs, where workers reach the parent, the launcher."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray
        me = ray.util.get_node_ip_address()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        # a cluster of this machine only: listen on loopback, and the workers share our files (import path)
        self.local = all(n.get("NodeManagerAddress") == me for n in nodes)
        self.host = "127.0.0.1" if self.local else me

    def cpus(self) -> int:
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)))

    def launcher(self, cores: int) -> RayLauncher:
        return RayLauncher(self.ray, cores, self.local)


class _Owner:
    """A thread that calls ``ray.init`` and, when told, ``ray.shutdown``.

    Not the loop thread (ray.init takes seconds) and not a pooled worker thread: Ray ties the processes it
    starts (GCS, raylet) to the life of the *thread* that started them (they get a parent-death signal),
    so that thread must live as long as the cluster.
    """

    def __init__(self, ray: Any, kwargs: dict[str, Any]) -> None:
        self._ray = ray
        self._kwargs = kwargs
        self._token = trio.lowlevel.current_trio_token()
        self._stop = threading.Event()
        self._inited = trio.Event()
        self._ended = trio.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._body, name="asyncgrad-ray-owner", daemon=True)

    def _notify(self, event: trio.Event) -> None:
        try:
            self._token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    def _body(self) -> None:
        try:
            try:
                self._ray.init(**self._kwargs)
            except BaseException as e:
                self.error = e
                return
            self._notify(self._inited)
            self._stop.wait()
            self._ray.shutdown()
        finally:
            self._notify(self._inited)
            self._notify(self._ended)

    async def start(self) -> None:
        self._thread.start()
        try:
            await self._inited.wait()
        except BaseException:
            await self.stop()
            raise
        if self.error is not None:
            await self.stop()
            raise RuntimeError(f"ray.init({_show(self._kwargs)}) failed: {self.error}") from self.error

    async def stop(self) -> None:
        self._stop.set()
        with trio.CancelScope(shield=True):
            await self._ended.wait()
        self._thread.join()  # it has ended (or is returning): no wait to speak of


def _show(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


@asynccontextmanager
async def ray_session(address: str | None) -> AsyncIterator[RaySession]:
    """Ray as it is, or ``ray.init(address)`` (a new local Ray when None) and ``ray.shutdown()`` on leaving.

    An already initialised Ray is used and left running (whoever started it shuts it down).
    """
    ray = import_ray()
    owner: _Owner | None = None
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": address} if address is not None else {"include_dashboard": False}
        owner = _Owner(ray, kwargs)
        await owner.start()
    elif address is not None:
        log.info("ray is initialised already: address=%r is not used", address)
    try:
        yield RaySession(ray)
    finally:
        if owner is not None:
            await owner.stop()


__all__ = ["RayActorProcess", "RayLauncher", "RaySession", "WorkerActor", "import_ray", "ray_session"]
