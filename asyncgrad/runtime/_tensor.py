"""The Tensor: an array on a device whose value may still be computing on a stream."""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ..devices import DEVICE_TYPES, Device, Stream, add_scaled
from ..devices import device as _device_spec
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

    def __new__(cls, *args: Any, device: Any = None) -> Tensor:
        """PyTorch's legacy constructor: ``Tensor(2, 3)`` is uninitialised, ``Tensor([1., 2.])`` copies
        the data; both in the default dtype (float32). ``asyncgrad.tensor`` is the usual way."""
        return _legacy_new(args, device)

    def __init__(self, *args: Any, device: Any = None) -> None:
        pass  # everything happens in __new__ (internal constructors bypass both)

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

    def to(self, *args: Any, **kwargs: Any) -> Tensor:
        """Move to a device and/or convert to a dtype (differentiable for float dtypes), as PyTorch's.

        Forms: ``to(dtype)``, ``to(device=None, dtype=None)``, ``to(other)`` (``other``'s device and
        dtype); each also takes ``non_blocking=`` (accepted: a copy to host memory is always ordered on
        the streams), ``copy=`` (a new tensor even when nothing changes) and ``memory_format=`` (ignored:
        layouts are kept). A device is a name (``"cpu"``), an ``asyncgrad.device`` or a runtime Device.
        """
        device, dtype, copy = _to_args("Tensor.to", args, kwargs)
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

    def _new(self, arr: np.ndarray, requires_grad: builtins.bool, device: Any = None) -> Tensor:
        dev = self._dev if device is None else current_runtime("Tensor.new_*").device(device)
        t = Tensor._wrap(arr, dev)
        if requires_grad:
            t.requires_grad_()
        return t

    def new_tensor(
        self, data: Any, dtype: Any = None, device: Any = None, requires_grad: builtins.bool = False
    ) -> Tensor:
        """A new tensor holding a copy of ``data``, with this tensor's dtype unless ``dtype`` is given."""
        if isinstance(data, Tensor):
            data = data._value()
        return self._new(np.array(data, dtype=dtype or self._dtype, copy=True), requires_grad, device)

    def new_zeros(
        self, *size: Any, dtype: Any = None, device: Any = None, requires_grad: builtins.bool = False
    ) -> Tensor:
        return self._new(np.zeros(_size(size), dtype or self._dtype), requires_grad, device)

    def new_ones(
        self, *size: Any, dtype: Any = None, device: Any = None, requires_grad: builtins.bool = False
    ) -> Tensor:
        return self._new(np.ones(_size(size), dtype or self._dtype), requires_grad, device)

    def new_empty(
        self, *size: Any, dtype: Any = None, device: Any = None, requires_grad: builtins.bool = False
    ) -> Tensor:
        return self._new(np.empty(_size(size), dtype or self._dtype), requires_grad, device)

    def new_full(
        self, size: Any, fill_value: Any, *, dtype: Any = None, device: Any = None,
        requires_grad: builtins.bool = False,
    ) -> Tensor:
        return self._new(np.full(_size((size,)), fill_value, dtype or self._dtype), requires_grad, device)

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


def _is_device_like(x: Any) -> builtins.bool:
    if isinstance(x, (Device, _device_spec)):
        return True
    return isinstance(x, str) and x.partition(":")[0] in DEVICE_TYPES


def _to_args(what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, builtins.bool]:
    """``(device, dtype, copy)`` from the argument forms of PyTorch's ``Tensor.to`` / ``Module.to``."""
    unknown = set(kwargs) - {"device", "dtype", "non_blocking", "copy", "memory_format"}
    if unknown:
        raise TypeError(f"{what}() got unexpected keyword argument(s) {sorted(unknown)}")
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    flags: list[Any] = []
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


