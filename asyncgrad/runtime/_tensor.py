"""The Tensor: an array on a device whose value may still be computing on a stream."""

from __future__ import annotations

import builtins
import copy
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ..devices import Device, Stream
from . import _capture
from ._row_support import handed_out
from ._runtime import _task_streams, current_runtime
from ._sync_access import blocking_wait

_INDEX_TYPES = (int, slice, type(None), type(Ellipsis), np.integer)


def _cast_method(dtype: Any) -> Callable[[Tensor], Tensor]:
    """A Tensor method returning the tensor converted to ``dtype`` (``float``, ``long``, ...)."""

    def cast(self: Tensor) -> Tensor:
        return self.to(dtype=dtype)

    cast.__doc__ = f"This tensor converted to {np.dtype(dtype).name}."
    return cast


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
    # backward of nodes that saved this tensor. Views share their base's cell (`share_version`),
    # so a write through any of them is seen. Made on first write or view (in __dict__), so new tensors cost
    # nothing; `_version` reads it
    _vc: list[Any] | None = None  # [version, weakrefs of the tensors sharing the memory...]
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

    if TYPE_CHECKING:  # bound in `asyncgrad._tensor_methods`, from the op families and autograd
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
        rec = _capture.active
        if rec is not None and rec.wants():
            rec.grad_set(self)
        self._grad = value

    @property
    def retains_grad(self) -> bool:
        return self._retains_grad

    # ---- values ----------------------------------------------------------------------------------

    def _value(self) -> np.ndarray:
        rec = _capture.active
        if rec is not None and rec.wants():  # a compiled step records: a value read on the host
            rec.host_read(self)
        s = self._stream
        if s is not None and s.completed < self._seq:
            seq = self._seq
            blocking_wait(lambda: s.synchronize_blocking(seq))
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
            if s is not None and s.completed < s.submitted:
                blocking_wait(s.synchronize_blocking)
        handed_out(data)  # writes through it are not versioned: its memory is not recycled (`_row_support`)
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
        return is_ready(self)

    def value_if_ready(self) -> np.ndarray | None:
        """A read-only view of the value if it is computed, else None; never waits.

        Nothing queued writes to a ready value (an in-place op makes its tensor pending), so reading the
        view now is safe; kernels queued later may still read this memory, hence read-only.
        """
        if not is_ready(self):
            return None
        view = self._data.view()  # type: ignore[union-attr]  # is_ready: an array
        view.flags.writeable = False
        return view

    async def ready(self) -> Tensor:
        """Wait, without blocking the event loop, until this tensor's value is computed; returns the tensor.

        The async way to read a value, as PyTorch code reads it: ``(await loss.ready()).item()``,
        ``float(await loss.ready())``, ``(await t.ready()).tolist()``. The sync accessors wait on the
        calling thread, which on the event loop stalls every other task; when they do for more than a
        few ms they warn (`SyncAccessWarning`, once per call site).
        """
        s = self._stream
        if s is not None and s.completed < self._seq:
            await s.synchronize(self._seq)
        else:
            await trio.lowlevel.checkpoint()
            if s is not None:
                s.check_error()
        return self

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.numpy()
        if type(a) is not np.ndarray:  # a 0-d result some kernels give as a numpy scalar
            a = np.asarray(a)
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

    def detach_(self) -> Tensor:
        self._grad_fn = None
        self._rg = False
        return self

    float = _cast_method(np.float32)
    double = _cast_method(np.float64)
    half = _cast_method(np.float16)
    long = _cast_method(np.int64)
    int = _cast_method(np.int32)
    bool = _cast_method(np.bool_)

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

    def cpu(self) -> Tensor:
        """This tensor on the default CPU device (itself when it is there already)."""
        return self.to("cpu")

    def is_contiguous(self) -> builtins.bool:
        """Whether the value is C-contiguous (waits for the value)."""
        return builtins.bool(self._value().flags.c_contiguous)

    def _set_data(self, value: Tensor) -> None:
        """The setter of `data` (bound with its getter in `asyncgrad._tensor_methods`)."""
        # PyTorch swaps the storage under the tensor, keeping its autograd identity
        if not isinstance(value, Tensor):
            raise TypeError(f"data must be set to a Tensor, got {type(value).__name__}")
        if value._dev is not self._dev:
            raise RuntimeError(f"data: the new value is on {value._dev}, this tensor on {self._dev}")
        arr = value._value()
        self._data, self._shape, self._dtype, self._stream = arr, arr.shape, arr.dtype, None

    # ---- copies (copy.copy / copy.deepcopy, as PyTorch's) and CUDA-port names ------------------------------

    def __deepcopy__(self, memo: dict[builtins.int, Any]) -> Tensor:
        if self._grad_fn is not None:
            raise RuntimeError(_DEEPCOPY_NONLEAF)
        done = memo.get(id(self))
        if done is not None:
            return done  # type: ignore[no-any-return]
        # order="K" keeps a dense layout's strides (channels-last stays channels-last)
        new = Tensor._wrap(np.array(self._value(), copy=True, order="K"), self._dev)
        new._rg = self._rg
        memo[id(self)] = new
        if self._grad is not None:
            new._grad = copy.deepcopy(self._grad, memo)
        _copy_extras(self, new, memo)
        return new

    def __copy__(self) -> Tensor:
        # PyTorch's copy.copy: a new leaf sharing the memory (and so the version counter), requires_grad
        # kept, no .grad
        new = Tensor._wrap(self._value(), self._dev)
        share_version(self, new)
        new._rg = self._rg
        _copy_extras(self, new, None)
        return new

    def cuda(self, device: Any = None, non_blocking: builtins.bool = False) -> Tensor:
        """This tensor on a CUDA device (``device``: an index, a name or a device; default the first).

        Raises the runtime's clear error when asyncgrad has no CUDA device (no cupy or no GPU).
        """
        if device is None:
            device = "cuda"
        elif isinstance(device, builtins.int):
            device = f"cuda:{device}"
        return self.to(device, non_blocking=non_blocking)  # type: ignore[no-any-return]

    def pin_memory(self, device: Any = None) -> Tensor:
        """Accepted for PyTorch programs: there is no CUDA device to pin for, so this is the tensor itself."""
        return self

    def is_pinned(self, device: Any = None) -> builtins.bool:
        return False

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


