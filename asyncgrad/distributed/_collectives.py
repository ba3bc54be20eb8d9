"""Collectives over a process group: all_reduce, broadcast, all_gather, reduce_scatter, barrier.

Each comes as a pair: ``X_nowait(...)`` issues the collective at once and returns a `Work`; ``await X(...)``
issues it and waits for it. The collective runs on its group's comm stream (a lane of its own, never the
event loop), ordered by events after the kernels that produce its tensors and after what the calling task
queued so far; the tensors it writes are pending on the comm stream until it is done, so later ops on them
(on any stream) wait for it. MPI's non-blocking calls are polled on the lane, so a peer that never joins
makes it fail with `CollectiveTimeout` after the group's timeout instead of hanging.

Dense tensors of any layout (C, Fortran, channels-last, any permutation) are reduced in place, as the block
of memory they tile, when every rank has the same layout. Every public collective first compares shape,
dtype and layout across the ranks (one small all-gather): a mismatch raises `CollectiveMismatchError` on
every rank, naming both sides. Tensors that are not dense (strided slices) go through a contiguous copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from .. import runtime
from ._process_group import (
    CollectiveMismatchError,
    CollectiveTimeout,
    DistributedError,
    ProcessGroup,
    _mpi,
    resolve_group,
)

_MAXD = 12  # dims a signature describes (deeper tensors compare on a digest of the rest)
_REDUCE_OPS = ("sum", "avg", "mean", "max", "min", "prod", "product")


@attrs.define(eq=False)
class Work:
    """A collective in flight: ``await work`` (or ``await work.wait()``) waits for it and returns its result.

    A failed collective raises its error there (`CollectiveTimeout`, `CollectiveMismatchError`, ...).
    """

    _group: ProcessGroup
    _stream: Any
    _seq: int
    _box: list[Any]
    _result: Any
    what: str

    def is_completed(self) -> bool:
        """Whether the collective has finished (successfully or not)."""
        return bool(self._stream.is_done(self._seq))

    def exception(self) -> BaseException | None:
        """The collective's error once it finished with one, else None."""
        out = self._box[0]
        return out if isinstance(out, BaseException) else None

    async def wait(self) -> Any:
        """Wait for the collective without blocking the event loop; returns its result (see each collective)."""
        await self._stream.synchronize(self._seq)
        return self._outcome()

    def wait_blocking(self) -> Any:
        """Block the calling thread until the collective is done (construction-time setup only)."""
        self._stream.synchronize_blocking(self._seq)
        return self._outcome()

    def _outcome(self) -> Any:
        out = self._box[0]
        if out is None:
            raise DistributedError(f"{self.what}: the collective was dropped (its process group was destroyed)")
        if isinstance(out, BaseException):
            raise out
        return self._result

    def __await__(self) -> Any:
        return self.wait().__await__()

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<Work {self.what} on {self._group.name} {state}>"


# ---- the parts the jobs are made of (they run on a comm lane) ------------------------------------------


def wait_request(req: Any, group: ProcessGroup, what: str, deadline: float) -> None:
    """Poll an MPI request until it completes; past ``deadline`` raise `CollectiveTimeout`."""
    n = 0
    while not req.Test():
        n += 1
        if n < 50:
            continue  # a short collective completes within a few polls: no sleep
        if time.perf_counter() > deadline:
            raise CollectiveTimeout(
                f"{what} on process group {group.name} (rank {group.rank} of {group.size}) did not complete "
                f"within the group's timeout of {group.timeout:g} s: a peer rank raised, died, or issued a "
                "different collective; the group is unusable now (the training should stop)"
            )
        # progress happens inside MPI calls: keep polling, but give the GIL and the core to the others
        time.sleep(0 if n < 2000 else 0.0005)


def memory_order(arr: np.ndarray) -> list[int] | None:
    """The dims of ``arr`` from the largest stride to the smallest, if it is dense (else None)."""
    if arr.flags.c_contiguous:
        return list(range(arr.ndim))
    if not runtime.is_dense_nonoverlapping(arr):
        return None
    return sorted(range(arr.ndim), key=lambda i: (-abs(arr.strides[i]) if arr.shape[i] > 1 else 0, i))