def _size(size: tuple[Any, ...]) -> tuple[int, ...]:
    """Sizes given as ``f(2, 3)`` or ``f((2, 3))``."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    return tuple(builtins.int(n) for n in size)


# ==== PyTorch-port API (issue 20 part 2): copies, legacy construction, CUDA names, pinned memory ======
# One block so that it moves as a unit into _tensor_methods.py.

_DEEPCOPY_NONLEAF = (
    "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at the "
    "moment. If you were attempting to deepcopy a module, this may be because of a torch.nn.utils."
    "weight_norm usage, see https://github.com/pytorch/pytorch/pull/103001"
)
# user attributes and the parameter mark travel with copies; autograd bookkeeping does not
_COPIED_PRIVATE = frozenset({"_is_param"})


def _copy_extras(src: Tensor, dst: Tensor, memo: dict[int, Any] | None) -> None:
    import copy as _copy

    for k, v in src.__dict__.items():
        if k in _COPIED_PRIVATE or not k.startswith("_"):
            dst.__dict__[k] = v if memo is None else _copy.deepcopy(v, memo)


def _tensor_deepcopy(self: Tensor, memo: dict[int, Any]) -> Tensor:
    if self._grad_fn is not None:
        raise RuntimeError(_DEEPCOPY_NONLEAF)
    done = memo.get(id(self))
    if done is not None:
        return done  # type: ignore[no-any-return]
    import copy as _copy

    # order="K" keeps a dense layout's strides (channels-last stays channels-last)
    new = Tensor._wrap(np.array(self._value(), copy=True, order="K"), self._dev)
    new._rg = self._rg
    memo[id(self)] = new
    if self._grad is not None:
        new._grad = _copy.deepcopy(self._grad, memo)
    _copy_extras(self, new, memo)
    return new


def _tensor_copy(self: Tensor) -> Tensor:
    # PyTorch's copy.copy: a new leaf sharing the memory (and so the version counter), requires_grad
    # kept, no .grad
    new = Tensor._wrap(self._value(), self._dev)
    share_version(self, new)
    new._rg = self._rg
    _copy_extras(self, new, None)
    return new


def _tensor_cuda(self: Tensor, device: Any = None, non_blocking: builtins.bool = False) -> Tensor:
    """This tensor on a CUDA device (``device``: an index, a name or a device; default the first).

    Raises the runtime's clear error when asyncgrad has no CUDA device (no cupy or no GPU).
    """
    if device is None:
        device = "cuda"
    elif isinstance(device, builtins.int):
        device = f"cuda:{device}"
    return self.to(device, non_blocking=non_blocking)


def _tensor_pin_memory(self: Tensor, device: Any = None) -> Tensor:
    """Accepted for PyTorch programs: there is no CUDA device to pin for, so this is the tensor itself."""
    return self


def _tensor_is_pinned(self: Tensor, device: Any = None) -> builtins.bool:
    return False


def _legacy_new(args: tuple[Any, ...], device: Any) -> Tensor:
    from ._factories import empty, get_default_dtype, tensor

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
            return data.detach()
        if isinstance(data, (list, tuple, np.ndarray)) or hasattr(data, "__array__"):
            return tensor(data, dtype=dt, device=dev)
        raise TypeError(f"new(): data must be a sequence (got {type(data).__name__})")
    raise TypeError(
        f"Tensor(*args): expected sizes (ints) or one sequence of data, got {tuple(type(a).__name__ for a in args)}"
    )


Tensor.__deepcopy__ = _tensor_deepcopy  # type: ignore[attr-defined]
Tensor.__copy__ = _tensor_copy  # type: ignore[attr-defined]
Tensor.cuda = _tensor_cuda  # type: ignore[attr-defined]
Tensor.pin_memory = _tensor_pin_memory  # type: ignore[attr-defined]
Tensor.is_pinned = _tensor_is_pinned  # type: ignore[attr-defined]
# ==== end of the PyTorch-port block =================================================================

_dispatch.Tensor = Tensor  # type: ignore[attr-defined]
_promote.Tensor = Tensor  # type: ignore[attr-defined]

# bound here, below Tensor, because both import this module: a function-level import costs ~1.5 us per call
# on the per-op path
from . import _autograd, _inplace  # noqa: E402
