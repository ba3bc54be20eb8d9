"""The one place where ops, operators, in-place methods, ``backward`` and hooks are bound onto Tensor.

`runtime.Tensor` is the data structure (fields, values, attributes); everything a tensor *does* comes from
the layers above it and is bound here, once, at import (as chainer's ``install_variable_arithmetics``): a
reader sees every method in the tables below. Operators are bound to module-level functions (no lookup
per call on the hot path).
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from . import autograd, ops
from .autograd import _tensor_hooks
from .devices import DEVICE_TYPES, Device
from .devices import device as device_spec
from .ops._convert import alias, to_device
from .ops._convert import contiguous as _contiguous
from .ops._elementwise import (
    OP_ADD,
    OP_DIV,
    OP_FLOOR_DIVIDE,
    OP_NEG,
    OP_POW,
    OP_REMAINDER,
    OP_SUB,
    _tensor_mul,
    _tensor_rmul,
    eq,
    ge,
    gt,
    le,
    lt,
    ne,
)
from .ops._index import setitem_parts
from .ops._linalg import OP_MATMUL
from .ops._shape import _T
from .runtime import _capture
from .runtime import _inplace as I
from .runtime._dispatch import apply, apply1, apply2
from .runtime._factories import default_generator, empty, get_default_dtype, tensor
from .runtime._runtime import current_runtime
from .runtime._tensor import Tensor, is_ready, share_version

# ---- operators ---------------------------------------------------------------------------------------------

OPERATORS: dict[str, Callable[..., Any]] = {
    "__add__": lambda s, o: apply2(OP_ADD, s, o),
    "__radd__": lambda s, o: apply2(OP_ADD, o, s),
    "__sub__": lambda s, o: apply2(OP_SUB, s, o),
    "__rsub__": lambda s, o: apply2(OP_SUB, o, s),
    "__mul__": _tensor_mul,
    "__rmul__": _tensor_rmul,
    "__truediv__": lambda s, o: apply2(OP_DIV, s, o),
    "__rtruediv__": lambda s, o: apply2(OP_DIV, o, s),
    "__pow__": lambda s, o: apply2(OP_POW, s, o),
    "__rpow__": lambda s, o: apply2(OP_POW, o, s),
    "__mod__": lambda s, o: apply2(OP_REMAINDER, s, o),
    "__rmod__": lambda s, o: apply2(OP_REMAINDER, o, s),
    "__floordiv__": lambda s, o: apply2(OP_FLOOR_DIVIDE, s, o),
    "__rfloordiv__": lambda s, o: apply2(OP_FLOOR_DIVIDE, o, s),
    "__matmul__": lambda s, o: apply(OP_MATMUL, (s, o)),
    "__rmatmul__": lambda s, o: apply(OP_MATMUL, (o, s)),
    "__neg__": lambda s: apply1(OP_NEG, s),
    "__pos__": lambda s: s,
    "__abs__": ops.abs,
    "__lt__": lt,
    "__le__": le,
    "__gt__": gt,
    "__ge__": ge,
    "__eq__": eq,
    "__ne__": ne,
    "__getitem__": ops.getitem,
    # in place: recorded in no graph (see `runtime._inplace`)
    "__iadd__": I.iadd,
    "__isub__": I.isub,
    "__imul__": I.imul,
    "__itruediv__": I.itruediv,
}

# ---- ops as methods: ``t.name(...)`` is ``ops.name(t, ...)`` ----------------------------------------------------

OP_METHODS = (
    # elementwise and math
    "add", "sub", "mul", "div", "pow", "remainder", "floor_divide", "maximum", "minimum", "neg", "exp", "log",
    "tanh", "sigmoid", "relu", "sqrt", "abs", "sign", "sin", "cos", "floor", "ceil", "round", "log1p", "expm1",
    "erf", "rsqrt", "reciprocal", "square", "lerp", "nan_to_num", "isnan", "isinf", "isfinite", "allclose",
    "equal", "clamp", "clamp_min", "clamp_max", "addcmul", "addcdiv", "eq", "ne", "lt", "le", "gt", "ge",
    "greater", "greater_equal", "less", "less_equal", "not_equal",
    # shape and indexing
    "reshape", "flatten", "permute", "transpose", "broadcast_to", "expand", "unsqueeze", "squeeze", "split",
    "chunk", "unbind", "narrow", "flip", "fliplr", "flipud", "roll", "movedim", "swapaxes", "unflatten",
    "repeat", "repeat_interleave", "tril", "triu", "diag", "trace", "scatter", "scatter_add", "gather",
    "index_select", "unfold",
    # reductions and sorting
    "sum", "mean", "norm", "max", "min", "amax", "amin", "argmax", "argmin", "prod", "all", "any", "cumsum",
    "logsumexp", "var", "std", "sort", "argsort", "topk", "masked_select", "nonzero", "argwhere", "multinomial",
    # products and nn
    "matmul", "mm", "bmm", "dot", "outer", "addmm", "softmax", "log_softmax", "gelu",
)

ALIASES = {"view": "reshape", "clip": "clamp", "moveaxis": "movedim", "swapdims": "swapaxes"}

PROPERTIES = {"T": _T, "mT": lambda x: ops.transpose(x, -2, -1)}


# ---- methods written here: they combine ops, the runtime and autograd ------------------------------------------


def _detached(self: Tensor, share: builtins.bool) -> Tensor:
    # while a compiled step records, an op: a wrapper of the recorded array would be replayed as a constant
    if is_ready(self) and _capture.active is None:
        t = Tensor._wrap(self._value(), self._dev)
        if share:
            share_version(self, t)
        return t
    return alias(self, share)


def detach(self: Tensor) -> Tensor:
    """A tensor sharing this one's value (and version counter), outside the graph."""
    return _detached(self, True)


