"""Op families with their forward kernels, meta functions and backward rules, registered in the op table.

Built only on the public names of `asyncgrad.runtime` (``defop``, ``apply``, ``Tensor``, ``OpError``).
"""

from ._attention import scaled_dot_product_attention
from ._recurrent import RECURRENT_MODES, recurrent_layer

__all__ = ["RECURRENT_MODES", "recurrent_layer", "scaled_dot_product_attention"]
