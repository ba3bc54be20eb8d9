"""`DataLoader`: batches from a dataset, with ``for`` and, prefetching, with ``async for``.

``for batch in loader`` works as PyTorch's with ``num_workers=0``: each batch is fetched and collated
when asked for. ``async for batch in loader`` keeps ``prefetch_factor`` batches in flight: samples are
fetched on the event-loop thread (``dataset[i]`` may build tensors), then the copying part of collation
(stacking, or gathering rows of a `TensorDataset` in one fancy-index per tensor) runs on the loader's
prefetch thread while the training step runs, so the next batch is ready when the step asks for it.
`DataLoaderIterStatistics` says how often the step did have to wait.

The prefetch thread belongs to one ``async for`` pass: it ends with the pass, on ``aclose()``, or as soon
as the iterator is garbage collected (after a ``break``); it never runs tensor ops (only numpy).

With ``num_workers > 0`` both forms fetch in forked worker processes instead (`_worker`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import trio

from ._collate import collate_arrays, default_collate, default_convert, to_arrays, to_tensors
from ._dataset import IterableDataset, array_source
from ._sampler import BatchSampler, RandomSampler, Sampler, SequentialSampler
from ._stats import DataLoaderIterStatistics
from ._worker import AsyncWorkerIter, Pool, WorkerIter

__all__ = ["DataLoader", "DataLoaderIterStatistics"]


class DataLoader:
    """Iterate over a dataset in batches (PyTorch's ``torch.utils.data.DataLoader`` arguments).

    Args:
        dataset: A map-style `Dataset` (``__getitem__``/``__len__``) or an `IterableDataset`.
        batch_size: Samples per batch; None yields samples one by one (through `default_convert`).
        shuffle: Reshuffle the indices every epoch (a `RandomSampler` with ``generator``).
        sampler: The indices to draw (exclusive with ``shuffle``).
        batch_sampler: Lists of indices (exclusive with batch_size, shuffle, sampler, drop_last).
        num_workers: Worker processes (0: fetch in this process). Each worker is forked (``os.fork``) when a
            pass starts, inherits the dataset (nothing is pickled) and fetches whole batches: ``dataset[i]``
            for the batch's indices, then ``collate_fn``. Batches come back as raw array buffers (msgpack
            for the nesting) and are delivered in sampler order; the parent makes the Tensors (sharing the
            received memory). In a worker, `get_worker_info` gives its id, ``num_workers``, seed and dataset
            (an `IterableDataset` shards itself with it, as in PyTorch); `random` and ``np.random`` are
            seeded with ``base_seed + id``, the base seed drawn from ``generator`` (else the default
            generator) without advancing its stream, so the shuffle order is the same as with 0 workers.
            A worker must not use asyncgrad ops (its runtime does not exist in the child): ``dataset[i]``
            and ``collate_fn`` work in numpy there; a Tensor computed before the fork is read as its array
            (one still pending is an error), and a
            `TensorDataset` is gathered from its arrays. A batch may hold arrays, tensors, numbers,
            strings, bytes, None and dicts/lists/tuples/named tuples of them; anything else is a TypeError
            naming its type and place. A worker's exception is re-raised here (same builtin type, else
            RuntimeError) with its id and traceback text; a worker that dies is a RuntimeError naming it
            and its signal. Workers end with the pass (exhausted, ``close()``/``aclose()``, or the iterator
            garbage collected), or, with ``persistent_workers``, with the loader. ``async for`` waits with
            trio's IO waits and copies the bytes on a thread, never on the loop.
            Each worker limits its BLAS to one thread (threadpoolctl). Linux only (fork).
        collate_fn: Merges a list of samples (default `default_collate`). A custom one runs on the event-loop
            thread (it may use tensor ops) with 0 workers, in the worker otherwise (numpy only); the
            default one copies on the prefetch thread.
        pin_memory: Accepted (host memory needs no pinning without a CUDA device).
        drop_last: Drop the last incomplete batch.
        timeout: Seconds a pass waits for a batch before failing (0: no limit); with 0 workers, ``async
            for`` only.
        worker_init_fn: With ``num_workers > 0``, called as ``worker_init_fn(id)`` in each worker, after
            seeding and before its first batch.
        multiprocessing_context: None or ``"fork"`` (the only start method: others would pickle).
        generator: A ``numpy.random.Generator`` for shuffling (seeded: a reproducible order).
        prefetch_factor: Batches in flight during ``async for`` (default 2); with workers, per worker.
        persistent_workers: Keep the worker processes across passes (ended when the loader is garbage
            collected, or when a pass fails).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[Any] | Iterable[Any] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: np.random.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing."
            )
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or prefetch_factor < 1):
            raise ValueError(f"prefetch_factor should be a positive integer, got {prefetch_factor!r}")
        self.dataset = dataset
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.prefetch_factor = 2 if prefetch_factor is None else prefetch_factor
        self.persistent_workers = persistent_workers
        self.generator = generator
        if multiprocessing_context not in (None, "fork"):
            raise ValueError(
                f"multiprocessing_context={multiprocessing_context!r}: workers are forked (the dataset is inherited, "
                "never pickled); only None or 'fork' is supported"
            )
        self._pool: Pool | None = None  # the workers kept across passes (persistent_workers=True)
        self._iterable = isinstance(dataset, IterableDataset)
        if self._iterable:
            if shuffle not in (None, False):
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
                )
            if sampler is not None:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
                )
            if batch_sampler is not None:
                raise ValueError(
                    "DataLoader with IterableDataset: expected unspecified batch_sampler option, but got "
                    f"batch_sampler={batch_sampler}"
                )
        else:
            if not hasattr(dataset, "__getitem__"):
                raise TypeError(
                    f"DataLoader: the dataset ({type(dataset).__name__}) has no __getitem__; pass a map-style "
                    "Dataset or an IterableDataset"
                )
            shuffle = bool(shuffle)
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
                )
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError(
                "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
            )
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                       or batch_size <= 0):
            raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
        if not self._iterable:
            if sampler is None:
                sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
            if batch_size is not None and batch_sampler is None:
                batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self._auto_collation = batch_sampler is not None or (self._iterable and batch_size is not None)
        if collate_fn is None:
            collate_fn = default_collate if self._auto_collation else default_convert
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        if self._iterable:
            n = len(self.dataset)
            if self.batch_size is not None:
                n = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
            return n
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        return len(self.sampler)  # type: ignore[arg-type]

    # ---- the plan: one entry per batch, ("ready", value) or ("job", fn for the prefetch thread) ----

    def _plan(self) -> Iterator[tuple[str, Any]]:
        if self._iterable:
            it = iter(self.dataset)
            if self.batch_size is None:
                for s in it:
                    yield "ready", self.collate_fn(s)
                return
            while True:
                samples = []
                for s in it:
                    samples.append(s)
                    if len(samples) == self.batch_size:
                        break
                if not samples or (len(samples) < self.batch_size and self.drop_last):
                    return
                yield self._collate(samples)
                if len(samples) < self.batch_size:
                    return
        if self.batch_sampler is None:
            for i in self.sampler:  # type: ignore[union-attr]
                yield "ready", self.collate_fn(self.dataset[i])
            return
        fast = array_source(self.dataset) if self.collate_fn is default_collate else None
        for idx in self.batch_sampler:
            if fast is not None:
                arrays, imap = fast
                ix = np.asarray(idx, dtype=np.int64)
                if imap is not None:
                    ix = imap[ix]
                yield "job", _Gather(arrays, ix)
            else:
                getitems = getattr(self.dataset, "__getitems__", None)
                samples = getitems(list(idx)) if getitems is not None else [self.dataset[i] for i in idx]
                yield self._collate(samples)

    def _collate(self, samples: list[Any]) -> tuple[str, Any]:
        if self.collate_fn is default_collate:
            arrs = to_arrays(samples)
            return "job", lambda: collate_arrays(arrs)
        return "ready", self.collate_fn(samples)

    def __iter__(self) -> Iterator[Any]:
        if self.num_workers > 0:
            return WorkerIter(self)
        return self._iter_here()

    def _iter_here(self) -> Iterator[Any]:
        for kind, val in self._plan():
            yield to_tensors(val()) if kind == "job" else val

    def __aiter__(self) -> _AsyncLoaderIter | AsyncWorkerIter:
        if self.num_workers > 0:
            return AsyncWorkerIter(self)
        return _AsyncLoaderIter(self)


