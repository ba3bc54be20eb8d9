"""PyTorch's ``torch.autograd`` names: `grad`, `backward`, `Function` (and its context), grad modes.

A namespace over the runtime's autograd (the core re-organisation moves the implementation here).
"""

from ..runtime import (
    Function,
    FunctionCtx,
    backward,
    enable_grad,
    grad,
    inference_mode,
    no_grad,
    once_differentiable,
    set_grad_enabled,
)

__all__ = [
    "Function",
    "FunctionCtx",
    "backward",
    "enable_grad",
    "grad",
    "inference_mode",
    "no_grad",
    "once_differentiable",
    "set_grad_enabled",
]