def flat_view(arr: np.ndarray) -> np.ndarray | None:
    """The block of memory a dense ``arr`` tiles, as a 1-d array in memory order (a view), else None."""
    order = memory_order(arr)
    if order is None:
        return None
    v = arr.transpose(order)
    # numpy ignores the strides of dims of size 1 here, so any dense layout passes
    return v.reshape(-1) if v.flags.c_contiguous else None


def _signature(arr: np.ndarray) -> np.ndarray:
    sig = np.full(3 + 2 * _MAXD, -1, np.int64)
    sig[0] = ord(arr.dtype.kind) * 1000 + arr.dtype.itemsize
    sig[1] = arr.ndim
    order = memory_order(arr)
    order = list(range(arr.ndim)) if order is None else order  # not dense: it goes through a C-order copy
    d = min(arr.ndim, _MAXD)
    sig[3 : 3 + d] = arr.shape[:d]
    sig[3 + _MAXD : 3 + _MAXD + d] = order[:d]
    if arr.ndim > _MAXD:
        sig[2] = hash((arr.shape[_MAXD:], tuple(order[_MAXD:]))) & 0x7FFFFFFF
    return sig


def _describe(sig: np.ndarray) -> str:
    kind, size = chr(int(sig[0]) // 1000), int(sig[0]) % 1000
    dtype = np.dtype(f"{kind}{size}") if kind in "biufc" else f"{kind}{size}"
    nd = int(sig[1])
    d = min(nd, _MAXD)
    shape = tuple(int(x) for x in sig[3 : 3 + d])
    order = [int(x) for x in sig[3 + _MAXD : 3 + _MAXD + d]]
    layout = "row-major" if order == sorted(order) else f"dims in memory order {order}"
    return f"shape {shape}, dtype {dtype}, {layout}"


def check_same(comm: Any, group: ProcessGroup, what: str, arr: np.ndarray, deadline: float) -> None:
    """Compare shape, dtype and layout of ``arr`` across the ranks; raise on every rank if they differ."""
    sig = _signature(arr)
    every = np.empty((group.size, sig.size), np.int64)
    wait_request(comm.Iallgather(sig, every), group, what, deadline)
    for r in range(group.size):
        if not np.array_equal(every[r], every[0]):
            raise CollectiveMismatchError(
                f"{what} on process group {group.name}: rank 0 passed a tensor of {_describe(every[0])} but "
                f"rank {r} passed one of {_describe(every[r])}; every rank must pass tensors of the same shape, "
                "dtype and layout (strides order)"
            )


def mpi_op(op: str, what: str) -> Any:
    if op not in _REDUCE_OPS:
        raise ValueError(f"{what}: unknown op {op!r}; use one of {', '.join(_REDUCE_OPS)}")
    MPI = _mpi()
    return {"sum": MPI.SUM, "avg": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN,
            "prod": MPI.PROD, "product": MPI.PROD}[op]


def issue(
    group: ProcessGroup,
    what: str,
    tensors: Sequence[runtime.Tensor],
    body: Callable[..., None],
    result: Any,
    *,
    writes: Sequence[runtime.Tensor] | None = None,
    nbytes: int = 0,
    device: Any = None,
    after_caller: bool = True,
) -> Work:
    """Queue ``body(*arrays, deadline=...)`` on ``group``'s comm stream as one collective job."""
    group._check_usable(what)
    dev = tensors[0].device if tensors else (device if device is not None else runtime.current_runtime(what).cpu)
    stream = group.comm_stream(dev)
    box: list[Any] = [None]

    def job(*arrays: np.ndarray) -> None:
        start = time.perf_counter()
        try:
            group._check_usable(what)
            body(*arrays, deadline=start + group.timeout)
        except CollectiveMismatchError as e:  # every rank saw the same signatures: the group is still in step
            box[0] = e
            return
        except BaseException as e:
            if not isinstance(e, DistributedError):
                e = DistributedError(f"{what} on process group {group.name} (rank {group.rank}) failed: {e!r}")
            group._note_failed(str(e))
            box[0] = e
            return
        box[0] = True
        group._note_done(what, nbytes, start, time.perf_counter())

    group._note_issued()
    seq = runtime.submit_on(stream, job, list(tensors), writes=writes, after_caller=after_caller)
    return Work(group, stream, seq, box, result, what)


def _tensor(t: Any, what: str) -> runtime.Tensor:
    if not isinstance(t, runtime.Tensor):
        raise TypeError(f"{what}: expected a Tensor, got {type(t).__name__}")
    return t


# ---- the collectives -------------------------------------------------------------------------------------


def all_reduce_nowait(
    t: runtime.Tensor, op: str = "sum", group: ProcessGroup | None = None, *, check: bool = True,
    after_caller: bool = True,
) -> Work:
    """Issue an in-place all-reduce of ``t`` over ``group``; the `Work`'s result is ``t``.

    Args:
        t: A tensor of the same shape, dtype and layout on every rank; reduced in place.
        op: ``"sum"``, ``"avg"`` (alias ``"mean"``; floating dtypes), ``"max"``, ``"min"`` or ``"prod"``.
        group: The process group (default: the default group).
        check: Compare shape, dtype and layout across the ranks first (one small all-gather). False is for
            callers that verified them once already (DistributedDataParallel's buckets).
        after_caller: Also wait for everything the calling task queued before (a kernel that may still read
            ``t``). False orders it only after the kernels producing ``t``: what lets DDP's buckets start
            while the rest of the backward still runs.
    """
    what = "all_reduce"
    t = _tensor(t, what)
    g = resolve_group(group, what)
    mop = mpi_op(op, what)
    avg = op in ("avg", "mean")
    if avg and t.dtype.kind not in "fc":
        raise TypeError(f"all_reduce: op={op!r} needs a floating tensor, got dtype {t.dtype}; use op='sum'")
    comm = g.comm
    MPI = _mpi()

    def body(arr: np.ndarray, *, deadline: float) -> None:
        if check:
            check_same(comm, g, what, arr, deadline)
        flat = flat_view(arr)
        buf = np.ascontiguousarray(arr).reshape(-1) if flat is None else flat
        if buf.size:
            wait_request(comm.Iallreduce(MPI.IN_PLACE, buf, mop), g, what, deadline)
        if avg:
            buf /= g.size
        if flat is None:
            np.copyto(arr, buf.reshape(arr.shape))

    return issue(g, what, [t], body, t, nbytes=t.numel() * t.element_size(), after_caller=after_caller)


async def all_reduce(
    t: runtime.Tensor, op: str = "sum", group: ProcessGroup | None = None, *, check: bool = True
) -> runtime.Tensor:
    """All-reduce ``t`` in place over ``group`` and wait for it (see `all_reduce_nowait`); returns ``t``."""
    return await all_reduce_nowait(t, op, group, check=check)  # type: ignore[no-any-return]


def broadcast_nowait(t: runtime.Tensor, src: int = 0, group: ProcessGroup | None = None) -> Work:
    """Issue a broadcast of rank ``src``'s ``t`` into ``t`` on every rank; the `Work`'s result is ``t``."""
    what = f"broadcast(src={src})"
    t = _tensor(t, what)
    g = resolve_group(group, what)
    if not 0 <= src < g.size:
        raise ValueError(f"broadcast: src={src} is not a rank of group {g.name} (size {g.size})")
    comm = g.comm

    def body(arr: np.ndarray, *, deadline: float) -> None:
        check_same(comm, g, what, arr, deadline)
        flat = flat_view(arr)
        buf = np.ascontiguousarray(arr).reshape(-1) if flat is None else flat
        if buf.size:
            wait_request(comm.Ibcast(buf, root=src), g, what, deadline)
        if flat is None:
            np.copyto(arr, buf.reshape(arr.shape))

    return issue(g, what, [t], body, t, nbytes=t.numel() * t.element_size())


async def broadcast(t: runtime.Tensor, src: int = 0, group: ProcessGroup | None = None) -> runtime.Tensor:
    """Broadcast rank ``src``'s ``t`` into ``t`` on every rank and wait for it; returns ``t``."""
    return await broadcast_nowait(t, src, group)  # type: ignore[no-any-return]


def _rank_list(
    what: str, name: str, tensors: Sequence[Any], g: ProcessGroup, like: runtime.Tensor, like_name: str
) -> list[runtime.Tensor]:
    """``tensors`` (one per rank of ``g``) as Tensors, each checked to have ``like``'s shape and dtype."""
    out = [_tensor(x, what) for x in tensors]
    if len(out) != g.size:
        raise ValueError(f"{what}: {name} has {len(out)} tensors but group {g.name} has {g.size} ranks")
    for i, x in enumerate(out):
        if x.shape != like.shape or x.dtype != like.dtype:
            raise ValueError(
                f"{what}: {name}[{i}] has shape {x.shape}, dtype {x.dtype} but the {like_name} has shape "
                f"{like.shape}, dtype {like.dtype}; they must match"
            )
    return out


def all_gather_nowait(tensor_list: list[runtime.Tensor], t: runtime.Tensor, group: ProcessGroup | None = None) -> Work:
    """Issue an all-gather: ``tensor_list[r]`` gets rank r's ``t``; the `Work`'s result is ``tensor_list``."""
    what = "all_gather"
    t = _tensor(t, what)
    g = resolve_group(group, what)
    outs = _rank_list(what, "tensor_list", tensor_list, g, t, "input")
    comm = g.comm

    def body(arr: np.ndarray, *out_arrs: np.ndarray, deadline: float) -> None:
        check_same(comm, g, what, arr, deadline)
        order = memory_order(arr) or list(range(arr.ndim))
        send = np.ascontiguousarray(arr.transpose(order)).reshape(-1)
        recv = np.empty((g.size, send.size), arr.dtype)
        if send.size:
            wait_request(comm.Iallgather(send, recv), g, what, deadline)
        mem_shape = [arr.shape[i] for i in order]
        back = np.argsort(order)
        for r, o in enumerate(out_arrs):
            np.copyto(o, recv[r].reshape(mem_shape).transpose(back))

    return issue(g, what, [t, *outs], body, tensor_list, writes=outs, nbytes=t.numel() * t.element_size())


async def all_gather(
    tensor_list: list[runtime.Tensor], t: runtime.Tensor, group: ProcessGroup | None = None
) -> list[runtime.Tensor]:
    """Gather every rank's ``t`` into ``tensor_list`` (one per rank, in rank order) and wait for it."""
    return await all_gather_nowait(tensor_list, t, group)  # type: ignore[no-any-return]


def reduce_scatter_nowait(
    output: runtime.Tensor, input_list: list[runtime.Tensor], op: str = "sum", group: ProcessGroup | None = None
) -> Work:
    """Issue a reduce-scatter: ``output`` on rank r gets the reduction over ranks of ``input_list[r]``."""
    what = "reduce_scatter"
    output = _tensor(output, what)
    g = resolve_group(group, what)
    ins = _rank_list(what, "input_list", input_list, g, output, "output")
    mop = mpi_op(op, what)
    avg = op in ("avg", "mean")
    comm = g.comm

    def body(out: np.ndarray, *in_arrs: np.ndarray, deadline: float) -> None:
        check_same(comm, g, what, out, deadline)
        send = np.concatenate([np.ascontiguousarray(a).reshape(-1) for a in in_arrs])
        recv = np.empty(out.size, out.dtype)
        if recv.size:
            wait_request(comm.Ireduce_scatter_block(send, recv, mop), g, what, deadline)
        if avg:
            recv /= g.size
        np.copyto(out, recv.reshape(out.shape))

    return issue(g, what, [output, *ins], body, output, writes=[output], nbytes=output.numel() * output.element_size())


async def reduce_scatter(
    output: runtime.Tensor, input_list: list[runtime.Tensor], op: str = "sum", group: ProcessGroup | None = None
) -> runtime.Tensor:
    """Reduce ``input_list[r]`` over the ranks into ``output`` of rank r, and wait for it; returns ``output``."""
    return await reduce_scatter_nowait(output, input_list, op, group)  # type: ignore[no-any-return]


def barrier_nowait(group: ProcessGroup | None = None) -> Work:
    """Issue a barrier (after this task's queued work); the `Work` completes once every rank reached it."""
    what = "barrier"
    g = resolve_group(group, what)
    comm = g.comm

    def body(*, deadline: float) -> None:
        wait_request(comm.Ibarrier(), g, what, deadline)

    return issue(g, what, [], body, None)


async def barrier(group: ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` has reached this barrier."""
    await barrier_nowait(group)
