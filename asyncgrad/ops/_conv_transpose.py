"""1-d convolutions and transposed convolutions, on the 2-d convolution ops.

``conv1d`` is a ``conv2d`` over a height of one. ``conv_transpose2d`` is the adjoint of ``conv2d`` with
respect to its input, which the op table already has as a differentiable op (``conv2d_input_grad``, the
col2im of conv2d's backward): its own rule gives the input's gradient (a ``conv2d``) and the weight's
(``conv2d_weight_grad``), so ``create_graph=True`` works too. The output size is PyTorch's,
``(H - 1) * stride - 2 * padding + dilation * (kH - 1) + output_padding + 1``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..runtime._dispatch import apply
from ..runtime._factories import zeros
from ..runtime._op import OPS, OpError
from ..runtime._tensor import Tensor
from ._conv import conv2d
from ._shape import cat

__all__ = ["conv1d", "conv_transpose1d", "conv_transpose2d", "conv_transpose_output_padding"]


def _tuple(name: str, what: str, v: Any, n: int) -> tuple[int, ...]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return (int(v),) * n
    try:
        if isinstance(v, str):
            raise TypeError
        t = tuple(int(i) for i in v)
    except (TypeError, ValueError):
        raise OpError(f"{name}: {what} must be an int or a tuple of {n} ints, got {v!r}") from None
    if len(t) == 1:
        return t * n
    if len(t) != n:
        raise OpError(f"{name}: {what} must be an int or a tuple of {n} ints, got {v!r}")
    return t


def conv_transpose_output_padding(
    input_size: Sequence[int],
    output_size: Sequence[int],
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> tuple[int, ...]:
    """The ``output_padding`` that gives ``output_size`` (PyTorch's ``ConvTranspose._output_padding``)."""
    out = []
    for i, o, k, s, p, d in zip(input_size, output_size, kernel_size, stride, padding, dilation):
        lo = (i - 1) * s - 2 * p + d * (k - 1) + 1
        if not lo <= o < lo + s:
            raise ValueError(
                f"requested an output size of {tuple(output_size)}, but valid sizes range from {lo} to {lo + s - 1} "
                f"(for an input of {tuple(input_size)})"
            )
        out.append(o - lo)
    return tuple(out)


def conv_transpose2d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    output_padding: Any = 0,
    groups: int = 1,
    dilation: Any = 1,
) -> Tensor:
    """2-d transposed convolution like ``torch.nn.functional.conv_transpose2d``.

    Args:
        input: ``(N, C_in, H, W)`` or unbatched ``(C_in, H, W)``.
        weight: ``(C_in, C_out / groups, kH, kW)``.
        bias: ``(C_out,)`` or None.
        stride: Int or pair.
        padding: Int or pair: ``dilation * (k - 1) - padding`` zeros are added to each side of the input.
        output_padding: Int or pair (each smaller than the stride or the dilation): extra rows and columns
            on the bottom and right of the output.
        groups: Blocked connections from input to output channels.
        dilation: Int or pair.
    """
    name = "conv_transpose2d"
    if not isinstance(input, Tensor) or not isinstance(weight, Tensor):
        raise TypeError(f"{name}: input and weight must be Tensors")
    if input.ndim == 3:
        y = conv_transpose2d(input.unsqueeze(0), weight, bias, stride, padding, output_padding, groups, dilation)
        return y.squeeze(0)
    if input.ndim != 4:
        raise OpError(f"{name}: expected a 3-d (C, H, W) or 4-d (N, C, H, W) input, got shape {input.shape}")
    if weight.ndim != 4:
        raise OpError(f"{name}: expected a 4-d weight (in_channels, out_channels/groups, kH, kW), got {weight.shape}")
    st = _tuple(name, "stride", stride, 2)
    pd = _tuple(name, "padding", padding, 2)
    op = _tuple(name, "output_padding", output_padding, 2)
    dil = _tuple(name, "dilation", dilation, 2)
    n, c, h, w = input.shape
    ci, cog, kh, kw = weight.shape
    g = int(groups)
    if g < 1 or c % g:
        raise OpError(f"{name}: in_channels ({c}) must be divisible by groups ({g})")
    if ci != c:
        raise OpError(
            f"{name}: input of shape {input.shape} has {c} channels but weight of shape {weight.shape} expects {ci} "
            "(weight is (in_channels, out_channels/groups, kH, kW))"
        )
    if min(st) < 1 or min(dil) < 1 or min(pd) < 0 or min(op) < 0:
        raise OpError(f"{name}: stride {st} and dilation {dil} must be positive, padding {pd} non-negative")
    for o, s, d in zip(op, st, dil):
        if o >= s and o >= d:
            raise OpError(
                f"{name}: output padding must be smaller than either stride or dilation, got output_padding={op}, "
                f"stride={st}, dilation={dil}"
            )
    ho = (h - 1) * st[0] - 2 * pd[0] + dil[0] * (kh - 1) + op[0] + 1
    wo = (w - 1) * st[1] - 2 * pd[1] + dil[1] * (kw - 1) + op[1] + 1
    if ho < 1 or wo < 1:
        raise OpError(f"{name}: the output of an input of shape {input.shape} would be empty ({ho} x {wo})")
    co = cog * g
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (co,)):
        raise OpError(f"{name}: bias must be a Tensor of shape ({co},), got {getattr(bias, 'shape', bias)!r}")
    for t in (input, weight, bias):
        if t is not None and t.dtype.kind != "f":
            raise OpError(f"{name}: expected floating point tensors, got dtype {t.dtype}")
    # an output padding below the stride is the adjoint of conv2d on the larger input; one at or above it
    # (stride 1, dilation > 1) would change that conv2d's output size, so those rows are appended as zeros
    # (no input position reaches them)
    direct = tuple(o if o < s else 0 for o, s in zip(op, st))
    extra = tuple(o - d for o, d in zip(op, direct))
    geom = {"stride": st, "padding": (pd[0], pd[0], pd[1], pd[1]), "dilation": dil, "groups": g}
    kw_ = {"x_shape": (n, co, ho - extra[0], wo - extra[1]), "geom": geom, "cl": False}
    y = apply(OPS["conv2d_input_grad"], (input, weight), kw_)
    for dim, e in ((2, extra[0]), (3, extra[1])):
        if e:
            shape = list(y.shape)
            shape[dim] = e
            y = cat([y, zeros(tuple(shape), dtype=y.dtype, device=y.device)], dim)
    if bias is not None:
        y = y + bias.reshape(1, co, 1, 1)
    return y  # type: ignore[no-any-return]


