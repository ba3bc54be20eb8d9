"""Convolutions and their extras with PyTorch's names, arguments and parameter shapes: Conv1d/2d,
ConvTranspose1d/2d, GroupNorm, AdaptiveAvgPool1d/2d, Upsample (and UpsamplingNearest2d / UpsamplingBilinear2d).

Initialisation is PyTorch's: weights ``kaiming_uniform_(a=sqrt(5))``, biases ``U(-1/sqrt(fan_in),
1/sqrt(fan_in))`` (a transposed convolution's fan-in counts its weight's dim 1, as PyTorch's does), group
norm weights 1 and biases 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..ops import (
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    conv1d,
    conv2d,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose_output_padding,
    group_norm,
    interpolate,
)
from ..runtime import Tensor
from . import init
from ._layers import _add_weight_bias, _init_norm_
from ._module import Module

__all__ = [
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "Conv1d",
    "Conv2d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "GroupNorm",
    "Upsample",
    "UpsamplingBilinear2d",
    "UpsamplingNearest2d",
]


def _init_conv_(weight: Tensor, bias: Tensor | None) -> None:
    """PyTorch's default initialisation of a convolution's parameters (every ``Conv*`` layer's)."""
    init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in, _ = init._calculate_fan_in_and_fan_out(weight)
        if fan_in != 0:
            bound = 1 / math.sqrt(fan_in)
            init.uniform_(bias, -bound, bound)


def _conv_extra_repr(m: Module, defaults: dict[str, tuple[Any, ...]]) -> str:
    """PyTorch's repr of a convolution: channels, kernel size and stride, then each attribute named in
    ``defaults`` that is at none of its default values, then ``groups`` and ``bias=False`` where they apply."""
    s = f"{m.in_channels}, {m.out_channels}, kernel_size={m.kernel_size}, stride={m.stride}"
    for name, values in defaults.items():
        v = getattr(m, name)
        if v not in values:
            s += f", {name}={v}"
    if m.groups != 1:
        s += f", groups={m.groups}"
    if m.bias is None:
        s += ", bias=False"
    return s


_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _check_conv_args(
    in_channels: int, out_channels: int, stride: tuple[int, ...], padding: Any, groups: int, padding_mode: str
) -> None:
    """PyTorch's constructor checks of a convolution, in its order and words (one padding mode: zeros)."""
    if groups <= 0:
        raise ValueError("groups must be a positive integer")
    if in_channels % groups != 0:
        raise ValueError("in_channels must be divisible by groups")
    if out_channels % groups != 0:
        raise ValueError("out_channels must be divisible by groups")
    if isinstance(padding, str):
        if padding not in ("valid", "same"):
            raise ValueError(f"Invalid padding string {padding!r}, should be one of {{'valid', 'same'}}")
        if padding == "same" and any(s != 1 for s in stride):
            raise ValueError("padding='same' is not supported for strided convolutions")
    if padding_mode not in _PADDING_MODES:
        raise ValueError(
            f"padding_mode must be one of {{'zeros', 'reflect', 'replicate', 'circular'}}, but got "
            f"padding_mode={padding_mode!r}"
        )
    if padding_mode != "zeros":
        raise NotImplementedError(f"padding_mode={padding_mode!r} is not supported (only 'zeros')")


def _check_conv_input(input: Tensor, weight: Tensor, groups: int, padding: Any, dilation: Any, nd: int) -> None:
    """PyTorch's errors (its words) for an input a convolution module can't take: its rank, its channels,
    a (padded) size smaller than the dilated kernel."""
    shape = tuple(input.shape)
    if len(shape) not in (nd + 1, nd + 2):
        raise RuntimeError(
            f"Expected {nd + 1}D (unbatched) or {nd + 2}D (batched) input to conv{nd}d, but got input of size: "
            f"{list(shape)}"
        )
    batched = shape if len(shape) == nd + 2 else (1, *shape)
    wshape = tuple(weight.shape)
    want = wshape[1] * groups
    if batched[1] != want:
        raise RuntimeError(
            f"Given groups={groups}, weight of size {list(wshape)}, expected input{list(batched)} to have {want} "
            f"channels, but got {batched[1]} channels instead"
        )
    if not isinstance(padding, str):
        padded = [batched[2 + i] + 2 * padding[i] for i in range(nd)]
        kernel = [dilation[i] * (wshape[2 + i] - 1) + 1 for i in range(nd)]
        if any(p < k for p, k in zip(padded, kernel)):
            raise RuntimeError(
                f"Calculated padded input size per channel: ({' x '.join(map(str, padded))}). Kernel size: "
                f"({' x '.join(map(str, kernel))}). Kernel size can't be greater than actual input size"
            )


def _ntuple(v: Any, n: int, what: str) -> tuple[int, ...]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return (int(v),) * n
    t = tuple(int(i) for i in v)
    if len(t) == 1:
        t = t * n
    if len(t) != n:
        raise ValueError(f"{what} must be an int or a tuple of {n} ints, got {v!r}")
    return t


class _ConvNd(Module):
    """Shared parameters and initialisation of the convolutions and the transposed convolutions."""

    _nd = 1
    _transposed = False

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any,
        padding: Any,
        dilation: Any,
        groups: int,
        bias: bool,
        padding_mode: str,
        output_padding: Any,
        device: Any,
        dtype: Any,
    ) -> None:
        super().__init__()
        cls = type(self).__name__
        nd = self._nd
        if self._transposed:
            if padding_mode != "zeros":  # PyTorch's words
                raise ValueError(f'Only "zeros" padding mode is supported for {cls}')
            if isinstance(padding, str):
                raise ValueError(f"{cls}: padding strings are not supported for transposed convolutions")
        _check_conv_args(in_channels, out_channels, _ntuple(stride, nd, "stride"), padding, groups, padding_mode)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _ntuple(kernel_size, nd, "kernel_size")
        self.stride = _ntuple(stride, nd, "stride")
        self.padding: Any = padding if isinstance(padding, str) else _ntuple(padding, nd, "padding")
        self.dilation = _ntuple(dilation, nd, "dilation")
        self.output_padding = _ntuple(output_padding, nd, "output_padding")
        self.groups = groups
        self.padding_mode = padding_mode
        self.transposed = self._transposed
        if self._transposed:
            shape = (in_channels, out_channels // groups, *self.kernel_size)
        else:
            shape = (out_channels, in_channels // groups, *self.kernel_size)
        _add_weight_bias(self, shape, (out_channels,) if bias else None, dtype, device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's default initialisation."""
        _init_conv_(self.weight, self.bias)

    def extra_repr(self) -> str:
        zeros, ones = (0,) * self._nd, (1,) * self._nd
        return _conv_extra_repr(self, {"padding": (zeros,), "dilation": (ones,), "output_padding": (zeros,)})


class _Conv(_ConvNd):
    """What the convolutions share: PyTorch's constructor and ``forward`` (on the functional of their
    dimension, ``_conv``)."""

    _conv: Any  # the functional, set by each subclass

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] | str = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode, 0,
            device, dtype,
        )

    def forward(self, input: Tensor) -> Tensor:
        _check_conv_input(input, self.weight, self.groups, self.padding, self.dilation, self._nd)
        return self._conv(  # type: ignore[no-any-return]
            input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )


class Conv1d(_Conv):
    """1-d convolution over ``(N, C_in, L)`` inputs (PyTorch's ``Conv1d``, ``padding_mode="zeros"``).

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        kernel_size: Int (or a 1-tuple).
        stride: Default 1.
        padding: Int, ``"valid"`` or ``"same"`` (default 0).
        dilation: Default 1.
        groups: Blocked connections from input to output channels (default 1).
        bias: Learn a bias (default True).
        padding_mode: Only ``"zeros"``.
        device: Device of the parameters.
        dtype: Parameter dtype.
    """

    _nd = 1
    _conv = staticmethod(conv1d)


class Conv2d(_Conv):
    """2-d convolution over ``(N, C_in, H, W)`` inputs (PyTorch's ``Conv2d``, ``padding_mode="zeros"``).

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        kernel_size: Int or (kh, kw).
        stride: Int or pair (default 1).
        padding: Int, pair, ``"valid"`` or ``"same"`` (default 0).
        dilation: Int or pair (default 1).
        groups: Blocked connections from input to output channels (default 1).
        bias: Learn a bias (default True).
        padding_mode: Only ``"zeros"``.
        device: Device of the parameters.
        dtype: Parameter dtype (default float32).
    """

    _nd = 2
    _conv = staticmethod(conv2d)


class _ConvTransposeNd(_ConvNd):
    """What the transposed convolutions share: the constructor, ``output_size`` and ``forward`` (on the
    functional of their dimension, ``_conv``)."""

    _transposed = True
    _conv: Any  # the functional, set by each subclass

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        output_padding: Any = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: Any = 1,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            output_padding, device, dtype,
        )

    def _out_pad(self, input: Tensor, output_size: Sequence[int] | None) -> tuple[int, ...]:
        if output_size is None:
            return self.output_padding
        nd = self._nd
        size = list(output_size)[-nd:]
        if len(size) != nd:
            raise ValueError(f"{type(self).__name__}: output_size must have {nd} or more elements, got {output_size}")
        return conv_transpose_output_padding(
            input.shape[-nd:], size, self.kernel_size, self.stride, self.padding, self.dilation
        )

    def forward(self, input: Tensor, output_size: Sequence[int] | None = None) -> Tensor:
        op = self._out_pad(input, output_size)
        return self._conv(  # type: ignore[no-any-return]
            input, self.weight, self.bias, self.stride, self.padding, op, self.groups, self.dilation
        )


