"""Helpers shared by the optimizers (PyTorch's argument checks, the gradient term of the single-tensor
updates, scalar-state rounding)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime import get_default_dtype


def torch_only_flags(name: str, foreach: bool | None, capturable: bool, differentiable: bool) -> dict[str, Any]:
    """PyTorch's kernel flags, checked, as a group keeps them: ``foreach`` (a kernel choice) is accepted;
    ``capturable`` / ``differentiable`` (CUDA graphs, differentiating through the update) are not supported
    and must be False.

    Raises:
        ValueError: If ``capturable`` or ``differentiable`` is True.
    """
    for k, v in (("capturable", capturable), ("differentiable", differentiable)):
        if v:
            raise ValueError(f"{name}: {k}=True is not supported by asyncgrad (leave it False)")
    return {"foreach": foreach, "capturable": False, "differentiable": False}


def adam_family_hypers(group: dict[str, Any]) -> tuple[float, float, float, float, float, bool]:
    """``(lr, eps, beta1, beta2, weight_decay, maximize)`` of an Adam-family group, as its kernel uses them."""
    beta1, beta2 = group["betas"]
    return (float(group["lr"]), float(group["eps"]), float(beta1), float(beta2), float(group["weight_decay"]),
            bool(group["maximize"]))


def group_floats(group: dict[str, Any], *names: str) -> list[float]:
    """The hyper-parameters ``names`` of a parameter group, as floats (in that order)."""
    return [float(group[k]) for k in names]


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
    """PyTorch's check of a hyper-parameter that must be >= 0 (NaN fails it too)."""
    if not 0.0 <= v:
        raise ValueError(f"Invalid {what}: {v}")


def check_betas(betas: tuple[float, float]) -> None:
    """PyTorch's check of the Adam family's ``betas``: each in [0, 1)."""
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")


def check_hyper(group: dict[str, Any], checks: tuple[tuple[str, str], ...]) -> None:
    """Check a group's hyper-parameters in the given (PyTorch's) order: each ``(key, name)`` must be >= 0
    (the error says ``Invalid {name}``), except ``betas``, checked by `check_betas`."""
    for key, what in checks:
        if key == "betas":
            check_betas(group[key])
        else:
            nonneg(what, group[key])


ADAM_FAMILY_CHECKS = (
    ("lr", "learning rate"),
    ("eps", "epsilon value"),
    ("betas", "beta parameter"),
    ("weight_decay", "weight_decay value"),
)
"""The hyper-parameter checks PyTorch's Adamax, NAdam and RAdam share (see `check_hyper`)."""


def lerp_(a: np.ndarray, b: np.ndarray, w: float) -> None:
    """``a = a + w * (b - a)`` in place, evaluated like PyTorch's CPU ``lerp_``."""
    if w < 0.5:
        a += w * (b - a)
    else:
        np.subtract(b, (b - a) * (1.0 - w), out=a)


def adam_moments_(m: np.ndarray, v: np.ndarray, d: np.ndarray, beta1: float, beta2: float, first: bool) -> None:
    """The Adam family's moment estimates, in place, as NAdam's and RAdam's single-tensor updates compute
    them: ``m = lerp(m, d, 1 - beta1)``, ``v = beta2 * v + (1 - beta2) * d * d`` (both from zero on the
    ``first`` step). Runs inside a kernel."""
    if first:
        m.fill(0)
        v.fill(0)
    lerp_(m, d, 1 - beta1)
    v *= beta2
    v += (1 - beta2) * d * d


def grad_term(
    pa: np.ndarray, ga: np.ndarray, maximize: bool, wd: float, lr: float = 0.0, decoupled: bool = False
) -> np.ndarray:
    """The gradient as PyTorch's single-tensor updates start: negated if ``maximize``, plus the L2 term
    ``wd * p``; with ``decoupled`` (AdamW's), ``p`` is scaled by ``1 - lr * wd`` in place instead.

    Runs inside a kernel: ``pa`` and ``ga`` are the parameter's and the gradient's arrays. The result may
    be ``ga`` itself: do not write into it.
    """
    d = -ga if maximize else ga
    if wd != 0:
        if decoupled:
            pa *= 1 - lr * wd
        else:
            d = d + wd * pa
    return d
