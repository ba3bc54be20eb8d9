"""Tensors, ops with backward rules, the backward engine, hooks, grad modes and custom Functions."""

from . import (  # noqa: F401  (register ops)
    _ops_conv,
    _ops_elementwise,
    _ops_linalg,
    _ops_nn,
    _ops_nn2,
    _ops_reduce,
    _ops_shape,
)
from ._apply import BackwardError
from ._autograd import backward, grad
from ._checkpoint import checkpoint
from ._dispatch import OPS, Node, Op, OpError, OpNode, apply, defop
from ._factories import (
    arange,
    default_generator,
    empty,
    from_numpy,
    full,
    get_default_dtype,
    manual_seed,
    ones,
    ones_like,
    rand,
    randn,
    set_default_dtype,
    tensor,
    zeros,
    zeros_like,
)
from ._function import Function, FunctionCtx
from ._grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from ._hooks import RemovableHandle
from ._layout import empty_like_contract, is_dense_nonoverlapping, obeys_contract
from ._ops_act import gelu
from ._ops_conv import avg_pool2d, conv2d, max_pool2d
from ._ops_elementwise import (
    abs,
    add,
    astype,
    clone,
    div,
    exp,
    floor_divide,
    log,
    maximum,
    minimum,
    mul,
    neg,
    pow,
    relu,
    remainder,
    sigmoid,
    sign,
    sqrt,
    sub,
    tanh,
    where,
)
from ._ops_linalg import matmul
from ._ops_nn import log_softmax, softmax
from ._ops_nn2 import (
    binary_cross_entropy_with_logits,
    clamp,
    clamp_max,
    clamp_min,
    clip,
    cross_entropy,
    cumsum,
    dropout,
    einsum,
    embedding,
    gather,
    index_select,
    layer_norm,
    logsumexp,
    mse_loss,
    nll_loss,
    std,
    var,
)
from ._ops_reduce import MaxResult, amax, argmax, argmin, max, mean, min, norm, sum
from ._ops_shape import (
    broadcast_to,
    cat,
    concat,
    expand,
    flatten,
    getitem,
    permute,
    reshape,
    squeeze,
    stack,
    transpose,
    unsqueeze,
)
from ._runtime import NoRuntimeError, Runtime, RuntimeStatistics, current_runtime, open_runtime, run
from ._tensor import Tensor

__all__ = [
    "OPS", "BackwardError", "Function", "FunctionCtx", "MaxResult", "NoRuntimeError", "Node", "Op", "OpError",
    "OpNode", "RemovableHandle", "Runtime", "RuntimeStatistics", "Tensor", "abs", "add", "amax", "apply", "arange",
    "argmax", "argmin", "astype", "avg_pool2d", "backward", "binary_cross_entropy_with_logits", "broadcast_to",
    "cat", "checkpoint", "clamp", "clamp_max", "clamp_min", "clip", "clone", "concat", "conv2d", "cross_entropy",
    "cumsum", "current_runtime", "default_generator", "defop", "div", "dropout", "einsum", "embedding", "empty",
    "empty_like_contract", "enable_grad", "exp", "expand", "flatten", "floor_divide", "from_numpy", "full",
    "gather", "gelu", "get_default_dtype", "getitem", "grad", "index_select", "is_dense_nonoverlapping",
    "is_grad_enabled", "layer_norm", "log", "log_softmax", "logsumexp", "manual_seed", "matmul", "max",
    "max_pool2d", "maximum", "mean", "min", "minimum", "mse_loss", "mul", "neg", "nll_loss", "no_grad", "norm",
    "obeys_contract", "ones", "ones_like", "open_runtime", "permute", "pow", "rand", "randn", "relu", "remainder",
    "reshape", "run", "set_default_dtype", "set_grad_enabled", "sigmoid", "sign", "softmax", "sqrt", "squeeze",
    "stack", "std", "sub", "sum", "tanh", "tensor", "transpose", "unsqueeze", "var", "where", "zeros", "zeros_like",
]
