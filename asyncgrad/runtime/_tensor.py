"""The Tensor: an array on a device whose value may still be computing on a stream."""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ..devices import Device, Stream, add_scaled
from . import _dispatch, _grad_mode, _promote
from ._dispatch import share_version
from ._runtime import _task_streams, current_runtime

_INDEX_TYPES = (int, slice, type(None), type(Ellipsis), np.integer)


class Tensor:
    """An n-dimensional array with autograd, living on a device.

    Ops on tensors return at once; the value may still be computing on the task's stream. `numpy()`,
    `item()` and anything else that needs the value waits for it (`await t.ready()` waits without
    blocking the event loop).
    """

    # hot fields are slots; rarely set ones live in __dict__ with class defaults, so making a tensor
    # (once per op) sets only seven fields
    __slots__ = ("__dict__", "__weakref__", "_data", "_dev", "_dtype", "_grad_fn", "_rg", "_shape", "_stream")

    _data: np.ndarray | None  # None while the kernel computing it has not run yet
    _dev: Device
    _dtype: np.dtype[Any]
    _grad_fn: Any
    _rg: bool
    _shape: tuple[int, ...]
    _stream: Stream | None  # the stream of the kernel producing the value, while it may be pending

    _seq = 0  # sequence number of the kernel producing the value on `_stream` (when pending)
    # PyTorch's version counter: a one-int cell, bumped by `_inplace.inplace` only and checked by the
    # backward of nodes that saved this tensor. Views share their base's cell (`_dispatch.share_version`),
    # so a write through any of them is seen. Made on first write or view (in __dict__), so new tensors cost
    # nothing; `_version` reads it
    _vc: list[int] | None = None
    # set on the pending result of ``tensor * number`` (no graph) whose kernel an in-place ``p -= ...`` took
    # over (`_inplace.scaled_update`): the kernel then skips, and the in-place kernel computes what is needed
    _defer = False
    _grad: Tensor | None = None
    _out_nr = 0
    _hooks: Any = None
    _post_hooks: Any = None
    _retains_grad = False

    # lets numpy defer to Tensor in `ndarray + Tensor`
    __array_priority__ = 1000

    # ---- construction (internal) ----------------------------------------------------------------

    @classmethod
    def _wrap(cls, data: np.ndarray, dev: Device) -> Tensor:
        t = object.__new__(cls)
        if type(data) is not np.ndarray:
            data = np.asarray(data)
        t._data = data
        t._shape = data.shape
        t._dtype = data.dtype
        t._dev = dev
        t._stream = None
        t._rg = False
        t._grad_fn = None
        return t

    @classmethod
    def _pending(cls, shape: tuple[int, ...], dtype: Any, dev: Device, stream: Stream) -> Tensor:
        t = object.__new__(cls)
        t._data = None
        t._shape = shape
        t._dtype = dtype
        t._dev = dev
        t._stream = stream
        t._rg = False
        t._grad_fn = None
        return t

    def __init__(self, *a: Any, **k: Any) -> None:
        raise TypeError("create tensors with asyncgrad.tensor(...), asyncgrad.zeros(...) and friends")

    if TYPE_CHECKING:  # installed by the op families (_ops_*.py), next to their forwards and rules
        def __add__(self, o: Any) -> Tensor: ...
        def __radd__(self, o: Any) -> Tensor: ...
        def __sub__(self, o: Any) -> Tensor: ...
        def __rsub__(self, o: Any) -> Tensor: ...
        def __mul__(self, o: Any) -> Tensor: ...
        def __rmul__(self, o: Any) -> Tensor: ...
        def __truediv__(self, o: Any) -> Tensor: ...
        def __rtruediv__(self, o: Any) -> Tensor: ...
        def __pow__(self, o: Any) -> Tensor: ...
        def __rpow__(self, o: Any) -> Tensor: ...
        def __matmul__(self, o: Any) -> Tensor: ...
        def __rmatmul__(self, o: Any) -> Tensor: ...
        def __neg__(self) -> Tensor: ...
        def __lt__(self, o: Any) -> Tensor: ...
        def __le__(self, o: Any) -> Tensor: ...
        def __gt__(self, o: Any) -> Tensor: ...
        def __ge__(self, o: Any) -> Tensor: ...
        def __getitem__(self, idx: Any) -> Tensor: ...
        def __getattr__(self, name: str) -> Any: ...  # other installed methods: sum, reshape, ...

    # ---- attributes ------------------------------------------------------------------------------

    @property
    def _version(self) -> int:
        """In-place writes so far to this tensor's memory, through it or any view sharing it."""
        vc = self._vc
        return 0 if vc is None else vc[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def size(self, dim: int | None = None) -> Any:
        return self._shape if dim is None else self._shape[dim]

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype  # type: ignore[no-any-return]

    @property
    def device(self) -> Device:
        return self._dev

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    ndimension = dim

    def nelement(self) -> int:
        return self.numel()

    def element_size(self) -> int:
        """Bytes per element."""
        return self._dtype.itemsize  # type: ignore[no-any-return]

    def is_floating_point(self) -> builtins.bool:
        return self._dtype.kind == "f"  # type: ignore[no-any-return]

    def numel(self) -> int:
        n = 1
        for s in self._shape:
            n *= s
        return n

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in bytes, numpy style (waits for the value)."""
        return self._value().strides

    def stride(self) -> tuple[int, ...]:
        """Strides in elements, PyTorch style (waits for the value)."""
        isz = self._dtype.itemsize
        return tuple(s // isz for s in self._value().strides)

    @property
    def requires_grad(self) -> bool:
        return self._rg

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        if self._grad_fn is not None and not flag:
            raise RuntimeError(
                "you can only change requires_grad flags of leaf tensors; use .detach() to get a tensor "
                "outside the graph"
            )
        if flag and self._dtype.kind not in "fc":
            raise RuntimeError(
                f"only floating point tensors can require gradients, got dtype {self._dtype}; "
                "convert first, e.g. t.to(dtype='float64')"
            )
        self._rg = bool(flag)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        self.requires_grad = flag
        return self

    @property
    def is_leaf(self) -> bool:
        return self._grad_fn is None

    @property
    def grad_fn(self) -> Any:
        return self._grad_fn

    @property
    def grad(self) -> Tensor | None:
        g = self._grad
        if g is None and self._grad_fn is not None and not self._retains_grad:
            warnings.warn(
                "reading .grad of a tensor that is not a leaf: backward fills .grad only for leaves, so this "
                "is None; call .retain_grad() on it before backward to keep its gradient",
                UserWarning,
                stacklevel=2,
            )
        return g

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        if value is not None:
            if not isinstance(value, Tensor):
                raise TypeError(f"assigned grad must be a Tensor or None, got {type(value).__name__}")
            if value._shape != self._shape or value._dtype != self._dtype or value._dev is not self._dev:
                raise RuntimeError(
                    f"assigned grad has shape {value._shape}, dtype {value._dtype}, device {value._dev} "
                    f"but the tensor has shape {self._shape}, dtype {self._dtype}, device {self._dev}; "
                    "they must match"
                )
        self._grad = value

    def retain_grad(self) -> None:
        """Keep `.grad` for this non-leaf tensor after backward."""
        if not self._rg:
            raise RuntimeError(
                "retain_grad() on a tensor that does not require grad: it will never get a gradient; "
                "make the tensors it comes from require grad first"
            )
        if self._grad_fn is None:
            return
        if not self._retains_grad:
            self._retains_grad = True
            from ._hooks import tensor_retain_grad

            tensor_retain_grad(self)

    @property
    def retains_grad(self) -> bool:
        return self._retains_grad

    # ---- values ----------------------------------------------------------------------------------

    def _value(self) -> np.ndarray:
        s = self._stream
        if s is not None and s._completed < self._seq:
            s.synchronize_blocking(self._seq)
        elif s is not None:
            s.check_error()
        data = self._data
        if data is None:
            raise RuntimeError(
                "this tensor has no value: the kernel that computes it was skipped, because an earlier "
                "kernel on its stream failed (see the error raised before) or its runtime closed first"
            )
        return data

    def numpy(self) -> np.ndarray:
        """The tensor's own numpy array (shares memory, keeps strides), after its pending work is done.

        Also waits for the kernels the calling task has queued so far: they may still read this memory,
        and a write through the returned array must not race with them (as in eager PyTorch, where they
        would have run already). Reading a copy (`item`, `tolist`, `float`) waits for the value only.
        """
        if self._dev.type != "cpu":
            raise TypeError(f"can't convert a {self._dev} tensor to numpy; use .to('cpu') first")
        data = self._value()
        ts = _task_streams.get()
        if ts is not None:
            s = ts.by_device.get(self._dev)
            if s is not None and s._completed < s._submitted:
                s.synchronize_blocking()
        return data

    def item(self) -> Any:
        """The value of a one-element tensor as a Python number."""
        if self.numel() != 1:
            raise RuntimeError(
                f"item(): a Tensor with {self.numel()} elements cannot be converted to a Python scalar "
                f"(shape {self._shape}); index one element first or use .tolist()"
            )
        return self._value().item()

    def tolist(self) -> Any:
        return self._value().tolist()

    def is_ready(self) -> builtins.bool:
        """True when the value is computed (no kernel producing it is still queued); never waits."""
        s = self._stream
        return self._data is not None and (s is None or s._completed >= self._seq)

    def value_if_ready(self) -> np.ndarray | None:
        """A read-only view of the value if it is computed, else None; never waits.

        Nothing queued writes to a ready value (an in-place op makes its tensor pending), so reading the
        view now is safe; kernels queued later may still read this memory, hence read-only.
        """
        s = self._stream
        data = self._data
        if data is None or (s is not None and s._completed < self._seq):
            return None
        view = data.view()
        view.flags.writeable = False
        return view

    async def ready(self) -> Tensor:
        """Wait, without blocking the event loop, until this tensor's value is computed."""
        s = self._stream
        if s is not None and s._completed < self._seq:
            await s.synchronize(self._seq)
        else:
            await trio.lowlevel.checkpoint()
            if s is not None:
                s.check_error()
        return self

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        extra = ""
        if self._grad_fn is not None:
            extra = f", grad_fn=<{self._grad_fn.name()}>"
        elif self._rg:
            extra = ", requires_grad=True"
        try:
            body = np.array2string(self._value(), separator=", ", prefix="tensor(")
        except Exception as e:  # repr must not raise
            body = f"<unavailable: {e}>"
        dev = "" if self._dev.type == "cpu" and self._dev.index == 0 else f", device='{self._dev}'"
        return f"tensor({body}, dtype={self._dtype}{dev}{extra})"

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __iter__(self) -> Iterator[Tensor]:
        for i in range(len(self)):
            yield self[i]

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise RuntimeError(
                f"the truth value of a tensor with {self.numel()} elements is ambiguous; use .any() or .all()"
            )
        return bool(self._value())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        if self._dtype.kind not in "iu":
            raise TypeError("only integer tensors of a single element can be used as an index")
        return int(self.item())

    __hash__ = object.__hash__

    # ---- graph-free copies -----------------------------------------------------------------------

    def detach(self) -> Tensor:
        """A tensor sharing this one's value (and version counter), outside the graph."""
        return self._detached(True)

    def _detached(self, share: builtins.bool) -> Tensor:
        if self._stream is None or self._stream._completed >= self._seq:
            t = Tensor._wrap(self._value(), self._dev)
            if share:
                share_version(self, t)
            return t
        from ._ops_shape import alias

        return alias(self, share)

    def detach_(self) -> Tensor:
        self._grad_fn = None
        self._rg = False
        return self

    def clone(self) -> Tensor:
        from ._ops_elementwise import clone

        return clone(self)

    def contiguous(self) -> Tensor:
        """This tensor if it is C-contiguous, else a C-contiguous copy (differentiable)."""
        if self._stream is None and self._data is not None and self._data.flags.c_contiguous:
            return self
        from ._ops_elementwise import contiguous

        return contiguous(self)

    def to(self, device: Any = None, dtype: Any = None, *, copy: bool = False) -> Tensor:
        """Move to ``device`` and/or convert to ``dtype`` (differentiable for float dtypes)."""
        if device is not None and not isinstance(device, (str, Device)):
            device, dtype = None, device  # t.to(dtype)
        t = self
        if dtype is not None and np.dtype(dtype) != self._dtype:
            from ._ops_elementwise import astype

            t = astype(t, np.dtype(dtype))
        if device is not None:
            rt = current_runtime("Tensor.to")
            dev = rt.device(device)
            if dev is not t._dev:
                from ._ops_elementwise import to_device

                t = to_device(t, dev)
        if copy and t is self:
            t = self.clone()
        return t

    def float(self) -> Tensor:
        return self.to(dtype=np.float32)

    def double(self) -> Tensor:
        return self.to(dtype=np.float64)

    def half(self) -> Tensor:
        return self.to(dtype=np.float16)

    def long(self) -> Tensor:
        return self.to(dtype=np.int64)

    def int(self) -> Tensor:
        return self.to(dtype=np.int32)

    def bool(self) -> Tensor:
        return self.to(dtype=np.bool_)

    def type_as(self, other: Tensor) -> Tensor:
        """This tensor converted to ``other``'s dtype."""
        return self.to(dtype=other._dtype)

    def type(self, dtype: Any = None) -> Any:
        """With ``dtype``: this tensor converted to it; without: the dtype's name (numpy's spelling)."""
        if dtype is None:
            return str(self._dtype)
        return self.to(dtype=dtype)

    def expand_as(self, other: Tensor) -> Tensor:
        return self.expand(*other._shape)  # type: ignore[attr-defined,no-any-return]

    def view_as(self, other: Tensor) -> Tensor:
        return self.reshape(other._shape)  # type: ignore[attr-defined,no-any-return]

    def t(self) -> Tensor:
        """Transpose of a tensor of at most 2 dims (PyTorch's ``t()``)."""
        if self.ndim > 2:
            raise RuntimeError(f"t() expects a tensor with <= 2 dims, got shape {self._shape}; use transpose()")
        return self if self.ndim < 2 else self.transpose(0, 1)  # type: ignore[attr-defined,no-any-return]

    def where(self, condition: Any, other: Any) -> Tensor:
        """This tensor where ``condition``, else ``other``."""
        from ._ops_elementwise import where

        return where(condition, self, other)

    def uniform_(self, a: builtins.float = 0.0, b: builtins.float = 1.0, *, generator: Any = None) -> Tensor:
        """Fill with uniform samples from [a, b), drawn now from ``generator`` (default: the thread's)."""
        from ._factories import default_generator

        vals = (generator or default_generator()).uniform(a, b, self._shape).astype(self._dtype)
        return self.copy_(vals)

    def normal_(self, mean: builtins.float = 0.0, std: builtins.float = 1.0, *, generator: Any = None) -> Tensor:
        """Fill with normal samples, drawn now from ``generator`` (default: the thread's)."""
        from ._factories import default_generator

        vals = (generator or default_generator()).normal(mean, std, self._shape).astype(self._dtype)
        return self.copy_(vals)

    def cpu(self) -> Tensor:
        """This tensor on the default CPU device (itself when it is there already)."""
        return self.to("cpu")

    def is_contiguous(self) -> builtins.bool:
        """Whether the value is C-contiguous (waits for the value)."""
        return builtins.bool(self._value().flags.c_contiguous)

    @property
    def data(self) -> Tensor:
        """A tensor sharing this one's value outside the graph, as ``detach()`` but with a version counter
        of its own (PyTorch's ``.data``: in-place writes through it are not seen by autograd)."""
        return self._detached(False)

    @data.setter
    def data(self, value: Tensor) -> None:
        # PyTorch swaps the storage under the tensor, keeping its autograd identity
        if not isinstance(value, Tensor):
            raise TypeError(f"data must be set to a Tensor, got {type(value).__name__}")
        if value._dev is not self._dev:
            raise RuntimeError(f"data: the new value is on {value._dev}, this tensor on {self._dev}")
        arr = value._value()
        self._data, self._shape, self._dtype, self._stream = arr, arr.shape, arr.dtype, None

    # ---- new tensors like this one (dtype and device default to this tensor's) --------------------

    def _new(self, arr: np.ndarray, requires_grad: builtins.bool) -> Tensor:
        t = Tensor._wrap(arr, self._dev)
        if requires_grad:
            t.requires_grad_()
        return t

    def new_tensor(self, data: Any, dtype: Any = None, requires_grad: builtins.bool = False) -> Tensor:
        """A new tensor holding a copy of ``data``, with this tensor's dtype unless ``dtype`` is given."""
        if isinstance(data, Tensor):
            data = data._value()
        return self._new(np.array(data, dtype=dtype or self._dtype, copy=True), requires_grad)

    def new_zeros(self, *size: Any, dtype: Any = None, requires_grad: builtins.bool = False) -> Tensor:
        return self._new(np.zeros(_size(size), dtype or self._dtype), requires_grad)

    def new_ones(self, *size: Any, dtype: Any = None, requires_grad: builtins.bool = False) -> Tensor:
        return self._new(np.ones(_size(size), dtype or self._dtype), requires_grad)

    def new_empty(self, *size: Any, dtype: Any = None, requires_grad: builtins.bool = False) -> Tensor:
        return self._new(np.empty(_size(size), dtype or self._dtype), requires_grad)

    def new_full(
        self, size: Any, fill_value: Any, *, dtype: Any = None, requires_grad: builtins.bool = False
    ) -> Tensor:
        return self._new(np.full(_size((size,)), fill_value, dtype or self._dtype), requires_grad)

    # ---- autograd --------------------------------------------------------------------------------

    def backward(
        self,
        gradient: Tensor | None = None,
        *,
        retain_graph: builtins.bool | None = None,
        create_graph: builtins.bool = False,
        inputs: Sequence[Tensor] | Tensor | None = None,
    ) -> Awaitable[None]:
        """Accumulate the gradient of this tensor into the `.grad` of the leaves: ``await t.backward()``.

        Argument checks happen at the call; the returned awaitable runs the pass.
        """
        return _autograd.backward(  # type: ignore[no-any-return]
            [self],
            None if gradient is None else [gradient],
            retain_graph=retain_graph,
            create_graph=create_graph,
            inputs=inputs,
        )

    def register_hook(self, hook: Callable[[Tensor], Tensor | None]) -> Any:
        """Call ``hook(grad)`` when the gradient w.r.t. this tensor is computed; it may return a new grad.

        Returns a handle whose ``remove()`` removes exactly this hook.
        """
        from ._hooks import tensor_register_hook

        return tensor_register_hook(self, hook)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Tensor], None]) -> Any:
        """Call ``hook(tensor)`` after `.grad` of this leaf has been updated by a backward pass."""
        from ._hooks import tensor_register_post_accumulate_hook

        return tensor_register_post_accumulate_hook(self, hook)

    # ---- in-place helpers used by optimizers and zero_grad ---------------------------------------

    def zero_(self) -> Tensor:
        self._check_inplace("zero_")
        return _inplace.inplace(self, lambda a: a.fill(0))

    def fill_(self, value: builtins.float) -> Tensor:
        self._check_inplace("fill_")
        return _inplace.inplace(self, lambda a: a.fill(value))

    def copy_(self, src: Tensor | np.ndarray) -> Tensor:
        self._check_inplace("copy_", src)
        return _inplace.inplace(self, lambda a, s: np.copyto(a, s), src)

    def add_(self, other: Any, *, alpha: builtins.float = 1.0) -> Tensor:
        self._check_inplace("add_", other)
        if alpha == 1.0:
            return _inplace.inplace(self, lambda a, o: np.add(a, o, out=a, casting="unsafe"), other)
        return _inplace.inplace(self, lambda a, o: add_scaled(a, alpha, o), other)

    def mul_(self, other: Any) -> Tensor:
        self._check_inplace("mul_", other)
        return _inplace.inplace(self, lambda a, o: np.multiply(a, o, out=a, casting="unsafe"), other)

    def sub_(self, other: Any, *, alpha: builtins.float = 1.0) -> Tensor:
        return self.add_(other, alpha=-alpha)

    def __iadd__(self, other: Any) -> Tensor:
        return self._iop(other, np.add, "add")

    def __isub__(self, other: Any) -> Tensor:
        return self._iop(other, np.subtract, "sub")

    def __imul__(self, other: Any) -> Tensor:
        return self._iop(other, np.multiply, "mul")

    def __itruediv__(self, other: Any) -> Tensor:
        return self._iop(other, np.true_divide, "div")

    def _iop(self, other: Any, ufunc: Any, name: str) -> Tensor:
        self._check_inplace(name, other)
        if type(other) is Tensor and other._defer is False and "_scaled" in other.__dict__:
            # `p -= lr * g`: one pass over memory, without the temporary, when `lr * g` is not used elsewhere
            done = _inplace.scaled_update(self, other, ufunc)
            if done is not None:
                return done
        return _inplace.inplace(self, lambda a, o: ufunc(a, o, out=a, casting="unsafe"), other)

    def _check_inplace(self, name: str, *values: Any) -> None:
        if not _grad_mode._grad_enabled.get():
            return
        if self._rg:
            raise RuntimeError(
                f"in-place {name} on a tensor that requires grad while grad mode is on would corrupt the "
                "graph; use `with asyncgrad.no_grad():` or an out-of-place op"
            )
        for v in values:
            if isinstance(v, Tensor) and v._rg:
                # PyTorch would record the write in the graph; asyncgrad records no in-place op, and
                # silently dropping the value's gradient would give wrong gradients
                raise RuntimeError(
                    f"in-place {name} writes a value that requires grad (shape {v._shape}) into a tensor "
                    "outside the graph, so its gradient would be lost; build the result out of place "
                    "(asyncgrad.where, stack, concat, ...) or write value.detach() if no gradient should flow"
                )

    def __setitem__(self, idx: Any, value: Any) -> None:
        """``t[idx] = value`` in place, in stream order (indexing as in ``t[idx]``).

        Like the other in-place ops, only on tensors outside the graph: a tensor that requires grad
        needs ``with asyncgrad.no_grad():`` (as PyTorch requires for a leaf), or an out-of-place
        formulation such as `asyncgrad.where`.
        """
        self._check_inplace("assignment (t[idx] = value)", value)
        from ._ops_shape import setitem_parts

        tensors, assign = setitem_parts(idx)
        _inplace.inplace(self, assign, value, *tensors)

    # in-place forms of unary ops (out-of-place ones are installed by the op modules)

    def _unary_(self, name: str, ufunc: Any) -> Tensor:
        self._check_inplace(name)
        return _inplace.inplace(self, lambda a: ufunc(a, out=a, casting="unsafe"))

    def exp_(self) -> Tensor:
        return self._unary_("exp_", np.exp)

    def log_(self) -> Tensor:
        return self._unary_("log_", np.log)

    def sqrt_(self) -> Tensor:
        return self._unary_("sqrt_", np.sqrt)

    def tanh_(self) -> Tensor:
        return self._unary_("tanh_", np.tanh)

    def abs_(self) -> Tensor:
        return self._unary_("abs_", np.abs)

    def neg_(self) -> Tensor:
        return self._unary_("neg_", np.negative)

    def sigmoid_(self) -> Tensor:
        self._check_inplace("sigmoid_")

        def f(a: np.ndarray) -> None:
            np.negative(a, out=a)
            np.exp(a, out=a)
            np.add(a, 1, out=a, casting="unsafe")
            np.reciprocal(a, out=a)

        return _inplace.inplace(self, f)

    def relu_(self) -> Tensor:
        self._check_inplace("relu_")
        return _inplace.inplace(self, lambda a: np.maximum(a, 0, out=a, casting="unsafe"))

    def clamp_(self, min: Any = None, max: Any = None) -> Tensor:
        self._check_inplace("clamp_")
        if min is None and max is None:
            raise ValueError("clamp_: at least one of min and max must be given")
        return _inplace.inplace(self, lambda a: np.clip(a, min, max, out=a, casting="unsafe"))

    def div_(self, other: Any) -> Tensor:
        return self._iop(other, np.true_divide, "div_")

    def pow_(self, other: Any) -> Tensor:
        return self._iop(other, np.power, "pow_")

    def masked_fill(self, mask: Any, value: Any) -> Tensor:
        """``value`` where ``mask`` is True, else this tensor (differentiable w.r.t. this tensor)."""
        from ._ops_elementwise import where

        return where(mask, value, self)

    def masked_fill_(self, mask: Any, value: Any) -> Tensor:
        self._check_inplace("masked_fill_")
        return _inplace.inplace(self, lambda a, m: np.copyto(a, value, casting="unsafe", where=m), mask)


def _size(size: tuple[Any, ...]) -> tuple[int, ...]:
    """Sizes given as ``f(2, 3)`` or ``f((2, 3))``."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    return tuple(builtins.int(n) for n in size)


_dispatch.Tensor = Tensor  # type: ignore[attr-defined]
_promote.Tensor = Tensor  # type: ignore[attr-defined]

# bound here, below Tensor, because both import this module: a function-level import costs ~1.5 us per call
# on the per-op path
from . import _autograd, _inplace  # noqa: E402
