"""Activation ops that the core lacks: GELU (exact, erf-based, or the tanh approximation).

``gelu(x) = x * Phi(x)`` with ``Phi`` the standard normal CDF (PyTorch's default,
``approximate="none"``), or ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` with
``approximate="tanh"``. The backward is its own op (``gelu_backward``) so that ``create_graph=True``
records it and double backward works.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._dispatch import OpError, apply, broadcast_shapes, defop
from ._tensor import Tensor
from ._xp import NP

_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715

_erf_impl: Any = None


def _erf(x: np.ndarray) -> np.ndarray:
    """Vectorised erf: scipy's (exact to the last ulp) when installed, imported on first use only
    (importing scipy costs ~0.5 s and ~20 MB, too much for `import asyncgrad`)."""
    global _erf_impl
    if _erf_impl is None:
        try:
            from scipy.special import erf as scipy_erf

            _erf_impl = scipy_erf
        except ImportError:  # pragma: no cover - exercised only without scipy
            scalar = np.frompyfunc(math.erf, 1, 1)
            _erf_impl = lambda v: np.asarray(scalar(v), dtype=np.result_type(v, np.float32))  # noqa: E731
    return _erf_impl(x)  # type: ignore[no-any-return]


def _check(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise OpError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def _gelu_kernel(a: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        inner = _K * (a + _C * a * a * a)
        return (0.5 * a * (1.0 + np.tanh(inner))).astype(a.dtype, copy=False)
    return (0.5 * a * (1.0 + _erf(a / _SQRT_2))).astype(a.dtype, copy=False)


def _gelu_grad_kernel(g: np.ndarray, a: np.ndarray, approximate: str) -> np.ndarray:
    """``g * gelu'(a)``."""
    if approximate == "tanh":
        inner = _K * (a + _C * a * a * a)
        t = np.tanh(inner)
        d = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * a * a)
    else:
        cdf = 0.5 * (1.0 + _erf(a / _SQRT_2))
        pdf = np.exp(-0.5 * a * a) * _INV_SQRT_2PI
        d = cdf + a * pdf
    return (g * d).astype(np.result_type(g, a), copy=False)


def _gelu_second(xp: Any, a: Any, approximate: str) -> Any:
    """``gelu''(a)``, written with rule-namespace functions only (works for numpy and asyncgrad)."""
    if approximate == "tanh":
        inner = (a + a * a * a * _C) * _K
        t = xp.tanh(inner)
        dinner = (a * a * (3.0 * _C) + 1.0) * _K
        sech2 = 1.0 - t * t
        # d/da [0.5 (1 + t) + 0.5 a sech2 dinner]
        return sech2 * dinner + a * sech2 * (t * dinner * dinner * -1.0 + a * (3.0 * _C * _K))
    pdf = xp.exp(a * a * -0.5) * _INV_SQRT_2PI
    return pdf * (2.0 - a * a)


def _meta(a: Tensor, approximate: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if a._dtype.kind not in "fc":
        raise OpError(f"gelu: input dtype {a._dtype} is not floating point")
    return a._shape, a._dtype


def _gelu_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    (a,) = args
    if xp is NP:
        return (_gelu_grad_kernel(g, a, kw["approximate"]),)
    return (apply(OP_GELU_BACKWARD, (g, a), kw),)


def _bwd_meta(g: Any, a: Any, approximate: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return broadcast_shapes("gelu_backward", tuple(g.shape), tuple(a.shape)), np.result_type(g.dtype, a.dtype)


def _gelu_backward_rule(xp: Any, gg: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    g, a = args
    approx = kw["approximate"]
    dg = da = None
    if needs[0]:
        dg = _gelu_grad_kernel(gg, a, approx) if xp is NP else apply(OP_GELU_BACKWARD, (gg, a), kw)
    if needs[1]:
        da = gg * g * _gelu_second(xp, a, approx)
    return (dg, da)


OP_GELU = defop("gelu", _gelu_kernel, _meta, _gelu_rule)
OP_GELU_BACKWARD = defop("gelu_backward", _gelu_grad_kernel, _bwd_meta, _gelu_backward_rule)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian Error Linear Unit, ``x * Phi(x)``.

    Args:
        x: Input tensor (floating point).
        approximate: ``"none"`` (exact, erf-based; PyTorch's default) or ``"tanh"``.

    Returns:
        A tensor of ``x``'s shape and dtype.
    """
    _check(approximate)
    return apply(OP_GELU, (x,), {"approximate": approximate})


Tensor.gelu = gelu  # type: ignore[attr-defined]