_DEEPCOPY_NONLEAF = (
    "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at the "
    "moment. If you were attempting to deepcopy a module, this may be because of a torch.nn.utils."
    "weight_norm usage, see https://github.com/pytorch/pytorch/pull/103001"
)
# user attributes and the parameter mark travel with copies; autograd bookkeeping does not
_COPIED_PRIVATE = frozenset({"_is_param"})


def _copy_extras(src: Tensor, dst: Tensor, memo: dict[builtins.int, Any] | None) -> None:
    for k, v in src.__dict__.items():
        if k in _COPIED_PRIVATE or not k.startswith("_"):
            dst.__dict__[k] = v if memo is None else copy.deepcopy(v, memo)


def _size(size: tuple[Any, ...]) -> tuple[int, ...]:
    """Sizes given as ``f(2, 3)`` or ``f((2, 3))``."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    return tuple(builtins.int(n) for n in size)


def is_ready(t: Tensor) -> builtins.bool:
    """Whether ``t``'s value is computed: it has an array, and the kernel writing it (if any) has completed.

    The one readiness test of a tensor (kernels decide by it whether to run inline or queue behind).
    """
    s = t._stream
    return t._data is not None and (s is None or s.completed >= t._seq)


def share_version(base: Any, view: Any) -> None:
    """``view`` shares ``base``'s memory: give it ``base``'s version counter (PyTorch's views), so an in-place
    write through either one is seen by a backward that saved the other."""
    vc = base._vc
    if vc is None:
        vc = base._vc = [0, weakref.ref(base)]
    elif len(vc) == 1:
        vc.append(weakref.ref(base))
    elif len(vc) > 64:  # (the views that died)
        vc[1:] = [r for r in vc[1:] if r() is not None]
    # the cell also lists who shares the memory: a queued in-place write marks them all pending
    vc.append(weakref.ref(view))
    view._vc = vc


def views_pending(t: Tensor, stream: Any, seq: int) -> None:
    """A write to ``t``'s memory is queued as ``seq`` on ``stream``: the tensors sharing that memory (views,
    their base) are pending until it ran, so reading them waits for it and an op on them queues behind it."""
    for r in t._vc[1:]:  # type: ignore[index]
        o = r()
        if o is None or o is t:
            continue
        s = o._stream
        # (on another stream, a view still being made keeps waiting for its own kernel only)
        if s is stream or (o._data is not None and (s is None or s.completed >= o._seq)):
            o._stream = stream
            o._seq = seq