class ConvTranspose2d(_ConvTransposeNd):
    """2-d transposed convolution (PyTorch's ``ConvTranspose2d``); weight ``(C_in, C_out / groups, kH, kW)``.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        kernel_size: Int or pair.
        stride: Int or pair (default 1).
        padding: Int or pair (default 0).
        output_padding: Extra size on one side of the output (default 0).
        groups: Blocked connections (default 1).
        bias: Learn a bias (default True).
        dilation: Int or pair (default 1).
        padding_mode: Only ``"zeros"``.
        device: Device of the parameters.
        dtype: Parameter dtype.

    ``forward(input, output_size=None)``: ``output_size`` picks the output padding that gives that size.
    """

    _nd = 2
    _conv = staticmethod(conv_transpose2d)


class ConvTranspose1d(_ConvTransposeNd):
    """1-d transposed convolution (PyTorch's ``ConvTranspose1d``); weight ``(C_in, C_out / groups, K)``."""

    _nd = 1
    _conv = staticmethod(conv_transpose1d)


class GroupNorm(Module):
    """Group normalisation (PyTorch's ``GroupNorm``): statistics per sample over each group of channels.

    Args:
        num_groups: Groups to split the channels into.
        num_channels: Channels C (divisible by num_groups).
        eps: Added to the variance (default 1e-5).
        affine: Learn per-channel ``weight`` (ones) and ``bias`` (zeros) (default True).
        device: Device of the parameters.
        dtype: Parameter dtype.
    """

    def __init__(
        self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if num_groups <= 0 or num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        shape = (num_channels,) if affine else None
        _add_weight_bias(self, shape, shape, dtype, device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_norm_(self.weight, self.bias)

    def forward(self, input: Tensor) -> Tensor:
        if input.ndim < 2 or input.shape[1] != self.num_channels:
            raise ValueError(
                f"GroupNorm: expected an input (N, {self.num_channels}, *), got shape {tuple(input.shape)}"
            )
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


class _AdaptiveAvgPoolNd(Module):
    """What the adaptive average pools share (PyTorch's ``_AdaptiveAvgPoolNd``): their ``output_size``."""

    def __init__(self, output_size: Any) -> None:
        super().__init__()
        self.output_size = output_size

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class AdaptiveAvgPool2d(_AdaptiveAvgPoolNd):
    """Average pooling to a fixed ``output_size`` (an int or pair; None keeps that dim), PyTorch's bins."""

    def forward(self, input: Tensor) -> Tensor:
        return adaptive_avg_pool2d(input, self.output_size)


class AdaptiveAvgPool1d(_AdaptiveAvgPoolNd):
    """1-d average pooling to a fixed ``output_size``."""

    def forward(self, input: Tensor) -> Tensor:
        return adaptive_avg_pool1d(input, self.output_size)


class Upsample(Module):
    """Resize with `asyncgrad.nn.functional.interpolate` (PyTorch's ``Upsample``).

    Args:
        size: Output spatial size.
        scale_factor: Multiplier of the spatial size.
        mode: ``"nearest"`` (default), ``"nearest-exact"``, ``"linear"``, ``"bilinear"``, ``"trilinear"``.
        align_corners: For the linear modes.
        recompute_scale_factor: As in `interpolate`.
    """

    def __init__(
        self,
        size: Any = None,
        scale_factor: Any = None,
        mode: str = "nearest",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
    ) -> None:
        super().__init__()
        self.size = size
        self.scale_factor = float(scale_factor) if isinstance(scale_factor, (int, float)) else scale_factor
        self.mode = mode
        self.align_corners = align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, input: Tensor) -> Tensor:
        return interpolate(
            input, self.size, self.scale_factor, self.mode, self.align_corners, self.recompute_scale_factor
        )

    def extra_repr(self) -> str:
        if self.scale_factor is not None:
            info = f"scale_factor={self.scale_factor!r}"
        else:
            info = f"size={self.size!r}"
        return f"{info}, mode={self.mode!r}"


class UpsamplingNearest2d(Upsample):
    """2-d nearest upsampling (PyTorch's ``UpsamplingNearest2d``)."""

    def __init__(self, size: Any = None, scale_factor: Any = None) -> None:
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    """2-d bilinear upsampling with ``align_corners=True`` (PyTorch's ``UpsamplingBilinear2d``)."""

    def __init__(self, size: Any = None, scale_factor: Any = None) -> None:
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)
