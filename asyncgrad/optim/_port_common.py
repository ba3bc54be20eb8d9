"""Helpers shared by the optimizers ported from ``torch.optim`` (argument checks, scalar-state rounding)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime import get_default_dtype


def check_torch_only_flags(name: str, **flags: Any) -> None:
    """PyTorch's ``foreach`` (a kernel choice) is accepted; ``capturable`` / ``differentiable`` (CUDA graphs,
    differentiating through the update) are not supported and must be False."""
    for k in ("capturable", "differentiable"):
        if flags.get(k):
            raise ValueError(f"{name}: {k}=True is not supported by asyncgrad (leave it False)")


def scalar_state(x: float) -> float:
    """``x`` as PyTorch keeps a scalar optimizer state (ASGD's eta and mu, NAdam's mu_product): a 0-d
    tensor of float64 when the default dtype is float64, else float32."""
    return float(np.float64(x)) if get_default_dtype() == np.float64 else float(np.float32(x))


def scalar_state_mul(a: float, b: float) -> float:
    """``a *= b`` on such a scalar state: PyTorch multiplies a float32 0-d tensor by a Python float in
    float32 (the number is cast first)."""
    if get_default_dtype() == np.float64:
        return a * b
    return float(np.float32(a) * np.float32(b))


def nonneg(what: str, v: float) -> None:
    if not 0.0 <= v:
        raise ValueError(f"Invalid {what}: {v}")
