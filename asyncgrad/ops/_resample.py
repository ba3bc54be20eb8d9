"""Resampling: adaptive average pooling, ``interpolate`` (nearest, nearest-exact, linear, bilinear, trilinear,
area) and group normalisation, with PyTorch's index and weight formulas.

Adaptive average pooling and linear interpolation are separable: along each spatial dim the output is a
fixed ``(out, in)`` matrix times the input, so they run as one BLAS product per dim (``A_h @ x @ A_w^T``)
through the matmul op, whose rule gives exact gradients (and second derivatives). Nearest modes pick
rows and columns with ``index_select``. Group norm is ``layer_norm`` over each group's elements, then the
per-channel affine map.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..runtime._factories import tensor
from ..runtime._op import OpError
from ..runtime._tensor import Tensor
from ._index import index_select
from ._linalg import matmul
from ._nn import layer_norm
from ._shape import movedim

__all__ = ["adaptive_avg_pool1d", "adaptive_avg_pool2d", "group_norm", "interpolate"]


def _along(x: Tensor, dim: int, a: np.ndarray) -> Tensor:
    """``x`` with its ``dim`` (a spatial dim) replaced by ``a @ x`` along it; ``a`` is ``(out, in)``."""
    m = tensor(a.astype(x.dtype, copy=False), dtype=x.dtype, device=x.device)
    if dim == x.ndim - 1:
        return matmul(x, m.transpose(0, 1))  # type: ignore[no-any-return]
    if dim == x.ndim - 2:
        return matmul(m, x)  # type: ignore[no-any-return]
    return movedim(matmul(movedim(x, dim, -1), m.transpose(0, 1)), -1, dim)  # type: ignore[no-any-return]


# ---- adaptive average pooling --------------------------------------------------------------------


def _adaptive_matrix(n_in: int, n_out: int) -> np.ndarray:
    """Row o averages inputs floor(o * in / out) .. ceil((o + 1) * in / out) - 1 (PyTorch's bins)."""
    a = np.zeros((n_out, n_in))
    for o in range(n_out):
        s = (o * n_in) // n_out
        e = ((o + 1) * n_in + n_out - 1) // n_out
        a[o, s:e] = 1.0 / (e - s)
    return a


def _adaptive(name: str, x: Tensor, output_size: Any, nd: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: input must be a Tensor, got {type(x).__name__}")
    if x.ndim not in (nd + 1, nd + 2):
        raise OpError(f"{name}: expected a {nd + 1}-d or {nd + 2}-d input, got shape {x.shape}")
    if x.dtype.kind != "f":
        raise OpError(f"{name}: expected a floating point input, got dtype {x.dtype}")
    sizes = list(output_size) if isinstance(output_size, (tuple, list)) else [output_size] * nd
    if len(sizes) != nd:
        raise OpError(f"{name}: output_size must be an int or {nd} ints (or None), got {output_size!r}")
    spatial = x.shape[-nd:]
    out = x
    for k, (n_in, o) in enumerate(zip(spatial, sizes)):
        o = n_in if o is None else int(o)
        if o < 1 or n_in < 1:
            raise OpError(f"{name}: output_size {tuple(sizes)} and input {x.shape} must have positive sizes")
        if o != n_in:
            out = _along(out, x.ndim - nd + k, _adaptive_matrix(n_in, o))
    if out is x:
        out = x * 1.0  # a new tensor, as PyTorch's
    return out


def adaptive_avg_pool2d(input: Tensor, output_size: Any) -> Tensor:
    """Average over adaptive bins to ``output_size`` (an int or a pair; None keeps that dim), like PyTorch's."""
    return _adaptive("adaptive_avg_pool2d", input, output_size, 2)


def adaptive_avg_pool1d(input: Tensor, output_size: Any) -> Tensor:
    """1-d adaptive average pooling of ``(N, C, L)`` or ``(C, L)``."""
    return _adaptive("adaptive_avg_pool1d", input, output_size, 1)


# ---- interpolate ---------------------------------------------------------------------------------


def _linear_matrix(n_in: int, n_out: int, align_corners: bool, scale: float | None) -> np.ndarray:
    """PyTorch's ``area_pixel_compute_source_index`` weights as an (out, in) matrix."""
    if align_corners:
        ratio = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    else:
        ratio = 1.0 / scale if scale is not None and scale > 0 else n_in / n_out
    a = np.zeros((n_out, n_in))
    for o in range(n_out):
        src = ratio * o if align_corners else max(ratio * (o + 0.5) - 0.5, 0.0)
        i0 = int(src)
        l1 = src - i0
        i1 = i0 + (1 if i0 < n_in - 1 else 0)
        a[o, i0] += 1.0 - l1
        a[o, i1] += l1
    return a


def _nearest_index(n_in: int, n_out: int, scale: float | None, exact: bool) -> np.ndarray:
    """PyTorch's nearest source indices (computed in float32, as its kernels do)."""
    if n_out == n_in:
        return np.arange(n_out)
    if not exact and n_out == 2 * n_in:
        return np.arange(n_out) >> 1
    r = np.float32(1.0 / scale) if scale is not None and scale > 0 else np.float32(n_in) / np.float32(n_out)
    o = np.arange(n_out, dtype=np.float32)
    src = np.floor((o + np.float32(0.5)) * r if exact else o * r)
    return np.minimum(src.astype(np.int64), n_in - 1)


_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}


def interpolate(
    input: Tensor,
    size: Any = None,
    scale_factor: Any = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Tensor:
    """Resize ``input`` like ``torch.nn.functional.interpolate``.

    Args:
        input: ``(N, C, *spatial)`` with 1, 2 or 3 spatial dims.
        size: Output spatial size (an int or one per dim).
        scale_factor: Multiplier of the spatial size (a number or one per dim); give ``size`` or this.
        mode: ``"nearest"``, ``"nearest-exact"``, ``"linear"`` (3-d input), ``"bilinear"`` (4-d),
            ``"trilinear"`` (5-d) or ``"area"`` (adaptive average pooling).
        align_corners: For the linear modes: map the corner pixels' centres onto each other (default False).
        recompute_scale_factor: Compute the sampling scale from the output size instead of using
            ``scale_factor`` itself.
        antialias: Must be False.
    """
    name = "interpolate"
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}: input must be a Tensor, got {type(input).__name__}")
    nd = input.ndim - 2
    if nd not in (1, 2, 3):
        raise OpError(f"{name}: expected a 3-d, 4-d or 5-d input (N, C, *spatial), got shape {input.shape}")
    if mode not in ("nearest", "nearest-exact", "area", *_LINEAR):
        raise NotImplementedError(
            f"{name}: mode {mode!r} is not supported; use nearest, nearest-exact, linear, bilinear, trilinear or area"
        )
    if mode in _LINEAR and _LINEAR[mode] != nd:
        raise NotImplementedError(
            f"{name}: mode {mode!r} needs a {_LINEAR[mode] + 2}-d input, got a {input.ndim}-d input of shape "
            f"{input.shape}"
        )
    if align_corners is not None and mode not in _LINEAR:
        raise ValueError(
            "align_corners option can only be set with the interpolating modes: linear | bilinear | bicubic | trilinear"
        )
    if antialias:
        raise NotImplementedError(f"{name}: antialias=True is not supported")
    if input.dtype.kind != "f":
        raise OpError(f"{name}: expected a floating point input, got dtype {input.dtype}")
    if (size is None) == (scale_factor is None):
        raise ValueError(f"{name}: only one of size or scale_factor should be defined")
    spatial = input.shape[2:]
    scales: list[float | None]
    if size is not None:
        sizes = list(size) if isinstance(size, Sequence) else [size] * nd
        if len(sizes) != nd:
            raise ValueError(
                f"{name}: Input and output must have the same number of spatial dimensions, but got input with "
                f"spatial dimensions of {list(spatial)} and output size of {sizes}"
            )
        outs = [int(s) for s in sizes]
        scales = [None] * nd
    else:
        sf = list(scale_factor) if isinstance(scale_factor, Sequence) else [scale_factor] * nd
        if len(sf) != nd:
            raise ValueError(f"{name}: scale_factor must be a number or {nd} numbers, got {scale_factor!r}")
        outs = [math.floor(n * float(s)) for n, s in zip(spatial, sf)]
        scales = [None if recompute_scale_factor else float(s) for s in sf]
    if min(outs) < 1:
        raise OpError(f"{name}: the output size {tuple(outs)} must be positive (input {input.shape})")
    if mode == "area":
        return _adaptive(name, input, outs, nd)
    out = input
    for k, (n_in, n_out, sc) in enumerate(zip(spatial, outs, scales)):
        dim = 2 + k
        if mode in _LINEAR:
            if n_in == n_out and (align_corners or sc is None or sc == 1.0):
                continue
            out = _along(out, dim, _linear_matrix(n_in, n_out, bool(align_corners), sc))
        else:
            idx = _nearest_index(n_in, n_out, sc, mode == "nearest-exact")
            if n_in == n_out and np.array_equal(idx, np.arange(n_in)):
                continue
            out = index_select(out, dim, idx)
    if out is input:
        out = input * 1.0
    return out


# ---- group norm ---------------------------------------------------------------------------------


def group_norm(
    input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """Normalise each group of ``C / num_groups`` channels (with everything after them) per sample, then
    scale and shift per channel, like ``torch.nn.functional.group_norm``."""
    name = "group_norm"
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}: input must be a Tensor, got {type(input).__name__}")
    if input.ndim < 2:
        raise OpError(f"{name}: expected an input of at least 2 dims (N, C, *), got shape {input.shape}")
    n, c = input.shape[:2]
    if num_groups < 1 or c % num_groups:
        raise OpError(
            f"{name}: Expected number of channels in input to be divisible by num_groups, but got input of shape "
            f"{input.shape} and num_groups={num_groups}"
        )
    for what, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (c,):
            raise OpError(f"{name}: expected {what} of shape ({c},), got {tuple(t.shape)}")
    m = math.prod(input.shape[1:]) // num_groups
    y = layer_norm(input.reshape(n, num_groups, m), (m,), None, None, eps).reshape(input.shape)
    shape = (1, c) + (1,) * (input.ndim - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y  # type: ignore[no-any-return]
