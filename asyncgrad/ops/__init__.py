"""Op families with their forward kernels, meta functions and backward rules, registered in the op table.

Built only on the public names of `asyncgrad.runtime` (``defop``, ``apply``, ``Tensor``, ``OpError``).
"""

from ._attention import scaled_dot_product_attention
from ._conv_transpose import conv1d, conv_transpose1d, conv_transpose2d, conv_transpose_output_padding
from ._recurrent import RECURRENT_MODES, recurrent_layer
from ._resample import adaptive_avg_pool1d, adaptive_avg_pool2d, group_norm, interpolate

__all__ = [
    "RECURRENT_MODES",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "conv1d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose_output_padding",
    "group_norm",
    "interpolate",
    "recurrent_layer",
    "scaled_dot_product_attention",
]
