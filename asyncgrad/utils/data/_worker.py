"""`DataLoader` worker processes (``num_workers > 0``): forked children that fetch and collate whole batches.

Each worker is a child made by ``os.fork()`` from the thread that starts iterating (the loop's or the
caller's): it inherits the dataset, so nothing is pickled. Two pipes join it to the parent: indices go down
as msgpack frames, batches come back as frames of raw array buffers (`_codec`). A worker never touches the
asyncgrad runtime (its threads do not exist in the child): samples become numpy arrays there (a Tensor's
value is read as its array), the numpy part of collation runs there, and the parent makes the Tensors, which
share the frame's memory. Batches come out in sampler order (PyTorch's in-order semantics): task ``k`` goes to
the next live worker in turn, and the parent reads each task's frame from the worker that has it.

A worker ends when its task pipe closes (the parent closed it, or died: it also checks its parent's pid every
second); the parent closes the pipes and reaps every child (SIGKILL after a grace period), so no process,
thread or file descriptor outlives an iterator, or a loader with ``persistent_workers=True``.
"""

from __future__ import annotations

import builtins
import collections
import contextvars
import os
import random
import select
import signal
import time
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import trio

from ...devices import blas_boost_available, blas_boosted
from ...runtime import Tensor, default_generator, from_numpy
from . import _codec
from ._codec import WorkerEOF, decode, encode, read_frame, write_frame
from ._collate import collate_arrays, convert_arrays, default_collate, default_convert, map_leaves
from ._dataset import array_source
from ._stats import DataLoaderIterStatistics

__all__ = ["WorkerInfo", "get_worker_info"]


@attrs.frozen
class WorkerInfo:
    """What `get_worker_info` returns inside a worker (PyTorch's ``WorkerInfo``).

    Attributes:
        id: This worker's number, ``0 <= id < num_workers``.
        num_workers: The loader's worker count.
        seed: This worker's seed (the loader's base seed plus ``id``); `random` and numpy's global
            ``np.random`` are seeded with it.
        dataset: The dataset object of this process (a copy of the parent's).
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any


_worker_info: WorkerInfo | None = None
_PARENT_FDS: set[int] = set()  # every pipe end the parent holds, closed first thing in each new child
_GRACE_S = 1.0  # a worker still busy with a batch when its pass ends is killed after this
_PIPE_SIZE = 1 << 20


def get_worker_info() -> WorkerInfo | None:
    """In a `DataLoader` worker process: its `WorkerInfo`; in the main process: None (as PyTorch)."""
    return _worker_info


class _Exhausted(Exception):
    pass


def _set_pipe_size(fd: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, 1031, _PIPE_SIZE)  # F_SETPIPE_SZ (Linux): fewer reads for a big batch
    except (ImportError, OSError):
        pass


# ------------------------------------------------------------------ the child


class _Fetcher:
    """What a worker does with a task: samples, then collation, to numpy (or what a custom collate_fn makes)."""

    def __init__(self, loader: Any) -> None:
        self.lo = loader
        self.it: Iterator[Any] | None = None
        self.done = False
        self.fast = array_source(loader.dataset) if loader.collate_fn is default_collate else None

    def reset(self) -> None:
        self.it, self.done = None, False

    def _collate(self, samples: Any) -> tuple[Any, bool]:
        fn = self.lo.collate_fn
        if fn is default_collate:
            return collate_arrays(ready_arrays(list(samples))), True
        if fn is default_convert:
            return convert_arrays(ready_arrays(samples)), True
        return fn(samples), False

    def __call__(self, payload: Any) -> tuple[Any, bool]:
        lo = self.lo
        if lo._iterable:
            if self.done:
                raise _Exhausted
            if self.it is None:
                self.it = iter(lo.dataset)
            if lo.batch_size is None:
                try:
                    return self._collate(next(self.it))
                except StopIteration:
                    self.done = True
                    raise _Exhausted from None
            samples = []
            for s in self.it:
                samples.append(s)
                if len(samples) == lo.batch_size:
                    break
            if len(samples) < lo.batch_size:
                self.done = True
                if not samples or lo.drop_last:
                    raise _Exhausted
            return self._collate(samples)
        if not lo._auto_collation:
            return self._collate(lo.dataset[payload])
        if self.fast is not None:
            arrays, imap = self.fast
            ix = np.asarray(payload, dtype=np.int64)
            return [a[ix if imap is None else imap[ix]] for a in arrays], True
        getitems = getattr(lo.dataset, "__getitems__", None)
        samples = getitems(list(payload)) if getitems is not None else [lo.dataset[i] for i in payload]
        return self._collate(samples)


def ready_value(t: Tensor) -> np.ndarray:
    """(worker) A Tensor's value: it must have been computed before the fork (no lane runs here)."""
    v = t.value_if_ready()
    if v is None:
        raise RuntimeError(
            f"a Tensor of shape {tuple(t.shape)} was still being computed when the DataLoader worker was forked; "
            "no kernel runs in a worker: make the dataset's tensors ready first (await t.ready())"
        )
    return np.asarray(v)


