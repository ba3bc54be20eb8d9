"""asyncgrad.distributed: processes are actors too.

``async with dist.open_workers(n) as workers`` starts worker processes, each running its own asyncgrad
runtime; ``await workers[0].call(fn, x)`` runs a module-level function there (sent by name, never pickled;
tensors travel as raw buffers with their dtype, shape and strides). ``dist.init_process_group("mpi")`` and the
collectives (``await dist.all_reduce(t)``) run data parallel over MPI (mpi4py is imported only when a group is
created: ``from asyncgrad import distributed`` works without it). See DESIGN.md.

This package never imports asyncgrad.nn.
"""


# ---- RPC: worker processes, calls, stream-aware futures, RRefs (issue 16) ---------------------------
# distributed autograd and the distributed optimizer (issue 19)
from . import autograd, optim
from ._dist_optim import DistributedOptimizer
from ._errors import AuthenticationError, CallCancelled, RemoteError, WorkerDied, WorkersClosed
from ._future import Future
from ._mesh import PeerWorker, get_worker, rpc
from ._peer import current_call, statistics

# population: many trainings over worker processes (issue 17)
from ._population import (
    DEFAULT_MAX_CONCURRENT,
    Population,
    PopulationStatistics,
    Result,
    Run,
    RunCancelled,
    open_population,
)
from ._rref import RRef
from ._streams import RPCStatistics
from ._trial import Trial
from ._workers import Worker, Workers, open_workers

__all__ = [
    "AuthenticationError",
    "CallCancelled",
    "Future",
    "RPCStatistics",
    "RRef",
    "RemoteError",
    "Worker",
    "WorkerDied",
    "Workers",
    "WorkersClosed",
    "current_call",
    "open_workers",
    "statistics",
]

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

__all__ += [
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

# ---- distributed autograd and the distributed optimizer (issue 19) ------------------------------------

__all__ += ["DistributedOptimizer", "PeerWorker", "autograd", "get_worker", "optim", "rpc"]
# ---- end of the RPC block (other parts of the package add their names below: `__all__ += [...]`) -----

__all__ += [
    "DEFAULT_MAX_CONCURRENT",
    "Population",
    "PopulationStatistics",
    "Result",
    "Run",
    "RunCancelled",
    "Trial",
    "open_population",
]
# ---- end of the population block ---------------------------------------------------------------------
