"""The runtime: Runtime, Tensor and its fields, dispatch, graph nodes, the op table, factories, dtype
promotion, grad modes and hook handles.

The layers above build on these names: `asyncgrad.ops` registers its ops into the op table (`defop`) and
the rule namespaces (`register_xp`), `asyncgrad.autograd` runs the graph of `Node`s that `apply` records.
"""

from ._capture import CaptureFallback as CaptureFallback
from ._capture import capture_active as capture_active
from ._dispatch import apply

# for the layers above (nn's hooks, optim's in-place updates, distributed's comm streams); not in __all__, so
# not re-exported at the top level
from ._external import stream_work as stream_work
from ._external import submit_on as submit_on
from ._factories import (
    arange,
    default_generator,
    empty,
    empty_like,
    eye,
    from_numpy,
    full,
    full_like,
    get_default_dtype,
    linspace,
    manual_seed,
    normal,
    ones,
    ones_like,
    rand,
    rand_like,
    randint,
    randn,
    randn_like,
    set_default_dtype,
    tensor,
    zeros,
    zeros_like,
)
from ._grad_mode import enable_grad, inference_mode, is_grad_enabled, no_grad, set_grad_enabled
from ._hooks import HookTable as HookTable
from ._hooks import RemovableHandle
from ._hooks import add_hook as add_hook
from ._inplace import inplace as inplace
from ._layout import empty_like_contract, is_dense_nonoverlapping, obeys_contract
from ._node import Node, OpNode
from ._op import OPS, Op, OpError, defop
from ._row_support import bind_rows as bind_rows
from ._row_support import note_rows as note_rows
from ._row_support import noted_rows as noted_rows
from ._row_support import rows_bound as rows_bound
from ._row_support import unbind_rows as unbind_rows
from ._row_support import untouched_zeros as untouched_zeros
from ._runtime import (
    NoRuntimeError,
    Runtime,
    RuntimeStatistics,
    current_runtime,
    current_stream,
    open_runtime,
    run,
    use_stream,
)
from ._sync_access import BLOCKED_WARN_S as BLOCKED_WARN_S
from ._sync_access import SyncAccessWarning
from ._sync_access import user_site as user_site
from ._tensor import Tensor
from ._tensor import share_version as share_version  # utils' load rebuilds views of one buffer
from ._zero_grads import zero_grads as zero_grads


def is_tensor(obj: object) -> bool:
    """Whether ``obj`` is an asyncgrad Tensor."""
    return isinstance(obj, Tensor)


def numel(t: Tensor) -> int:
    """The number of elements of ``t``."""
    return t.numel()


__all__ = [
    "OPS",
    "NoRuntimeError",
    "Node",
    "Op",
    "OpError",
    "OpNode",
    "RemovableHandle",
    "Runtime",
    "RuntimeStatistics",
    "SyncAccessWarning",
    "Tensor",
    "apply",
    "arange",
    "current_runtime",
    "current_stream",
    "default_generator",
    "defop",
    "empty",
    "empty_like",
    "empty_like_contract",
    "enable_grad",
    "eye",
    "from_numpy",
    "full",
    "full_like",
    "get_default_dtype",
    "inference_mode",
    "is_dense_nonoverlapping",
    "is_grad_enabled",
    "is_tensor",
    "linspace",
    "manual_seed",
    "no_grad",
    "normal",
    "numel",
    "obeys_contract",
    "ones",
    "ones_like",
    "open_runtime",
    "rand",
    "rand_like",
    "randint",
    "randn",
    "randn_like",
    "run",
    "set_default_dtype",
    "set_grad_enabled",
    "tensor",
    "use_stream",
    "zeros",
    "zeros_like",
]
