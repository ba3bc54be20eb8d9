"""More shape ops with PyTorch's names and semantics.

chunk, split, unbind, narrow, flip, roll, movedim/moveaxis, swapaxes/swapdims, unflatten, repeat (PyTorch's,
numpy's ``tile``), repeat_interleave, tril/triu, diag, trace.

Most are compositions of differentiable views (slicing, permute, reshape, broadcast_to, index_add), so their
gradients and second derivatives come from those; tril/triu are ops of their own (a masked copy).
"""

from __future__ import annotations

import builtins
import math
from typing import Any

import numpy as np

from . import _ops_shape as S
from ._dispatch import OpError, apply, defop, norm_dim
from ._tensor import Tensor


def _dims(op: str, x: Tensor, dims: Any) -> tuple[int, ...]:
    ds = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    out = tuple(norm_dim(op, x, d) for d in ds)
    if len(set(out)) != len(out):
        raise OpError(f"{op}: dims {tuple(ds)} repeat a dimension of shape {tuple(x.shape)}")
    return out


def _slice(x: Tensor, dim: int, start: int, stop: int) -> Tensor:
    return x[(slice(None),) * dim + (slice(start, stop),)]


def _need_dims(op: str, x: Tensor) -> None:
    if x.ndim == 0:
        raise OpError(f"{op}: expected a tensor with at least 1 dimension, got a 0-d tensor")


# ---- split, chunk, unbind, narrow -------------------------------------------------------------------------


def split(tensor: Tensor, split_size_or_sections: Any, dim: int = 0) -> tuple[Tensor, ...]:
    """Split into pieces of ``split_size_or_sections`` along ``dim`` (the last may be smaller), or into
    pieces of the given sizes when it is a list; like ``torch.split`` (pieces are views)."""
    _need_dims("split", tensor)
    d = norm_dim("split", tensor, dim)
    n = tensor.shape[d]
    s = split_size_or_sections
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool):
        if s < 0 or (s == 0 and n != 0):
            raise OpError(f"split: split_size must be positive, got {s} for dim {d} of size {n}")
        if n == 0:
            return (tensor,)
        sizes = [builtins.min(s, n - i) for i in range(0, n, s)]
    else:
        sizes = [int(v) for v in s]
        if builtins.any(v < 0 for v in sizes) or builtins.sum(sizes) != n:
            raise OpError(
                f"split: sizes {sizes} must be non-negative and sum to the size {n} of dim {d} "
                f"(tensor of shape {tuple(tensor.shape)})"
            )
    out = []
    start = 0
    for v in sizes:
        out.append(_slice(tensor, d, start, start + v))
        start += v
    return tuple(out)


