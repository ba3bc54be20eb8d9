"""Shape ops: views and rearrangements (reshape, transpose, permute, broadcast, concat, stack, indexing)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._dispatch import OpError, apply, defop, share_version
from ._promote import result_type
from ._tensor import Tensor
from ._xp import _index_add


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


OP_RESHAPE = defop("reshape", lambda a, shape: np.reshape(a, shape), _reshape_meta, _reshape_rule, saves=(), view=True)


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
    return (xp.transpose(g, tuple(np.argsort(kw["axes"]))),)


OP_PERMUTE = defop("permute", lambda a, axes: np.transpose(a, axes), _perm_meta, _perm_rule, saves=(), view=True)


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


def _norm_index(idx: Any, op: str = "getitem") -> Any:
    items = idx if isinstance(idx, tuple) else (idx,)
    out = []
    for i in items:
        if isinstance(i, Tensor):
            i = i._value()
        elif isinstance(i, list):
            i = np.asarray(i)
        if isinstance(i, np.ndarray) and i.dtype.kind not in "iub":
            raise OpError(f"{op}: index arrays must be integer or bool, got dtype {i.dtype}")
        out.append(i)
    return tuple(out)


def _is_int(i: Any) -> bool:
    return isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))


def _split_ints(items: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """PyTorch's order for an index mixing integers with index arrays: ``(ints, rest)`` or None.

    PyTorch selects with the integers first, then indexes what is left; numpy counts an integer as one
    more index array when arrays are present, and puts the indexed dims in front when the arrays and
    integers are not side by side (``x[1, :, [3, 0]]``: PyTorch (3, 2), numpy (2, 3)). Indexing with
    ``x[ints][rest]`` gives PyTorch's result.
    """
    if not any(_is_int(i) for i in items):
        return None
    if not any(isinstance(i, np.ndarray) and i.ndim > 0 for i in items):
        return None
    first: list[Any] = []
    rest: list[Any] = []
    for i in items:
        if _is_int(i):
            first.append(i)
        elif i is None:
            rest.append(i)
        elif i is Ellipsis:
            first.append(i)
            rest.append(i)
        else:
            # a bool mask spans as many dims as it has
            first.extend([slice(None)] * (i.ndim if isinstance(i, np.ndarray) and i.dtype == np.bool_ else 1))
            rest.append(i)
    return tuple(first), tuple(rest)


def _getitem_meta(a: Tensor, idx: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    probe = np.broadcast_to(np.empty((), a._dtype), a._shape)
    try:
        return probe[idx].shape, a._dtype
    except IndexError as e:
        raise OpError(f"getitem: index {idx!r} is invalid for shape {a._shape}: {e}") from None


def _getitem_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (xp.index_add(args[0].shape, kw["idx"], g),)


def _getitem_kernel(a: np.ndarray, idx: tuple[Any, ...]) -> np.ndarray:
    r = a[idx]
    if type(r) is not np.ndarray:  # every dim indexed by an int: numpy gives a scalar, PyTorch a 0-d view
        r = a[(*idx, Ellipsis)]
    return r  # type: ignore[no-any-return]


OP_GETITEM = defop("getitem", _getitem_kernel, _getitem_meta, _getitem_rule, saves=())


def _index_add_meta(g: Tensor, shape: tuple[int, ...], idx: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return shape, g._dtype


def _index_add_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (g[kw["idx"]],)


OP_INDEX_ADD = defop(
    "index_backward", lambda g, shape, idx: _index_add(shape, idx, g), _index_add_meta, _index_add_rule
)


def index_add(shape: tuple[int, ...], idx: Any, g: Tensor) -> Tensor:
    """Zeros of ``shape`` with ``g`` added at ``idx`` (the adjoint of indexing)."""
    return apply(OP_INDEX_ADD, (g,), {"shape": tuple(shape), "idx": idx})


def getitem(x: Tensor, idx: Any) -> Tensor:
    """``x[idx]`` with basic (slices, ints, None, ...) and integer/bool array indexing, as in PyTorch."""
    items = _norm_index(idx)
    parts = _split_ints(items)
    if parts is not None:
        return apply(OP_GETITEM, (apply(OP_GETITEM, (x,), {"idx": parts[0]}),), {"idx": parts[1]})
    out = apply(OP_GETITEM, (x,), {"idx": items})
    if not any(isinstance(i, np.ndarray) for i in items):  # basic indexing: a view, as in PyTorch
        share_version(x, out)
    return out


def setitem_parts(idx: Any) -> tuple[list[Tensor], Any]:
    """For ``t[idx] = value``: the tensors in ``idx`` (to order the update after them) and
    ``assign(array, value, *their_arrays)``, which does the assignment with PyTorch's index order."""
    items = idx if isinstance(idx, tuple) else (idx,)
    tensors = [i for i in items if isinstance(i, Tensor)]
    for t in tensors:
        if t._dtype.kind not in "iub":
            raise OpError(f"setitem: index tensors must be integer or bool, got dtype {t._dtype}")
    template = _norm_index(tuple(None if isinstance(i, Tensor) else i for i in items), "setitem")
    where = [k for k, i in enumerate(items) if isinstance(i, Tensor)]

    def assign(a: np.ndarray, value: Any, *arrays: np.ndarray) -> None:
        full = list(template)
        for k, arr in zip(where, arrays):
            full[k] = arr
        parts = _split_ints(tuple(full))
        if parts is None:
            a[tuple(full)] = value
        else:
            a[parts[0]][parts[1]] = value  # a[ints] is a view: the assignment lands in `a`

    return tensors, assign


OP_ALIAS = defop("alias", lambda a: a, lambda a: (a._shape, a._dtype))


def alias(x: Tensor, share: bool = True) -> Tensor:
    """A new graph-free tensor object sharing ``x``'s value (used by detach of a pending tensor), and with
    ``share`` its version counter."""
    from ._grad_mode import no_grad

    with no_grad():
        out = apply(OP_ALIAS, (x,))
    if share:
        share_version(x, out)
    return out


def _install() -> None:
    T = Tensor
    T.reshape = reshape  # type: ignore[attr-defined,method-assign]
    T.view = reshape  # type: ignore[attr-defined,method-assign]
    T.flatten = flatten  # type: ignore[attr-defined,method-assign]
    T.permute = permute  # type: ignore[attr-defined,method-assign]
    T.transpose = transpose  # type: ignore[attr-defined,method-assign]
    T.T = property(_T)  # type: ignore[attr-defined,method-assign]
    T.mT = property(lambda x: transpose(x, -2, -1))  # type: ignore[attr-defined,method-assign]
    T.broadcast_to = broadcast_to  # type: ignore[attr-defined,method-assign]
    T.expand = expand  # type: ignore[attr-defined,method-assign]
    T.unsqueeze = unsqueeze  # type: ignore[attr-defined,method-assign]
    T.squeeze = squeeze  # type: ignore[attr-defined,method-assign]
    T.__getitem__ = getitem  # type: ignore[attr-defined,method-assign]


_install()
