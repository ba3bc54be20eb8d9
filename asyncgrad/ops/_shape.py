"""Shape ops: views and rearrangements (reshape, transpose, permute, broadcast, concat, stack, indexing)."""

from __future__ import annotations

import builtins
import math
from typing import Any

import numpy as np

from ..runtime._dispatch import apply
from ..runtime._meta import norm_dim
from ..runtime._op import OpError, defop
from ..runtime._promote import result_type
from ..runtime._tensor import Tensor
from ..runtime._xp import register_xp
from ._index import getitem, index_add, index_select

# Kernels and rules call the array's method: np.reshape / np.swapaxes / np.transpose go through two Python
# frames each (the dispatcher and `_wrapfunc`), ~0.5 us a call more; a char GPT step's rules make ~90 such
# calls. Anything else (a numpy scalar, a list) takes numpy's function.


def _np_reshape(a: Any, shape: Any) -> Any:
    return a.reshape(shape) if type(a) is np.ndarray else np.reshape(a, shape)


def _np_swapaxes(a: Any, i: int, j: int) -> Any:
    return a.swapaxes(i, j) if type(a) is np.ndarray else np.swapaxes(a, i, j)


def _np_transpose(a: Any, axes: Any = None) -> Any:
    return a.transpose(axes) if type(a) is np.ndarray else np.transpose(a, axes)


def _shape_arg(shape: Any) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    return tuple(int(s) for s in shape)


# ---- reshape ----------------------------------------------------------------------------------------