def chunk(input: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    """Split into ``chunks`` pieces of size ``ceil(n / chunks)`` along ``dim`` (fewer when they run out),
    like ``torch.chunk``."""
    if not isinstance(chunks, (int, np.integer)) or chunks <= 0:
        raise OpError(f"chunk: chunks must be a positive int, got {chunks!r}")
    _need_dims("chunk", input)
    d = norm_dim("chunk", input, dim)
    n = input.shape[d]
    if n == 0:
        return tuple(_slice(input, d, 0, 0) for _ in range(int(chunks)))
    return split(input, -(-n // int(chunks)), d)


def unbind(input: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    """The slices along ``dim``, with that dim removed, like ``torch.unbind``."""
    _need_dims("unbind", input)
    d = norm_dim("unbind", input, dim)
    return tuple(input[(slice(None),) * d + (i,)] for i in range(input.shape[d]))


def narrow(input: Tensor, dim: int, start: int, length: int) -> Tensor:
    """``length`` entries of ``dim`` from ``start`` (negative counts from the end): a view."""
    _need_dims("narrow", input)
    d = norm_dim("narrow", input, dim)
    n = input.shape[d]
    start, length = int(start), int(length)
    if not -n <= start <= n:
        raise OpError(f"narrow: start {start} is out of range for dim {d} of size {n}")
    if start < 0:
        start += n
    if length < 0 or start + length > n:
        raise OpError(
            f"narrow: start ({start}) + length ({length}) exceeds the size {n} of dim {d} "
            f"(tensor of shape {tuple(input.shape)})"
        )
    return _slice(input, d, start, start + length)


# ---- flip, roll ---------------------------------------------------------------------------------------------


def flip(input: Tensor, *dims: Any) -> Tensor:
    """Reverse the order of entries along ``dims`` (``flip(x, (0, 1))`` or ``x.flip(0, 1)``)."""
    ds = dims[0] if len(dims) == 1 else dims
    if input.ndim == 0:
        _dims("flip", input, ds)
        return input[()]
    axes = _dims("flip", input, ds)
    idx = [slice(None)] * input.ndim
    for d in axes:
        idx[d] = slice(None, None, -1)
    return input[tuple(idx)]


def fliplr(input: Tensor) -> Tensor:
    """Reverse the columns (dim 1) of a tensor of at least 2 dims."""
    if input.ndim < 2:
        raise OpError(f"fliplr: expected a tensor of at least 2 dims, got shape {tuple(input.shape)}")
    return flip(input, 1)


def flipud(input: Tensor) -> Tensor:
    """Reverse the rows (dim 0) of a tensor of at least 1 dim."""
    _need_dims("flipud", input)
    return flip(input, 0)


def roll(input: Tensor, shifts: Any, dims: Any = None) -> Tensor:
    """Shift entries cyclically by ``shifts`` along ``dims`` (the flattened tensor when None)."""
    if dims is None:
        sh = (shifts,) if isinstance(shifts, (int, np.integer)) else tuple(shifts)
        if len(sh) != 1:
            raise OpError(f"roll: without dims, shifts must be one int, got {shifts!r}")
        return S.reshape(roll(S.reshape(input, (-1,)), sh[0], 0), tuple(input.shape))
    shs = (shifts,) if isinstance(shifts, (int, np.integer)) else tuple(shifts)
    ds = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    if len(shs) != len(ds):
        raise OpError(f"roll: shifts {shifts!r} and dims {dims!r} must have the same length")
    out = input
    for s, d in zip(shs, ds):
        d = norm_dim("roll", input, d)
        n = input.shape[d] if input.ndim else 1
        if n == 0 or input.ndim == 0:
            continue
        s = int(s) % n
        if s:
            out = S.concat([_slice(out, d, n - s, n), _slice(out, d, 0, n - s)], d)
    return out


# ---- dimension moves, unflatten ----------------------------------------------------------------------------


def movedim(input: Tensor, source: Any, destination: Any) -> Tensor:
    """Move dims ``source`` to positions ``destination`` (ints or sequences), keeping the others' order."""
    src = _dims("movedim", input, source)
    dst = _dims("movedim", input, destination)
    if len(src) != len(dst):
        raise OpError(f"movedim: source {source!r} and destination {destination!r} must have the same length")
    order = [i for i in range(input.ndim) if i not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return S.permute(input, tuple(order))


moveaxis = movedim


def swapaxes(input: Tensor, axis0: int, axis1: int) -> Tensor:
    """Swap two dims (a view): ``transpose``'s numpy name."""
    return S.transpose(input, axis0, axis1)


swapdims = swapaxes


def unflatten(input: Tensor, dim: int, sizes: Any) -> Tensor:
    """Expand dim ``dim`` into ``sizes`` (one may be -1), like ``torch.unflatten``."""
    _need_dims("unflatten", input)
    d = norm_dim("unflatten", input, dim)
    sz = tuple(int(s) for s in sizes)
    if not sz:
        raise OpError("unflatten: sizes must be non-empty")
    n = input.shape[d]
    known = math.prod(s for s in sz if s != -1)
    if sz.count(-1) > 1 or (-1 in sz and (known == 0 or n % known)) or (-1 not in sz and known != n):
        raise OpError(
            f"unflatten: sizes {sz} do not multiply to the size {n} of dim {d} (shape {tuple(input.shape)}); "
            "use at most one -1"
        )
    return S.reshape(input, (*input.shape[:d], *sz, *input.shape[d + 1 :]))


# ---- repeat, repeat_interleave ------------------------------------------------------------------------------


def repeat(input: Tensor, *sizes: Any) -> Tensor:
    """Tile ``input`` ``sizes[i]`` times along each dim (PyTorch's ``repeat``, numpy's ``tile``)."""
    reps = S._shape_arg(sizes)
    if len(reps) < input.ndim:
        raise OpError(
            f"repeat: got {len(reps)} repeat sizes {reps} for a tensor of {input.ndim} dims "
            f"(shape {tuple(input.shape)}); give at least one per dim"
        )
    if builtins.any(r < 0 for r in reps):
        raise OpError(f"repeat: repeat sizes must be non-negative, got {reps}")
    shape = (1,) * (len(reps) - input.ndim) + tuple(input.shape)
    y = S.reshape(input, tuple(v for n in shape for v in (1, n)))
    y = S.broadcast_to(y, tuple(v for r, n in zip(reps, shape) for v in (r, n)))
    return S.reshape(y, tuple(r * n for r, n in zip(reps, shape)))


def repeat_interleave(input: Tensor, repeats: Any, dim: Any = None, *, output_size: Any = None) -> Tensor:
    """Repeat each entry ``repeats`` times along ``dim`` (flattened when None), like
    ``torch.repeat_interleave``; ``repeats`` is an int, or one count per entry (list or int tensor)."""
    x = S.reshape(input, (-1,)) if dim is None else input
    if x.ndim == 0:
        x = S.reshape(x, (1,))
    d = norm_dim("repeat_interleave", x, 0 if dim is None else dim)
    n = x.shape[d]
    if isinstance(repeats, Tensor):
        repeats = repeats._value()
    if isinstance(repeats, (int, np.integer)) or (isinstance(repeats, np.ndarray) and repeats.size == 1):
        r = int(np.asarray(repeats).reshape(()))
        if r < 0:
            raise OpError(f"repeat_interleave: repeats must be non-negative, got {r}")
        y = S.broadcast_to(S.expand_dims(x, d + 1), (*x.shape[: d + 1], r, *x.shape[d + 1 :]))
        out = S.reshape(y, (*x.shape[:d], n * r, *x.shape[d + 1 :]))
    else:
        reps = np.asarray(repeats)
        if reps.dtype.kind not in "iu" or reps.shape != (n,) or (reps < 0).any():
            raise OpError(
                f"repeat_interleave: repeats must be non-negative integers, one per entry of dim {d} "
                f"(size {n}), got {reps.dtype} of shape {reps.shape}"
            )
        from ._ops_nn2 import index_select

        out = index_select(x, d, np.repeat(np.arange(n), reps))
    if output_size is not None and out.shape[d] != output_size:
        raise OpError(f"repeat_interleave: output_size {output_size} does not match the result size {out.shape[d]}")
    return out


# ---- tril, triu ---------------------------------------------------------------------------------------------


def _tri_meta(a: Tensor, k: int) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return tuple(a.shape), a.dtype


def _tri_mask(shape: tuple[int, ...], k: int, lower: bool) -> np.ndarray:
    m = np.ones(shape[-2:], dtype=bool)
    return np.tril(m, k) if lower else np.triu(m, k)


def _tri_rule(lower: bool) -> Any:
    def rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
        return (xp.where(xp.const(_tri_mask(tuple(g.shape), kw["k"], lower), g), g, 0),)

    return rule


OP_TRIL = defop("tril", lambda a, k: np.tril(a, k), _tri_meta, _tri_rule(True))
OP_TRIU = defop("triu", lambda a, k: np.triu(a, k), _tri_meta, _tri_rule(False))


def _tri_check(op: str, x: Tensor) -> None:
    if x.ndim < 2:
        raise OpError(f"{op}: expected a tensor of at least 2 dims (matrices in the last two), got {tuple(x.shape)}")


def tril(input: Tensor, diagonal: int = 0) -> Tensor:
    """The lower triangle (on and below diagonal ``diagonal``) of the last two dims; the rest is 0."""
    _tri_check("tril", input)
    return apply(OP_TRIL, (input,), {"k": int(diagonal)})


def triu(input: Tensor, diagonal: int = 0) -> Tensor:
    """The upper triangle (on and above diagonal ``diagonal``) of the last two dims; the rest is 0."""
    _tri_check("triu", input)
    return apply(OP_TRIU, (input,), {"k": int(diagonal)})


# ---- diag, trace -------------------------------------------------------------------------------------------


def _diag_index(rows: int, cols: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column indices of diagonal ``k`` of a rows x cols matrix."""
    r0, c0 = builtins.max(-k, 0), builtins.max(k, 0)
    n = builtins.max(0, builtins.min(rows - r0, cols - c0))
    return np.arange(r0, r0 + n), np.arange(c0, c0 + n)


def diag(input: Tensor, diagonal: int = 0) -> Tensor:
    """1-D input: a square matrix with it on diagonal ``diagonal``; 2-D input: that diagonal, as 1-D."""
    k = int(diagonal)
    if input.ndim == 1:
        n = input.shape[0]
        m = n + builtins.abs(k)
        return S.index_add((m, m), _diag_index(m, m, k), input)
    if input.ndim == 2:
        return S.getitem(input, _diag_index(input.shape[0], input.shape[1], k))
    raise OpError(f"diag: expected a 1-D or 2-D tensor, got shape {tuple(input.shape)}")


def trace(input: Tensor) -> Tensor:
    """The sum of the main diagonal of a 2-D tensor."""
    if input.ndim != 2:
        raise OpError(f"trace: expected a 2-D tensor, got shape {tuple(input.shape)}")
    return diag(input).sum()


def _install() -> None:
    T = Tensor
    for f in (
        split, chunk, unbind, narrow, flip, fliplr, flipud, roll, movedim, swapaxes, unflatten, repeat,
        repeat_interleave, tril, triu, diag, trace,
    ):
        setattr(T, f.__name__, f)
    T.moveaxis = movedim  # type: ignore[attr-defined]
    T.swapdims = swapaxes  # type: ignore[attr-defined]


_install()
