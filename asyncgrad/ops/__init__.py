"""The op families, one file each: forward kernel, meta and backward rule side by side.

Importing a family registers its ops into the op table (`runtime.defop`) and its adjoint kernels into the
rule namespaces (`runtime.register_xp`); `asyncgrad._tensor_methods` binds them onto Tensor.

    _elementwise  arithmetic, comparisons, exp/log/tanh/sigmoid/relu/..., where, maximum/minimum
    _math         trigonometry, rounding, log1p/expm1/erf/rsqrt/..., clamp, lerp, predicates, allclose
    _convert      astype, to_device, clone, contiguous, copy_to_layout, alias
    _index        indexing (getitem and its adjoint), scatter, gather, index_select
    _shape        reshape, permute, broadcast, concat/stack, split/chunk, flip/roll, repeat, tril/triu, ...
    _reduce       sum, mean, max/min, norm, prod, all/any, var/std, logsumexp, cumsum
    _sort         sort, argsort, topk, masked_select, nonzero
    _random       multinomial
    _linalg       matmul (lane-aware BLAS), mm/bmm/dot/outer/addmm, einsum
    _conv         conv2d, max_pool2d, avg_pool2d
    _conv_transpose  conv1d, conv_transpose1d/2d
    _resample     adaptive average pooling, interpolate (nearest, linear modes), group_norm
    _recurrent    the fused recurrences of RNN/LSTM/GRU layers (one op per layer and direction)
    _attention    scaled_dot_product_attention
    _nn           softmax, log_softmax, gelu, embedding, layer_norm, dropout
    _loss         cross_entropy, nll_loss, mse_loss, binary_cross_entropy(_with_logits), and nn.functional's
                  l1_loss, smooth_l1_loss, huber_loss, kl_div
"""

from ._attention import scaled_dot_product_attention as scaled_dot_product_attention
from ._conv import avg_pool2d, conv2d, max_pool2d
from ._conv_transpose import conv1d, conv_transpose1d, conv_transpose2d
from ._conv_transpose import conv_transpose_output_padding as conv_transpose_output_padding
from ._convert import astype, clone
from ._elementwise import (
    abs,
    add,
    addcdiv,
    addcmul,
    div,
    eq,
    exp,
    floor_divide,
    ge,
    greater,
    greater_equal,
    gt,
    le,
    less,
    less_equal,
    log,
    lt,
    maximum,
    minimum,
    mul,
    ne,
    neg,
    not_equal,
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
from ._index import gather, getitem, index_select, scatter, scatter_add
from ._linalg import addmm, bmm, dot, einsum, matmul, mm, outer

# nn.functional's names, not torch's top level
from ._linalg import linear as linear
from ._loss import binary_cross_entropy as binary_cross_entropy
from ._loss import binary_cross_entropy_with_logits, cross_entropy, mse_loss, nll_loss

# nn.functional's elementwise losses and the helpers its losses share with these (not exported at the
# top level)
from ._loss import huber_loss as huber_loss
from ._loss import kl_div as kl_div
from ._loss import l1_loss as l1_loss
from ._loss import legacy_reduction as legacy_reduction
from ._loss import reduce_loss as reduce_loss
from ._loss import smooth_l1_loss as smooth_l1_loss
from ._loss import weighted_loss as weighted_loss
from ._math import (
    allclose,
    ceil,
    clamp,
    clamp_max,
    clamp_min,
    clip,
    cos,
    equal,
    erf,
    expm1,
    floor,
    isfinite,
    isinf,
    isnan,
    lerp,
    log1p,
    nan_to_num,
    reciprocal,
    round,
    rsqrt,
    sin,
    square,
)
from ._nn import dropout, embedding, gelu, layer_norm, log_softmax, softmax
from ._random import multinomial
from ._recurrent import RECURRENT_MODES as RECURRENT_MODES  # for nn's recurrent layers
from ._recurrent import recurrent_layer as recurrent_layer
from ._reduce import (
    MaxResult,
    all,
    amax,
    amin,
    any,
    argmax,
    argmin,
    cumsum,
    logsumexp,
    max,
    mean,
    min,
    norm,
    prod,
    std,
    sum,
    var,
)
from ._resample import adaptive_avg_pool1d, group_norm
from ._resample import adaptive_avg_pool2d as adaptive_avg_pool2d  # nn.functional's names, not torch's top level
from ._resample import interpolate as interpolate
from ._shape import (
    broadcast_to,
    cat,
    chunk,
    concat,
    diag,
    expand,
    flatten,
    flip,
    fliplr,
    flipud,
    moveaxis,
    movedim,
    narrow,
    permute,
    repeat,
    repeat_interleave,
    reshape,
    roll,
    split,
    squeeze,
    stack,
    swapaxes,
    swapdims,
    trace,
    transpose,
    tril,
    triu,
    unbind,
    unflatten,
    unfold,
    unsqueeze,
)
from ._sort import SortResult, TopkResult, argsort, argwhere, masked_select, nonzero, sort, topk

__all__ = [
    "MaxResult",
    "SortResult",
    "TopkResult",
    "abs",
    "adaptive_avg_pool1d",
    "add",
    "addcdiv",
    "addcmul",
    "addmm",
    "all",
    "allclose",
    "amax",
    "amin",
    "any",
    "argmax",
    "argmin",
    "argsort",
    "argwhere",
    "astype",
    "avg_pool2d",
    "binary_cross_entropy_with_logits",
    "bmm",
    "broadcast_to",
    "cat",
    "ceil",
    "chunk",
    "clamp",
    "clamp_max",
    "clamp_min",
    "clip",
    "clone",
    "concat",
    "conv1d",
    "conv2d",
    "conv_transpose1d",
    "conv_transpose2d",
    "cos",
    "cross_entropy",
    "cumsum",
    "diag",
    "div",
    "dot",
    "dropout",
    "einsum",
    "embedding",
    "eq",
    "equal",
    "erf",
    "exp",
    "expand",
    "expm1",
    "flatten",
    "flip",
    "fliplr",
    "flipud",
    "floor",
    "floor_divide",
    "gather",
    "ge",
    "gelu",
    "getitem",
    "greater",
    "greater_equal",
    "group_norm",
    "gt",
    "index_select",
    "isfinite",
    "isinf",
    "isnan",
    "layer_norm",
    "le",
    "lerp",
    "less",
    "less_equal",
    "log",
    "log1p",
    "log_softmax",
    "logsumexp",
    "lt",
    "masked_select",
    "matmul",
    "max",
    "max_pool2d",
    "maximum",
    "mean",
    "min",
    "minimum",
    "mm",
    "moveaxis",
    "movedim",
    "mse_loss",
    "mul",
    "multinomial",
    "nan_to_num",
    "narrow",
    "ne",
    "neg",
    "nll_loss",
    "nonzero",
    "norm",
    "not_equal",
    "outer",
    "permute",
    "pow",
    "prod",
    "reciprocal",
    "relu",
    "remainder",
    "repeat",
    "repeat_interleave",
    "reshape",
    "roll",
    "round",
    "rsqrt",
    "scatter",
    "scatter_add",
    "sigmoid",
    "sign",
    "sin",
    "softmax",
    "sort",
    "split",
    "sqrt",
    "square",
    "squeeze",
    "stack",
    "std",
    "sub",
    "sum",
    "swapaxes",
    "swapdims",
    "tanh",
    "topk",
    "trace",
    "transpose",
    "tril",
    "triu",
    "unbind",
    "unflatten",
    "unfold",
    "unsqueeze",
    "var",
    "where",
]