class _Gather:
    """Rows ``ix`` of every array: a TensorDataset batch, one fancy-index copy per tensor."""

    def __init__(self, arrays: tuple[np.ndarray, ...], ix: np.ndarray) -> None:
        self.arrays, self.ix = arrays, ix

    def __call__(self) -> list[np.ndarray]:
        return [a[self.ix] for a in self.arrays]


class _Waker:
    """What the prefetch thread wakes (kept apart from the iterator so the thread never keeps it alive)."""

    def __init__(self) -> None:
        self.event: trio.Event | None = None

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()


def _prefetch_worker(
    jobs: Any, results: collections.deque[tuple[bool, Any]], token: trio.lowlevel.TrioToken, waker: _Waker,
) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            res: tuple[bool, Any] = (True, job())
        except BaseException as e:  # handed to the consumer, raised there in batch order
            res = (False, e)
        results.append(res)
        try:
            token.run_sync_soon(waker.wake)
        except trio.RunFinishedError:  # the loop is gone: nobody is waiting
            return


def _stop(jobs: Any) -> None:
    jobs.put(None)


class _AsyncLoaderIter:
    """One ``async for`` pass: ``prefetch_factor`` batches in flight, collated on a prefetch thread."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._plan: Iterator[tuple[str, Any]] | None = None
        self._slots: collections.deque[tuple[str, Any]] = collections.deque()
        self._results: collections.deque[tuple[bool, Any]] = collections.deque()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waker = _Waker()
        self._thread: threading.Thread | None = None
        self._exhausted = False
        self._closed = False
        self._batches = 0
        self._waited = 0
        self._wait_s = 0.0

    def statistics(self) -> DataLoaderIterStatistics:
        return DataLoaderIterStatistics(
            batches=self._batches, waited=self._waited, wait_seconds=self._wait_s,
            in_flight=len(self._slots), thread_alive=self._thread is not None and self._thread.is_alive(),
        )

    def __aiter__(self) -> _AsyncLoaderIter:
        return self

    def _fill(self) -> None:
        assert self._plan is not None
        while not self._exhausted and len(self._slots) < self._loader.prefetch_factor:
            try:
                kind, val = next(self._plan)
            except StopIteration:
                self._exhausted = True
                break
            except Exception as e:  # a failing __getitem__: raised when its batch is reached
                self._slots.append(("error", e))
                self._exhausted = True
                break
            if kind == "job":
                self._start_thread()
                self._jobs.put(val)
            self._slots.append((kind, val))

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=_prefetch_worker,
            args=(self._jobs, self._results, trio.lowlevel.current_trio_token(), self._waker),
            name="asyncgrad-dataloader-prefetch",
            daemon=True,  # stopped by its owner; daemon only so that a leaked iterator cannot block exit
        )
        # a `break` leaves the iterator to the garbage collector: that stops the thread too
        weakref.finalize(self, _stop, self._jobs)
        self._thread.start()

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        if self._plan is None:
            self._plan = self._loader._plan()
        self._fill()
        if not self._slots:
            await self.aclose()
            raise StopAsyncIteration
        kind, val = self._slots.popleft()
        if kind == "error":
            await self.aclose()
            raise val
        if kind == "job":
            if not self._results:
                await self._wait_for_result()
            ok, val = self._results.popleft()
            if not ok:
                await self.aclose()
                raise val
            val = to_tensors(val)
        else:
            await trio.lowlevel.checkpoint()
        self._batches += 1
        self._fill()  # the next batches start now, while the caller's step runs
        return val

    async def _wait_for_result(self) -> None:
        self._waited += 1
        t0 = time.perf_counter()
        timeout = self._loader.timeout
        try:
            with trio.fail_after(timeout) if timeout > 0 else _nullcontext():
                while not self._results:
                    ev = self._waker.event = trio.Event()
                    await ev.wait()
        except trio.TooSlowError:
            await self.aclose()
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None
        finally:
            self._waker.event = None
            self._wait_s += time.perf_counter() - t0

    async def aclose(self) -> None:
        """Stop prefetching and end the prefetch thread (waiting for the batch it is collating)."""
        if self._closed:
            return
        self._closed = True
        self._slots.clear()
        t = self._thread
        if t is not None:
            self._jobs.put(None)
            await trio.to_thread.run_sync(t.join)
        self._results.clear()


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
