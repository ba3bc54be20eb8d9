"""Process groups over MPI (mpi4py + Open MPI): who the ranks are, and the comm streams they talk on.

A group owns a duplicated communicator (concurrent collectives on one communicator corrupt each other's
buffers, so no two groups share one) and, per device, one *comm stream*: a CPU lane of its own that runs
only this group's collectives, in the order they were issued. Issuing order is the same on every rank
(each rank's program issues them in program order), which is what MPI requires of collectives.

mpi4py is imported only when a group is created, so ``import asyncgrad.distributed`` works without it.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

import attrs

from ..actors import read_record
from ..devices import Device, Lane, Stream

# Seconds a collective may wait for its peers before it fails (a peer that raised, died or issued a
# different collective). PyTorch's default is 30 minutes; a training step here is far shorter, and a hang
# that long on a small cluster is worse than a restart.
DEFAULT_TIMEOUT = 300.0


class DistributedError(RuntimeError):
    """A collective or process-group operation failed (on this rank or because of a peer)."""


class CollectiveTimeout(DistributedError, TimeoutError):
    """A collective did not complete within its group's timeout: a peer raised, died or issued another one."""


class CollectiveMismatchError(DistributedError, ValueError):
    """The ranks called a collective with tensors of different shape, dtype or layout."""


@attrs.frozen
class GroupStatistics:
    """Counters of one process group on this rank."""

    name: str
    rank: int
    size: int
    collectives_issued: int
    collectives_completed: int
    collectives_failed: int
    bytes_reduced: int
    comm_streams: int
    broken: str | None


@attrs.frozen
class TimelineEntry:
    """One collective job on a comm stream: when its inputs were ready (it started) and when it ended.

    Times are `time.perf_counter()` seconds of this process.
    """

    what: str
    nbytes: int
    start: float
    end: float


@attrs.define(eq=False)
class ProcessGroup:
    """A set of ranks with its own communicator and comm streams. Make one with `init_process_group` or
    `new_group`; its methods are used by the collectives and by DistributedDataParallel."""

    _comm: Any
    _name: str
    _timeout: float
    _streams: dict[Device, Stream] = attrs.field(factory=dict)
    _lanes: list[Lane] = attrs.field(factory=list)
    _issued: int = 0
    _completed: int = 0
    _failed: int = 0
    _bytes: int = 0
    _broken: str | None = None
    _timeline: list[TimelineEntry] | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _closed: bool = False

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return int(self._comm.Get_rank())

    @property
    def size(self) -> int:
        """How many ranks the group has."""
        return int(self._comm.Get_size())

    @property
    def name(self) -> str:
        return self._name

    @property
    def timeout(self) -> float:
        """Seconds a collective of this group may wait for its peers."""
        return self._timeout

    @property
    def comm(self) -> Any:
        """The group's own (duplicated) mpi4py communicator."""
        return self._comm

    def comm_stream(self, device: Device) -> Stream:
        """This group's comm stream on ``device``: a lane of its own, running only this group's work."""
        if self._closed:
            raise DistributedError(f"process group {self._name} was destroyed; create a new one")
        s = self._streams.get(device)
        if s is None:
            if device.type != "cpu":
                raise DistributedError(
                    f"process group {self._name}: collectives on {device} need the NCCL backend, which is not "
                    "implemented yet; move the tensors to the CPU"
                )
            lane = Lane(f"{device}-comm[{self._name}]", len(self._lanes))
            self._lanes.append(lane)
            s = self._streams[device] = Stream(device, lane)
        return s

    def enable_timeline(self, flag: bool = True) -> None:
        """Record a `TimelineEntry` per collective job from now on (``flag=False`` stops and clears)."""
        self._timeline = [] if flag else None

    def timeline(self) -> list[TimelineEntry]:
        """The recorded collective jobs (see `enable_timeline`)."""
        return list(self._timeline or [])

    def statistics(self) -> GroupStatistics:
        return read_record(
            GroupStatistics, self, collectives_issued=self._issued, collectives_completed=self._completed,
            collectives_failed=self._failed, bytes_reduced=self._bytes, comm_streams=len(self._streams),
        )

    # ---- used by the jobs on the comm lanes -----------------------------------------------------

    def _note_issued(self) -> None:
        self._issued += 1

    def _note_done(self, what: str, nbytes: int, start: float, end: float) -> None:
        with self._lock:
            self._completed += 1
            self._bytes += nbytes
            if self._timeline is not None:
                self._timeline.append(TimelineEntry(what, nbytes, start, end))

    def _note_failed(self, why: str) -> None:
        with self._lock:
            self._failed += 1
            if self._broken is None:
                self._broken = why

    def _check_usable(self, what: str) -> None:
        if self._broken is not None:
            raise DistributedError(
                f"{what} on process group {self._name} (rank {self.rank}): the group is unusable after an "
                f"earlier failure ({self._broken}); destroy it and create a new one"
            )

    def close(self) -> None:
        """Stop the comm lanes (after their queued work) and free the communicator."""
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes:
            lane.stop(discard=self._broken is not None)
        for lane in self._lanes:
            # a broken group may have a job stuck in MPI: it times out by itself, so the join is bounded
            lane.join(self._timeout + 5.0 if self._broken else None)
        self._lanes.clear()
        self._streams.clear()
        if self._broken is None:
            try:
                self._comm.Free()
            except Exception:  # MPI already finalized at interpreter exit: nothing left to free
                pass


