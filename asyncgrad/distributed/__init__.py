"""Distributed asyncgrad: worker processes over authenticated connections, and data parallel over MPI.

mpi4py is imported only when a process group is created: ``from asyncgrad import distributed`` works
without it.
"""

# ---- data parallel over process groups (issue 18): process groups, collectives, comm hooks ----
from . import comm_hooks
from ._collectives import (
    Work,
    all_gather,
    all_gather_nowait,
    all_reduce,
    all_reduce_nowait,
    barrier,
    barrier_nowait,
    broadcast,
    broadcast_nowait,
    reduce_scatter,
    reduce_scatter_nowait,
)
from ._collectives import memory_order as memory_order  # for nn.parallel's bucket views (not user API)
from ._process_group import (
    DEFAULT_TIMEOUT,
    CollectiveMismatchError,
    CollectiveTimeout,
    DistributedError,
    GroupStatistics,
    ProcessGroup,
    TimelineEntry,
    destroy_process_group,
    get_default_group,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)

__all__ = [
    # ---- process groups, collectives, comm hooks (issue 18) ----
    "DEFAULT_TIMEOUT",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "DistributedError",
    "GroupStatistics",
    "ProcessGroup",
    "TimelineEntry",
    "Work",
    "all_gather",
    "all_gather_nowait",
    "all_reduce",
    "all_reduce_nowait",
    "barrier",
    "barrier_nowait",
    "broadcast",
    "broadcast_nowait",
    "comm_hooks",
    "destroy_process_group",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "reduce_scatter",
    "reduce_scatter_nowait",
    # ---- end of the process-group block ----
]