def ready_arrays(x: Any) -> Any:
    """(worker) ``x`` with every Tensor replaced by its computed value."""
    return map_leaves(x, Tensor, ready_value)


def _child(loader: Any, wid: int, seed: int, rfd: int, wfd: int, ppid: int) -> None:
    """A worker's whole life; never returns (``os._exit``)."""
    code = 0
    try:
        # an empty context: no asyncgrad runtime is current here (its threads do not exist in the child),
        # so an op that needs one fails at once instead of waiting on a lane that is not there
        contextvars.Context().run(_child_main, loader, wid, seed, rfd, wfd, ppid)
    except BrokenPipeError:
        pass
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _child_main(loader: Any, wid: int, seed: int, rfd: int, wfd: int, ppid: int) -> None:
    global _worker_info
    for fd in list(_PARENT_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _PARENT_FDS.clear()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and then closes the pipes
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    _one_blas_thread()
    _worker_info = WorkerInfo(id=wid, num_workers=loader.num_workers, seed=seed, dataset=loader.dataset)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    fetch = _Fetcher(loader)
    if loader.worker_init_fn is not None:
        try:
            loader.worker_init_fn(wid)
        except BaseException as e:
            _send_error(wfd, -1, wid, e)
            return
    while True:
        while not select.select([rfd], [], [], 1.0)[0]:
            if os.getppid() != ppid:
                return
        try:
            msg, _ = read_frame(rfd)
        except WorkerEOF:
            return
        if msg[0] == "r":
            fetch.reset()
            write_frame(wfd, *encode(["r", msg[1]]))
            continue
        idx = msg[1]
        try:
            batch, as_tensors = fetch(msg[2])
            frame = encode(["b", idx], batch, tensor_arrays=as_tensors, tensor_type=Tensor, tensor_value=ready_value)
        except _Exhausted:
            frame = encode(["x", idx])
        except BaseException as e:
            _send_error(wfd, idx, wid, e)
            continue
        write_frame(wfd, *frame)


def _one_blas_thread() -> None:
    """numpy's BLAS at one thread in a worker: through the setter the parent already found (no library
    loading in the child), else threadpoolctl. (The environment variables only reach libraries loaded
    after the fork.)"""
    try:
        if blas_boost_available():
            blas_boosted(1)
            return
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except Exception:
        pass


def _send_error(wfd: int, idx: int, wid: int, e: BaseException) -> None:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    write_frame(wfd, *encode(["e", idx, type(e).__name__, str(e), tb]))


# ------------------------------------------------------------------ the parent


def base_seed(generator: np.random.Generator | None) -> int:
    """A base seed from the loader's generator (else the default one). Drawn from a spawned child of it, so
    the generator's own stream (the shuffle order) is the same as with ``num_workers=0``."""
    g = default_generator() if generator is None else generator
    try:
        return int(g.spawn(1)[0].integers(0, 2**63))
    except (AttributeError, TypeError, ValueError):
        return int(g.integers(0, 2**63))


def _worker_error(msg: list[Any], wid: int) -> BaseException:
    tname, tb = (msg[2], msg[4]) if len(msg) >= 5 else ("Exception", "")
    full = f"Caught {tname} in DataLoader worker process {wid}.\nOriginal {tb}"
    if tname == "NoRuntimeError":
        full += ("(a DataLoader worker process has no asyncgrad runtime: there, dataset[i] and collate_fn must "
                 "work in numpy; a TensorDataset is gathered from its arrays)")
    cls = getattr(builtins, tname, None) if isinstance(tname, str) else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(full)  # type: ignore[no-any-return]
        except Exception:
            pass
    return RuntimeError(full)


def _to_tensor(a: np.ndarray) -> Any:
    return a if a.dtype.kind in "USOV" else from_numpy(a)


class Pool:
    """A loader's worker processes and their pipes."""

    def __init__(self, loader: Any) -> None:
        self.n = loader.num_workers
        self.owner = os.getpid()
        self.pids: list[int] = []
        self.task_fds: list[int] = []
        self.result_fds: list[int] = []
        self.epochs = 0
        self.current: Any = None  # the Epoch using the pool
        self.closed = False
        # frames not yet written to each worker (kept across passes: a half-written one is finished first)
        self.pending: list[collections.deque[memoryview]] = [collections.deque() for _ in range(self.n)]
        seed = base_seed(loader.generator)
        if loader.collate_fn is default_collate and not loader._iterable:
            array_source(loader.dataset)  # a TensorDataset's values, computed here (no kernel runs in a worker)
        try:
            for wid in range(self.n):
                self._fork(loader, wid, seed + wid)
        except BaseException:
            self.shutdown()
            raise

    def _fork(self, loader: Any, wid: int, seed: int) -> None:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        for fd in (w1, w2):
            _set_pipe_size(fd)
        ppid = os.getpid()
        try:
            pid = os.fork()
        except BaseException:
            for fd in (r1, w1, r2, w2):
                os.close(fd)
            raise
        if pid == 0:  # the child
            os.close(w1)
            os.close(r2)
            _child(loader, wid, seed, r1, w2, ppid)
        os.close(r1)
        os.close(w2)
        os.set_blocking(w1, False)
        self.pids.append(pid)
        self.task_fds.append(w1)
        self.result_fds.append(r2)
        _PARENT_FDS.update((w1, r2))

    def flush(self, w: int) -> None:
        """Write to worker ``w`` what its pipe takes now (never blocks)."""
        q = self.pending[w]
        while q:
            try:
                n = os.write(self.task_fds[w], q[0])
            except BlockingIOError:
                return
            except (BrokenPipeError, OSError):
                q.clear()  # the worker died: its result pipe says so
                return
            if n < q[0].nbytes:
                q[0] = q[0][n:]
                return
            q.popleft()

    def died(self, wid: int) -> RuntimeError:
        """The error for worker ``wid`` whose pipe closed: it is reaped and its exit status named."""
        pid = self.pids[wid]
        how = "exited unexpectedly"
        try:
            for _ in range(200):
                p, status = os.waitpid(pid, os.WNOHANG)
                if p:
                    self.pids[wid] = -1
                    if os.WIFSIGNALED(status):
                        how += f" (killed by signal {signal.Signals(os.WTERMSIG(status)).name})"
                    else:
                        how += f" (exit code {os.WEXITSTATUS(status)})"
                    break
                time.sleep(0.01)
        except (ChildProcessError, ValueError):
            pass
        return RuntimeError(f"DataLoader worker {wid} (pid {pid}) {how}")

    def shutdown(self) -> None:
        """Close the pipes (each worker sees end of file and exits) and reap every worker."""
        if self.closed or os.getpid() != self.owner:
            return
        self.closed = True
        for fd in (*self.task_fds, *self.result_fds):
            _PARENT_FDS.discard(fd)
            try:
                os.close(fd)
            except OSError:
                pass
        deadline = time.monotonic() + _GRACE_S
        for i, pid in enumerate(self.pids):
            if pid < 0:
                continue
            try:
                while not os.waitpid(pid, os.WNOHANG)[0]:
                    if time.monotonic() > deadline:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        break
                    time.sleep(0.002)
            except (ChildProcessError, ProcessLookupError):
                pass
            self.pids[i] = -1


def _key(i: Any) -> Any:
    """A sampler's index as msgpack carries it (numpy integers as ints; str and int keys as they are)."""
    if isinstance(i, np.integer):
        return int(i)
    if isinstance(i, np.floating):
        return float(i)
    return i


class Epoch:
    """One pass over the loader with a `Pool`: which task each worker holds, results in sampler order."""

    def __init__(self, loader: Any, pool: Pool) -> None:
        self.lo, self.pool = loader, pool
        n = pool.n
        self.tasks: Iterator[Any] | None = None
        if not loader._iterable:
            self.tasks = iter(loader.batch_sampler if loader._auto_collation else loader.sampler)
        self.send_idx = 0
        self.rcvd_idx = 0
        self.task_worker: dict[int, int] = {}
        self.results: dict[int, tuple[str, Any]] = {}
        self.active = [True] * n
        self.next_w = 0
        self.out_of_tasks = False
        pool.epochs += 1
        pool.current = self
        self.epoch = pool.epochs
        self.resetting: set[int] = set()
        if pool.epochs > 1:  # a kept pool: workers restart their stream and stale frames are skipped
            self.resetting = set(range(n))
            for w in range(n):
                self._send(w, ["r", self.epoch])

    def _send(self, w: int, msg: list[Any], payload: Any = None) -> None:
        header, bufs, size = encode(msg, payload)
        assert not bufs and size == 0  # a task frame holds no arrays
        self.pool.pending[w].append(memoryview(_codec.frame_prefix(len(header), 0) + header))
        self.pool.flush(w)

    def put(self) -> None:
        n = self.pool.n
        while not self.out_of_tasks and len(self.task_worker) < self.lo.prefetch_factor * n:
            for _ in range(n):
                w = self.next_w
                self.next_w = (w + 1) % n
                if self.active[w]:
                    break
            else:
                self.out_of_tasks = True
                return
            payload = None
            if self.tasks is not None:
                try:
                    payload = next(self.tasks)
                except StopIteration:
                    self.out_of_tasks = True
                    return
                payload = [_key(i) for i in payload] if self.lo._auto_collation else _key(payload)
            idx = self.send_idx
            self.send_idx += 1
            self.task_worker[idx] = w
            self._send(w, ["i", idx, payload])

    def want(self) -> tuple[str, Any]:
        """("batch", value), ("read", worker) or ("done", None)."""
        if self.resetting:
            return "read", min(self.resetting)
        while True:
            self.put()
            if self.rcvd_idx in self.results:
                kind, val = self.results.pop(self.rcvd_idx)
                self.rcvd_idx += 1
                if kind == "x":
                    continue
                self.put()
                return "batch", val
            if self.rcvd_idx in self.task_worker:
                return "read", self.task_worker[self.rcvd_idx]
            return "done", None

    def feed(self, w: int, msg: list[Any], body: bytearray) -> None:
        kind = msg[0]
        if kind == "r":
            if msg[1] == self.epoch:
                self.resetting.discard(w)
            return
        if w in self.resetting:
            return  # a frame of an earlier pass
        if kind == "e":
            raise _worker_error(msg, w)
        idx = msg[1]
        if self.task_worker.pop(idx, None) is None:
            raise _codec.FrameError(f"DataLoader: worker {w} answered task {idx}, which it was not given")
        if kind == "x":
            self.active[w] = False
            self.results[idx] = ("x", None)
        elif kind == "b":
            self.results[idx] = ("b", decode(msg[2], body, _to_tensor))
        else:
            raise _codec.FrameError(f"DataLoader: unknown message {kind!r} from worker {w}")


def read_from(pool: Pool, w: int, timeout: float | None) -> tuple[list[Any], bytearray]:
    """One frame from worker ``w`` (blocking); its death, a timeout, a bad frame: a RuntimeError."""
    try:
        return read_frame(pool.result_fds[w], timeout)
    except WorkerEOF:
        raise pool.died(w) from None
    except TimeoutError:
        raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None


def pump(pool: Pool, w: int, timeout: float | None) -> tuple[list[Any], bytearray]:
    """Write pending frames to worker ``w`` while waiting for its next frame; returns that frame. (Both
    directions at once: a worker blocked writing a batch never waits on a parent blocked writing tasks.)"""
    rfd, wfd = pool.result_fds[w], pool.task_fds[w]
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        pool.flush(w)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds")
        r, _, _ = select.select([rfd], [wfd] if pool.pending[w] else [], [], left)
        if r:
            return read_from(pool, w, None if deadline is None else max(deadline - time.monotonic(), 0.001))


async def pump_async(pool: Pool, w: int) -> tuple[list[Any], bytearray]:
    """`pump` for ``async for``: trio's IO waits on the loop, the frame copied on a thread."""
    rfd, wfd = pool.result_fds[w], pool.task_fds[w]
    while True:
        pool.flush(w)
        if not pool.pending[w]:
            await trio.lowlevel.wait_readable(rfd)
            break
        readable = False
        async with trio.open_nursery() as nursery:
            async def on_read() -> None:
                nonlocal readable
                await trio.lowlevel.wait_readable(rfd)
                readable = True
                nursery.cancel_scope.cancel()

            async def on_write() -> None:
                await trio.lowlevel.wait_writable(wfd)
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_read)
            nursery.start_soon(on_write)
        if readable:
            break
    # the child writes a whole frame at once: the thread waits 60 s at most for the rest of it
    return await trio.to_thread.run_sync(read_from, pool, w, 60.0)


