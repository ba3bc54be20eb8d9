"""Utilities for training with PyTorch's names (``torch.nn.utils``): gradient clipping and flattening
parameters into one vector.

Example::

    await loss.backward()
    total = ag.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
"""

from . import rnn
from .clip_grad import clip_grad_norm, clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_, get_total_norm
from .convert_parameters import parameters_to_vector, vector_to_parameters

__all__ = [
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "get_total_norm",
    "parameters_to_vector",
    "rnn",
    "vector_to_parameters",
]