def _reshape_meta(a: Tensor, shape: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype[Any]]:
    n = a.numel()
    if shape.count(-1) > 1:
        raise OpError(f"reshape: only one dimension can be -1, got shape {shape}")
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        if rest == 0 or n % rest:
            raise OpError(f"reshape: shape {shape} is invalid for input of shape {a._shape} ({n} elements)")
        shape = tuple(n // rest if s == -1 else s for s in shape)
    if math.prod(shape) != n:
        raise OpError(f"reshape: shape {shape} is invalid for input of shape {a._shape} ({n} elements)")
    return shape, a._dtype


def _reshape_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (xp.reshape(g, args[0].shape),)


OP_RESHAPE = defop("reshape", _np_reshape, _reshape_meta, _reshape_rule, saves=(), view=True)


def reshape(x: Tensor, *shape: Any) -> Tensor:
    """A tensor with the same elements in ``shape`` (a view when possible); one dim may be -1."""
    shp = _shape_arg(shape)
    return apply(OP_RESHAPE, (x,), {"shape": shp})


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Flatten dims ``start_dim..end_dim`` into one."""
    n = x.ndim
    if n == 0:
        return reshape(x, (1,))
    s, e = start_dim % n, end_dim % n
    shp = (*x._shape[:s], math.prod(x._shape[s : e + 1]), *x._shape[e + 1 :])
    return reshape(x, shp)


# ---- permutations -----------------------------------------------------------------------------------


def _perm_meta(a: Tensor, axes: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if sorted(axes) != list(range(a.ndim)):
        raise OpError(f"permute: dims {axes} are not a permutation of the {a.ndim} dims of shape {a._shape}")
    return tuple(a._shape[i] for i in axes), a._dtype


def _perm_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    axes = kw["axes"]
    inv = [0] * len(axes)
    for i, a in enumerate(axes):  # the inverse permutation (np.argsort's, without its ~2 us a call)
        inv[a] = i
    return (xp.transpose(g, tuple(inv)),)


OP_PERMUTE = defop("permute", _np_transpose, _perm_meta, _perm_rule, saves=(), view=True)


def permute(x: Tensor, *dims: Any) -> Tensor:
    """Reorder dimensions (a view)."""
    d = _shape_arg(dims)
    n = max(x.ndim, 1)
    return apply(OP_PERMUTE, (x,), {"axes": tuple(i % n for i in d)})


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    """Swap two dimensions (a view)."""
    n = x.ndim
    if not (-n <= dim0 < n and -n <= dim1 < n):
        raise OpError(f"transpose: dims ({dim0}, {dim1}) are out of range for shape {x._shape}")
    axes = list(range(n))
    axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
    return apply(OP_PERMUTE, (x,), {"axes": tuple(axes)})


def _T(x: Tensor) -> Tensor:
    return apply(OP_PERMUTE, (x,), {"axes": tuple(reversed(range(x.ndim)))})


# ---- broadcasting, unsqueeze, squeeze --------------------------------------------------------------


def _bto_meta(a: Tensor, shape: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype[Any]]:
    try:
        ok = np.broadcast_shapes(a._shape, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise OpError(f"broadcast_to: cannot broadcast shape {a._shape} to {shape}")
    return shape, a._dtype


def _bto_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g,)  # the engine sums it back to the input shape


OP_BROADCAST_TO = defop(
    "broadcast_to", lambda a, shape: np.broadcast_to(a, shape), _bto_meta, _bto_rule, saves=(), view=True
)


def broadcast_to(x: Tensor, *shape: Any) -> Tensor:
    """A broadcast (stride 0) view of ``x`` with ``shape``."""
    return apply(OP_BROADCAST_TO, (x,), {"shape": _shape_arg(shape)})


def expand(x: Tensor, *sizes: Any) -> Tensor:
    """PyTorch's expand: like broadcast_to, with -1 meaning 'keep this size'."""
    shp = _shape_arg(sizes)
    lead = len(shp) - x.ndim
    shp = tuple(x._shape[i - lead] if s == -1 and i >= lead else s for i, s in enumerate(shp))
    return broadcast_to(x, shp)


def _unsq_meta(a: Tensor, axis: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return _unsq_shape(a._shape, axis), a._dtype


def _unsq_shape(shape: tuple[int, ...], axis: tuple[int, ...]) -> tuple[int, ...]:
    out = list(shape)
    for ax in sorted(axis):
        out.insert(ax, 1)
    return tuple(out)


def _unsq_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (xp.reshape(g, args[0].shape),)


OP_EXPAND_DIMS = defop(
    "unsqueeze", lambda a, axis: np.expand_dims(a, axis), _unsq_meta, _unsq_rule, saves=(), view=True
)


def expand_dims(x: Tensor, axis: Any) -> Tensor:
    """Insert size-1 dims at ``axis`` (int or tuple of positions in the result)."""
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    n = x.ndim + len(axes)
    return apply(OP_EXPAND_DIMS, (x,), {"axis": tuple(int(a) % n for a in axes)})


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    """Insert a size-1 dim at ``dim``."""
    return expand_dims(x, dim)


def squeeze(x: Tensor, dim: Any = None) -> Tensor:
    """Remove size-1 dims (all, or only ``dim``)."""
    if dim is None:
        shp = tuple(s for s in x._shape if s != 1)
    else:
        dims = {d % max(x.ndim, 1) for d in ((dim,) if isinstance(dim, int) else dim)}
        shp = tuple(s for i, s in enumerate(x._shape) if not (i in dims and s == 1))
    return reshape(x, shp)


# ---- concat and stack -------------------------------------------------------------------------------


def _concat_meta(*xs: Tensor, axis: int) -> tuple[tuple[int, ...], np.dtype[Any]]:
    first = xs[0]._shape
    for t in xs[1:]:
        if len(t._shape) != len(first) or any(
            i != axis and a != b for i, (a, b) in enumerate(zip(first, t._shape))
        ):
            raise OpError(
                f"concat: tensors must match in every dim but {axis}, got shapes {[x._shape for x in xs]}"
            )
    shape = list(first)
    shape[axis] = sum(t._shape[axis] for t in xs)
    # PyTorch's promotion (an int64 and a float32 tensor join as float32; numpy would give float64)
    return tuple(shape), result_type(*xs)


def _concat_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    axis = kw["axis"]
    grads = []
    start = 0
    for a, need in zip(args, needs):
        n = a.shape[axis]
        if need:
            grads.append(g[(slice(None),) * axis + (slice(start, start + n),)])
        else:
            grads.append(None)
        start += n
    return tuple(grads)


OP_CONCAT = defop("concat", lambda *a, axis: np.concatenate(a, axis=axis), _concat_meta, _concat_rule, saves=())


def _seq_check(op: str, tensors: Any) -> list[Tensor]:
    ts = list(tensors)
    if not ts:
        raise OpError(f"{op}: expected a non-empty sequence of tensors")
    for t in ts:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: expected a sequence of Tensors, got an element of type {type(t).__name__}")
    return ts


def concat(tensors: Any, dim: int = 0) -> Tensor:
    """Join tensors along an existing dimension."""
    ts = _seq_check("concat", tensors)
    n = ts[0].ndim
    if not -n <= dim < n:
        raise OpError(f"concat: dim {dim} is out of range for tensors of {n} dims")
    return apply(OP_CONCAT, tuple(ts), {"axis": dim % n})


cat = concat


def stack(tensors: Any, dim: int = 0) -> Tensor:
    """Join tensors along a new dimension."""
    ts = _seq_check("stack", tensors)
    shapes = {t._shape for t in ts}
    if len(shapes) != 1:
        raise OpError(f"stack: all tensors must have the same shape, got {[t._shape for t in ts]}")
    n = ts[0].ndim + 1
    if not -n <= dim < n:
        raise OpError(f"stack: dim {dim} is out of range for a result of {n} dims")
    d = dim % n
    return concat([expand_dims(t, d) for t in ts], d)


# ---- indexing ----------------------------------------------------------------------------------------


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
        return reshape(roll(reshape(input, (-1,)), sh[0], 0), tuple(input.shape))
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
            out = concat([_slice(out, d, n - s, n), _slice(out, d, 0, n - s)], d)
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
    return permute(input, tuple(order))


moveaxis = movedim


def swapaxes(input: Tensor, axis0: int, axis1: int) -> Tensor:
    """Swap two dims (a view): ``transpose``'s numpy name."""
    return transpose(input, axis0, axis1)


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
    return reshape(input, (*input.shape[:d], *sz, *input.shape[d + 1 :]))


# ---- repeat, repeat_interleave ------------------------------------------------------------------------------


def repeat(input: Tensor, *sizes: Any) -> Tensor:
    """Tile ``input`` ``sizes[i]`` times along each dim (PyTorch's ``repeat``, numpy's ``tile``)."""
    reps = _shape_arg(sizes)
    if len(reps) < input.ndim:
        raise OpError(
            f"repeat: got {len(reps)} repeat sizes {reps} for a tensor of {input.ndim} dims "
            f"(shape {tuple(input.shape)}); give at least one per dim"
        )
    if builtins.any(r < 0 for r in reps):
        raise OpError(f"repeat: repeat sizes must be non-negative, got {reps}")
    shape = (1,) * (len(reps) - input.ndim) + tuple(input.shape)
    y = reshape(input, tuple(v for n in shape for v in (1, n)))
    y = broadcast_to(y, tuple(v for r, n in zip(reps, shape) for v in (r, n)))
    return reshape(y, tuple(r * n for r, n in zip(reps, shape)))


def repeat_interleave(input: Tensor, repeats: Any, dim: Any = None, *, output_size: Any = None) -> Tensor:
    """Repeat each entry ``repeats`` times along ``dim`` (flattened when None), like
    ``torch.repeat_interleave``; ``repeats`` is an int, or one count per entry (list or int tensor)."""
    x = reshape(input, (-1,)) if dim is None else input
    if x.ndim == 0:
        x = reshape(x, (1,))
    d = norm_dim("repeat_interleave", x, 0 if dim is None else dim)
    n = x.shape[d]
    if isinstance(repeats, Tensor):
        repeats = repeats._value()
    if isinstance(repeats, (int, np.integer)) or (isinstance(repeats, np.ndarray) and repeats.size == 1):
        r = int(np.asarray(repeats).reshape(()))
        if r < 0:
            raise OpError(f"repeat_interleave: repeats must be non-negative, got {r}")
        y = broadcast_to(expand_dims(x, d + 1), (*x.shape[: d + 1], r, *x.shape[d + 1 :]))
        out = reshape(y, (*x.shape[:d], n * r, *x.shape[d + 1 :]))
    else:
        reps = np.asarray(repeats)
        if reps.dtype.kind not in "iu" or reps.shape != (n,) or (reps < 0).any():
            raise OpError(
                f"repeat_interleave: repeats must be non-negative integers, one per entry of dim {d} "
                f"(size {n}), got {reps.dtype} of shape {reps.shape}"
            )

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
        return index_add((m, m), _diag_index(m, m, k), input)
    if input.ndim == 2:
        return getitem(input, _diag_index(input.shape[0], input.shape[1], k))
    raise OpError(f"diag: expected a 1-D or 2-D tensor, got shape {tuple(input.shape)}")


def trace(input: Tensor) -> Tensor:
    """The sum of the main diagonal of a 2-D tensor."""
    if input.ndim != 2:
        raise OpError(f"trace: expected a 2-D tensor, got shape {tuple(input.shape)}")
    return diag(input).sum()


# the rule namespaces' shape functions (see `runtime._xp`)
register_xp("swapaxes", _np_swapaxes, lambda x, i, j: transpose(x, i, j))
register_xp("transpose", _np_transpose, permute)
register_xp("expand_dims", np.expand_dims, expand_dims)
register_xp("reshape", _np_reshape, reshape)
register_xp("broadcast_to", np.broadcast_to, broadcast_to)
register_xp("concat", lambda xs, axis: np.concatenate(xs, axis=axis), lambda xs, axis: concat(list(xs), axis))


def _windows(n: int, size: int, step: int) -> int:
    return (n - size) // step + 1



def _unfold_meta(a: Tensor, dim: int, size: int, step: int) -> tuple[tuple[int, ...], np.dtype[Any]]:
    shape = list(a.shape) or [1]
    shape[dim] = _windows(shape[dim], size, step)
    return (*shape, size) if a.shape else (size,), a.dtype



def _unfold_kernel(a: np.ndarray, dim: int, size: int, step: int) -> np.ndarray:
    # a view, as PyTorch's: window i along ``dim`` starts ``step`` elements after window i-1, and the new last
    # dim walks ``dim``'s stride (windows overlap when step < size; writable as the input is)
    if a.ndim == 0:
        return a.reshape(1)[:size]
    shape, strides = list(a.shape), list(a.strides)
    shape[dim] = _windows(shape[dim], size, step)
    strides[dim] = a.strides[dim] * step
    return np.lib.stride_tricks.as_strided(a, (*shape, size), (*strides, a.strides[dim]))


def _fold_kernel(g: np.ndarray, in_shape: tuple[int, ...], dim: int, size: int, step: int) -> np.ndarray:
    # the adjoint of unfold: overlap-add the windows back (for a fixed offset k the rows hit are distinct,
    # so a strided slice-add is exact; no np.add.at needed)
    z = np.zeros(in_shape, dtype=g.dtype)
    if not in_shape:
        return g.reshape(()).copy() if size else z
    n = g.shape[dim]
    for k in range(size):
        sl = [slice(None)] * len(in_shape)
        sl[dim] = slice(k, k + step * (n - 1) + 1, step)
        z[tuple(sl)] += g[..., k]
    return z



def _unfold_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    in_shape = tuple(args[0].shape)
    if isinstance(g, Tensor):  # create_graph: the adjoint as an op of its own, itself differentiable
        return (apply(OP_UNFOLD_BACKWARD, (g,), {"in_shape": in_shape, **kw}),)
    return (_fold_kernel(g, in_shape, **kw),)



def _fold_meta(g: Tensor, in_shape: tuple[int, ...], dim: int, size: int, step: int) -> Any:
    return in_shape, g.dtype



def _fold_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    k = {"dim": kw["dim"], "size": kw["size"], "step": kw["step"]}
    if isinstance(g, Tensor):
        return (apply(OP_UNFOLD, (g,), k),)
    return (_unfold_kernel(g, **k),)



OP_UNFOLD = defop("unfold", _unfold_kernel, _unfold_meta, _unfold_rule, saves=(), view=True)



OP_UNFOLD_BACKWARD = defop("unfold_backward", _fold_kernel, _fold_meta, _fold_rule, saves=())



def unfold(input: Tensor, dimension: int, size: int, step: int) -> Tensor:
    """All windows of ``size`` elements, every ``step``, along ``dimension``, in a new last dimension
    (PyTorch's ``Tensor.unfold``): a view sharing ``input``'s memory and version counter, with
    ``input``'s stride along ``dimension`` times ``step`` there and that stride in the new dimension
    (windows overlap when ``step < size``). Differentiable (twice).

    Raises:
        OpError: If ``size`` exceeds the dimension, or ``step`` is not positive.
    """
    d = norm_dim("unfold", input, dimension)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise OpError(f"unfold: size must be a non-negative int, got {size!r}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step <= 0:
        raise OpError(f"unfold: step is {step} but must be > 0")
    n = input.shape[d] if input.shape else 1
    if size > n:
        raise OpError(
            f"unfold: maximum size for tensor at dimension {d} is {n} but size is {size} (shape {tuple(input.shape)})"
        )
    return apply(OP_UNFOLD, (input,), {"dim": d, "size": int(size), "step": int(step)})  # type: ignore[no-any-return]