def loader_pool(loader: Any) -> tuple[Pool, bool]:
    """The pool a new pass uses, and whether the pass owns it (False: the loader keeps it, persistent)."""
    if not loader.persistent_workers:
        return Pool(loader), False
    p = loader._pool
    if p is None or p.closed:
        p = loader._pool = Pool(loader)
        weakref.finalize(loader, p.shutdown)
    return p, True


class _PassBase:
    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._pool: Pool | None = None
        self._ep: Epoch | None = None
        self._kept = False
        self._done = False
        self._fin: Any = None

    def _start(self) -> Epoch:
        pool, kept = loader_pool(self._loader)
        self._pool, self._kept = pool, kept
        if not kept:  # a `break` leaves the iterator to the garbage collector: that ends the workers too
            self._fin = weakref.finalize(self, pool.shutdown)
        self._ep = Epoch(self._loader, pool)
        return self._ep

    def _epoch(self) -> Epoch:
        ep = self._ep if self._ep is not None else self._start()
        if ep.pool.current is not ep:
            raise RuntimeError("DataLoader: a newer pass over this loader took its persistent workers")
        return ep

    def _end(self, failed: bool) -> None:
        self._done = True
        pool = self._pool
        if pool is None:
            return
        if failed or not self._kept:
            pool.shutdown()
            if self._loader._pool is pool:
                self._loader._pool = None
        if pool.current is self._ep:
            pool.current = None