_world: ProcessGroup | None = None
_groups: list[ProcessGroup] = []


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            "the 'mpi' backend needs mpi4py and Open MPI: pip install 'asyncgrad[mpi]' "
            "(both are wheels; no system packages needed)"
        ) from e
    return MPI


def init_process_group(backend: str = "mpi", *, timeout: float = DEFAULT_TIMEOUT) -> ProcessGroup:
    """Join the default process group of all ranks started by ``mpiexec`` (or the launcher).

    Args:
        backend: ``"mpi"`` (mpi4py over Open MPI, CPU tensors). NCCL comes later behind the same calls.
        timeout: Seconds any collective of the group may wait for its peers before it raises
            `CollectiveTimeout` (default `DEFAULT_TIMEOUT` = 300 s).

    Returns:
        The default group (collectives use it when ``group=None``).
    """
    global _world
    if backend != "mpi":
        raise ValueError(f"init_process_group: unknown backend {backend!r}; the only backend so far is 'mpi'")
    if not timeout > 0:
        raise ValueError(f"init_process_group: timeout must be a positive number of seconds, got {timeout!r}")
    if _world is not None:
        raise RuntimeError(
            "init_process_group: the default process group is already initialized; call "
            "destroy_process_group() first"
        )
    MPI = _mpi()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise DistributedError(
            "init_process_group: MPI was initialized without MPI_THREAD_MULTIPLE, but every group's "
            "collectives run on a lane of their own; do not set mpi4py.rc.thread_level below 'multiple'"
        )
    _world = ProcessGroup(MPI.COMM_WORLD.Dup(), "world", float(timeout))
    _groups.append(_world)
    return _world


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return _world is not None


def _default_group(what: str) -> ProcessGroup:
    if _world is None:
        raise RuntimeError(
            f"{what}: the default process group is not initialized; call "
            "asyncgrad.distributed.init_process_group('mpi') first (and start the program with "
            "python -m asyncgrad.distributed.launch -n N script.py)"
        )
    return _world


def resolve_group(group: ProcessGroup | None, what: str) -> ProcessGroup:
    """``group``, or the default group."""
    if group is None:
        return _default_group(what)
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"{what}: group must be a ProcessGroup or None, got {type(group).__name__}")
    if group._closed:
        raise DistributedError(f"{what}: process group {group.name} was destroyed")
    return group


def get_default_group() -> ProcessGroup:
    """The default group (made by `init_process_group`)."""
    return _default_group("get_default_group")


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the default group)."""
    return resolve_group(group, "get_rank").rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (default: the default group)."""
    return resolve_group(group, "get_world_size").size


def new_group(ranks: list[int] | None = None, *, timeout: float | None = None) -> ProcessGroup | None:
    """A new group of ``ranks`` of the default group (all of them by default), with its own communicator.

    Every rank of the default group must call it, with the same ``ranks``. Ranks outside ``ranks`` get None.
    """
    world = _default_group("new_group")
    members = list(range(world.size)) if ranks is None else sorted({int(r) for r in ranks})
    bad = [r for r in members if not 0 <= r < world.size]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are not in the default group of size {world.size}")
    MPI = _mpi()
    color = 0 if world.rank in members else MPI.UNDEFINED
    comm = world.comm.Split(color, members.index(world.rank) if world.rank in members else 0)
    if comm == MPI.COMM_NULL:
        return None
    g = ProcessGroup(comm, f"group{len(_groups)}{members}", float(timeout or world.timeout))
    _groups.append(g)
    return g


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group`` (default: every group, the default one included): stops its comm lanes."""
    global _world
    if group is None:
        for g in reversed(_groups):
            g.close()
        _groups.clear()
        _world = None
        return
    group.close()
    if group in _groups:
        _groups.remove(group)
    if group is _world:
        _world = None


@atexit.register
def _close_all() -> None:
    # lanes still queued with collectives at exit would run them after MPI is finalized: drop them
    for g in reversed(_groups):
        g._closed = True
        for lane in g._lanes:
            lane.stop(discard=True)