def _height_one(
    fn2d: Callable[..., Tensor], name: str, doc: str, weight_shape: str, *, str_padding: bool
) -> Callable[..., Tensor]:
    """The 1-d form of a 2-d convolution op: the same signature, run over a height of one.

    Each geometry argument gets a height entry (a stride and dilation of 1, a padding and output padding of 0);
    ``str_padding`` lets ``"valid"`` / ``"same"`` through unchanged.
    """
    sig = inspect.signature(fn2d)
    height = {"stride": 1, "padding": 0, "output_padding": 0, "dilation": 1}

    def fn(*args: Any, **kwargs: Any) -> Tensor:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None
        bound.apply_defaults()
        a = bound.arguments
        input, weight = a["input"], a["weight"]
        if not isinstance(input, Tensor) or not isinstance(weight, Tensor):
            raise TypeError(f"{name}: input and weight must be Tensors")
        if input.ndim not in (2, 3) or weight.ndim != 3:
            raise OpError(f"{name}: expected input (N, C, L) or (C, L) and a 3-d weight {weight_shape}, got "
                          f"{input.shape} and {weight.shape}")
        for what, h in height.items():
            if what in a and not (str_padding and what == "padding" and isinstance(a[what], str)):
                a[what] = (h, _tuple(name, what, a[what], 1)[0])
        unbatched = input.ndim == 2
        a["input"] = (input.unsqueeze(0) if unbatched else input).unsqueeze(2)
        a["weight"] = weight.unsqueeze(2)
        y = fn2d(*bound.args, **bound.kwargs).squeeze(2)
        return y.squeeze(0) if unbatched else y

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    fn.__signature__ = sig  # type: ignore[attr-defined]
    return fn


conv1d = _height_one(
    conv2d, "conv1d",
    """1-d convolution like ``torch.nn.functional.conv1d``: input ``(N, C, L)`` or ``(C, L)``, weight
    ``(O, C / groups, K)``; ``padding`` an int, ``"valid"`` or ``"same"``.""",
    "(out_channels, in_channels/groups, kW)", str_padding=True,
)
conv_transpose1d = _height_one(
    conv_transpose2d, "conv_transpose1d",
    """1-d transposed convolution like ``torch.nn.functional.conv_transpose1d``: input ``(N, C_in, L)`` or
    ``(C_in, L)``, weight ``(C_in, C_out / groups, K)``.""",
    "(C_in, C_out/groups, K)", str_padding=False,
)