def _data(self: Tensor) -> Tensor:
    """A tensor sharing this one's value outside the graph, as ``detach()`` but with a version counter of its
    own (PyTorch's ``.data``: in-place writes through it are not seen by autograd)."""
    return _detached(self, False)


def clone(self: Tensor) -> Tensor:
    """A copy with the same strides (differentiable)."""
    return ops.clone(self)


def contiguous(self: Tensor) -> Tensor:
    """This tensor if it is C-contiguous, else a C-contiguous copy (differentiable)."""
    if self._stream is None and self._data is not None and self._data.flags.c_contiguous:
        return self
    return _contiguous(self)


def to(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Move to a device and/or convert to a dtype (differentiable for float dtypes), as PyTorch's.

    Forms: ``to(dtype)``, ``to(device=None, dtype=None)``, ``to(other)`` (``other``'s device and dtype); each
    also takes ``non_blocking=`` (accepted: a copy to host memory is always ordered on the streams),
    ``copy=`` (a new tensor even when nothing changes) and ``memory_format=`` (ignored: layouts are kept). A
    device is a name (``"cpu"``), an ``asyncgrad.device`` or a runtime Device.
    """
    device, dtype, copy = to_args("Tensor.to", args, kwargs)
    t = self
    if dtype is not None and dtype != self._dtype:
        t = ops.astype(t, dtype)
    if device is not None:
        dev = current_runtime("Tensor.to").device(device)
        if dev is not t._dev:
            t = to_device(t, dev)
    if copy and t is self:
        t = ops.clone(self)
    return t


def _is_device_like(x: Any) -> builtins.bool:
    if isinstance(x, (Device, device_spec)):
        return True
    return isinstance(x, str) and x.partition(":")[0] in DEVICE_TYPES


def to_args(what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, builtins.bool]:
    """``(device, dtype, copy)`` from the argument forms of PyTorch's ``Tensor.to`` / ``Module.to``."""
    unknown = set(kwargs) - {"device", "dtype", "non_blocking", "copy", "memory_format"}
    if unknown:
        raise TypeError(f"{what}() got unexpected keyword argument(s) {sorted(unknown)}")
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    rest = list(args)
    if rest and isinstance(rest[0], Tensor):  # to(other, non_blocking=False, copy=False)
        other = rest.pop(0)
        device, dtype = other._dev, other._dtype
    elif rest and (rest[0] is None or _is_device_like(rest[0])):  # to(device, dtype=None, ...)
        device = rest.pop(0)
        if rest and not isinstance(rest[0], builtins.bool):
            dtype = rest.pop(0)
    elif rest and not isinstance(rest[0], builtins.bool):  # to(dtype, non_blocking=False, copy=False)
        dtype = rest.pop(0)
    flags = rest
    if len(flags) > 2 or not builtins.all(isinstance(f, builtins.bool) for f in flags):
        raise TypeError(
            f"{what}() received an invalid combination of arguments {args!r}; expected (dtype), "
            "(device=None, dtype=None), or (tensor), each followed by non_blocking=False, copy=False"
        )
    copy = kwargs.get("copy", flags[1] if len(flags) > 1 else False)
    if dtype is not None:
        try:
            dtype = np.dtype(dtype)
        except TypeError as e:
            raise TypeError(f"{what}(): {dtype!r} is neither a device nor a dtype") from e
    return device, dtype, builtins.bool(copy)


def new(cls: type, *args: Any, device: Any = None) -> Tensor:
    """PyTorch's legacy constructor: ``Tensor(2, 3)`` is uninitialised, ``Tensor([1., 2.])`` copies the data;
    both in the default dtype (float32). ``asyncgrad.tensor`` is the usual way."""
    dt = get_default_dtype()
    dev = "cpu" if device is None else device
    if not args:
        return empty(0, dtype=dt, device=dev)
    if builtins.all(isinstance(a, (builtins.int, np.integer)) and not isinstance(a, builtins.bool) for a in args):
        return empty(*args, dtype=dt, device=dev)
    if len(args) == 1:
        (data,) = args
        if isinstance(data, Tensor):
            if data._dtype != dt:
                raise TypeError(
                    f"Tensor(t): expected a tensor of the default dtype {dt}, got {data._dtype}; use t.to({dt})"
                )
            return detach(data)
        if isinstance(data, (list, tuple, np.ndarray)) or hasattr(data, "__array__"):
            return tensor(data, dtype=dt, device=dev)
        raise TypeError(f"new(): data must be a sequence (got {type(data).__name__})")
    raise TypeError(
        f"Tensor(*args): expected sizes (ints) or one sequence of data, got {tuple(type(a).__name__ for a in args)}"
    )


def _init(self: Tensor, *args: Any, device: Any = None) -> None:
    pass  # everything happens in `new` (internal constructors bypass both)


def where(self: Tensor, condition: Any, other: Any) -> Tensor:
    """This tensor where ``condition``, else ``other``."""
    return ops.where(condition, self, other)


def masked_fill(self: Tensor, mask: Any, value: Any) -> Tensor:
    """``value`` where ``mask`` is True, else this tensor (differentiable w.r.t. this tensor)."""
    return ops.where(mask, value, self)


def uniform_(self: Tensor, a: builtins.float = 0.0, b: builtins.float = 1.0, *, generator: Any = None) -> Tensor:
    """Fill with uniform samples from [a, b), drawn now from ``generator`` (default: the thread's)."""
    vals = (generator or default_generator()).uniform(a, b, self._shape).astype(self._dtype)
    return I.copy_(self, vals)


def normal_(self: Tensor, mean: builtins.float = 0.0, std: builtins.float = 1.0, *, generator: Any = None) -> Tensor:
    """Fill with normal samples, drawn now from ``generator`` (default: the thread's)."""
    vals = (generator or default_generator()).normal(mean, std, self._shape).astype(self._dtype)
    return I.copy_(self, vals)


def setitem(self: Tensor, idx: Any, value: Any) -> None:
    """``t[idx] = value`` in place, in stream order (indexing as in ``t[idx]``).

    Like the other in-place ops, only on tensors outside the graph: a tensor that requires grad needs
    ``with asyncgrad.no_grad():`` (as PyTorch requires for a leaf), or an out-of-place formulation such as
    `asyncgrad.where`.
    """
    I.check_inplace(self, "assignment (t[idx] = value)", value)
    tensors, assign = setitem_parts(idx)
    I.inplace(self, assign, value, *tensors)


def backward(
    self: Tensor,
    gradient: Tensor | None = None,
    *,
    retain_graph: builtins.bool | None = None,
    create_graph: builtins.bool = False,
    inputs: Sequence[Tensor] | Tensor | None = None,
) -> Awaitable[None]:
    """Accumulate the gradient of this tensor into the `.grad` of the leaves: ``await t.backward()``.

    Argument checks happen at the call; the returned awaitable runs the pass.
    """
    return autograd.backward(  # type: ignore[no-any-return]
        [self],
        None if gradient is None else [gradient],
        retain_graph=retain_graph,
        create_graph=create_graph,
        inputs=inputs,
    )


METHODS: dict[str, Callable[..., Any]] = {
    "detach": detach,
    "clone": clone,
    "contiguous": contiguous,
    "to": to,
    "where": where,
    "masked_fill": masked_fill,
    "uniform_": uniform_,
    "normal_": normal_,
    "__setitem__": setitem,
    "backward": backward,
    "register_hook": _tensor_hooks.register_hook,
    "register_post_accumulate_grad_hook": _tensor_hooks.register_post_accumulate_grad_hook,
    "retain_grad": _tensor_hooks.retain_grad,
    # in place (`runtime._inplace`)
    "zero_": I.zero_,
    "fill_": I.fill_,
    "copy_": I.copy_,
    "add_": I.add_,
    "sub_": I.sub_,
    "mul_": I.mul_,
    "div_": I.div_,
    "pow_": I.pow_,
    "sigmoid_": I.sigmoid_,
    "relu_": I.relu_,
    "clamp_": I.clamp_,
    "masked_fill_": I.masked_fill_,
    "addcmul_": I.addcmul_,
    "addcdiv_": I.addcdiv_,
    **{f"{name}_": I.unary_(f"{name}_", ufunc) for name, ufunc in (
        ("exp", np.exp), ("log", np.log), ("sqrt", np.sqrt), ("tanh", np.tanh), ("abs", np.abs),
        ("neg", np.negative),
    )},
}


def bind() -> None:
    """Bind every table above onto Tensor (done once, when asyncgrad is imported)."""
    for name, fn in OPERATORS.items():
        setattr(Tensor, name, fn)
    for name in OP_METHODS:
        setattr(Tensor, name, getattr(ops, name))
    for name, target in ALIASES.items():
        setattr(Tensor, name, getattr(ops, target))
    for name, getter in PROPERTIES.items():
        setattr(Tensor, name, property(getter))
    for name, fn in METHODS.items():
        setattr(Tensor, name, fn)
    Tensor.__new__ = staticmethod(new)  # type: ignore[assignment]
    Tensor.__init__ = _init  # type: ignore[method-assign]
    Tensor.data = property(_data, Tensor._set_data)  # type: ignore[attr-defined]


bind()
