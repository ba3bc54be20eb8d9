"""The runtime: Runtime, Tensor and its fields, dispatch, graph nodes, the op table, factories, dtype
promotion, grad modes and hook handles.

The layers above build on these names: `asyncgrad.ops` registers its ops into the op table (`defop`) and
the rule namespaces (`register_xp`), `asyncgrad.autograd` runs the graph of `Node`s that `apply` records.
"""

from ._dispatch import apply, apply1, apply2, wait_for
from ._external import stream_work, submit_on
from ._factories import (
    arange,
    default_generator,
    empty,
    empty_like,
    eye,
    fork_default_generator,
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
from ._hooks import HookTable, RemovableHandle, add_hook
from ._inplace import inplace
from ._layout import empty_like_contract, is_dense_nonoverlapping, obeys_contract
from ._node import AccumulateGradView, Node, OpNode, edges_of
from ._op import OPS, Op, OpError, defop
from ._runtime import (
    NoRuntimeError,
    Runtime,
    RuntimeStatistics,
    current_runtime,
    current_stream,
    open_runtime,
    run,
)
from ._sync_access import BLOCKED_WARN_S, SyncAccessWarning, user_site
from ._tensor import Tensor, is_ready, share_version
from ._xp import AG, NP, register_xp, sum_to


def is_tensor(obj: object) -> bool:
    """Whether ``obj`` is an asyncgrad Tensor."""
    return isinstance(obj, Tensor)


def numel(t: Tensor) -> int:
    """The number of elements of ``t``."""
    return t.numel()


__all__ = [
    "AG",
    "BLOCKED_WARN_S",
    "NP",
    "OPS",
    "AccumulateGradView",
    "HookTable",
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
    "add_hook",
    "apply",
    "apply1",
    "apply2",
    "arange",
    "current_runtime",
    "current_stream",
    "default_generator",
    "defop",
    "edges_of",
    "empty",
    "empty_like",
    "empty_like_contract",
    "enable_grad",
    "eye",
    "fork_default_generator",
    "from_numpy",
    "full",
    "full_like",
    "get_default_dtype",
    "inference_mode",
    "inplace",
    "is_dense_nonoverlapping",
    "is_grad_enabled",
    "is_ready",
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
    "register_xp",
    "run",
    "set_default_dtype",
    "set_grad_enabled",
    "share_version",
    "stream_work",
    "submit_on",
    "sum_to",
    "tensor",
    "user_site",
    "wait_for",
    "zeros",
    "zeros_like",
]
