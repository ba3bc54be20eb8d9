"""Compiled CPU kernels, each beside its numpy twin: plain functions on arrays (no Tensor, no device).

Kernels are written for numba (``@njit(nogil=True)``): compiled lazily on first use and cached on disk in
the user's cache directory (`cache_dir`), never at ``import asyncgrad``. They release the GIL, so two lanes
run two of them at once. ``ASYNCGRAD_JIT=0``, or numba not installed, selects the numpy twins (`JIT` is
then False); each public function here is the compiled kernel or its twin, chosen once at import.
"""

from ._elementwise import fusable as fusable
from ._elementwise import sigmoid_backward as sigmoid_backward
from ._elementwise import tanh_backward as tanh_backward
from ._embedding import embedding_scatter_add_ as embedding_scatter_add_
from ._gelu import erf32 as erf32
from ._gelu import gelu32 as gelu32
from ._gelu import gelu32_backward as gelu32_backward
from ._jit import ENABLED as JIT
from ._jit import K as K
from ._jit import cache_dir as cache_dir
from ._layer_norm import layer_norm_backward as layer_norm_backward
from ._layer_norm import layer_norm_forward as layer_norm_forward
from ._optim import adam_update as adam_update
from ._optim import sgd_momentum_update as sgd_momentum_update
from ._softmax import softmax_backward_lastdim_ as softmax_backward_lastdim_
from ._softmax import softmax_lastdim_ as softmax_lastdim_

__all__ = [
    "JIT",
    "K",
    "adam_update",
    "cache_dir",
    "embedding_scatter_add_",
    "erf32",
    "fusable",
    "gelu32",
    "gelu32_backward",
    "layer_norm_backward",
    "layer_norm_forward",
    "sgd_momentum_update",
    "sigmoid_backward",
    "softmax_backward_lastdim_",
    "softmax_lastdim_",
    "tanh_backward",
]
