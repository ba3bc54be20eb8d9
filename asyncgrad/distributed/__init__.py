"""asyncgrad.distributed: processes are actors too.

``async with dist.open_workers(n) as workers`` starts worker processes, each running its own asyncgrad
runtime; ``await workers[0].call(fn, x)`` runs a module-level function there (sent by name, never
pickled; tensors travel as raw buffers with their dtype, shape and strides). See DESIGN.md.

This package imports cheaply and never imports asyncgrad.nn.
"""

# ---- RPC: worker processes, calls, stream-aware futures, RRefs (issue 16) ---------------------------
from ._errors import AuthenticationError, RemoteError, WorkerDied, WorkersClosed
from ._future import Future
from ._peer import current_call, statistics
from ._rref import RRef
from ._streams import RPCStatistics
from ._workers import CallCancelled, Worker, Workers, open_workers

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
# ---- end of the RPC block (other parts of the package add their names below: `__all__ += [...]`) -----

# ---- population: many trainings over worker processes (issue 17) ------------------------------------
from ._population import (
    DEFAULT_MAX_CONCURRENT,
    Population,
    PopulationStatistics,
    Result,
    Run,
    RunCancelled,
    open_population,
)
from ._trial import Trial

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