class WorkerIter(_PassBase):
    """``for batch in loader`` with worker processes."""

    def __iter__(self) -> WorkerIter:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            ep = self._epoch()
            timeout = self._loader.timeout or None
            while True:
                kind, val = ep.want()
                if kind == "batch":
                    return val
                if kind == "done":
                    break
                msg, body = pump(ep.pool, val, timeout)
                ep.feed(val, msg, body)
        except BaseException:
            self._end(failed=True)
            raise
        self._end(failed=False)
        raise StopIteration

    def close(self) -> None:
        """End the pass now (the workers too, unless the loader keeps them)."""
        if not self._done:
            self._end(failed=False)


class AsyncWorkerIter(_PassBase):
    """``async for batch in loader`` with worker processes: the loop only waits (trio IO waits)."""

    def __init__(self, loader: Any) -> None:
        super().__init__(loader)
        self._batches = 0
        self._waited = 0
        self._wait_s = 0.0

    def statistics(self) -> DataLoaderIterStatistics:
        """`DataLoaderIterStatistics` of this pass (``in_flight``: tasks the workers hold;
        ``thread_alive``: False, there is no prefetch thread)."""
        return DataLoaderIterStatistics(
            batches=self._batches, waited=self._waited, wait_seconds=self._wait_s,
            in_flight=0 if self._ep is None else len(self._ep.task_worker), thread_alive=False,
        )

    def __aiter__(self) -> AsyncWorkerIter:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        try:
            ep = self._epoch()
            timeout = self._loader.timeout
            t0, waited = time.perf_counter(), False
            while True:
                kind, val = ep.want()
                if kind == "batch":
                    self._batches += 1
                    if waited:
                        self._waited += 1
                        self._wait_s += time.perf_counter() - t0
                    await trio.lowlevel.checkpoint()
                    return val
                if kind == "done":
                    break
                waited = True
                try:
                    with trio.fail_after(timeout) if timeout > 0 else trio.CancelScope():
                        msg, body = await pump_async(ep.pool, val)
                except trio.TooSlowError:
                    raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None
                ep.feed(val, msg, body)
        except BaseException:
            await self._aend(failed=True)
            raise
        await self._aend(failed=False)
        raise StopAsyncIteration

    async def _aend(self, failed: bool) -> None:
        pool = self._pool
        if pool is not None and (failed or not self._kept):
            # reaping may wait for a worker finishing its batch: off the loop (shielded, it must happen)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(pool.shutdown)
        self._end(failed)

    async def aclose(self) -> None:
        """End the pass now (the workers too, unless the loader keeps them)."""
        if not self._done:
            await self._aend(failed=False)
