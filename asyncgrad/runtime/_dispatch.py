"""The forward dispatcher: record an op (meta first), then run its kernel inline or queue it on a stream.

`apply` runs an op on its arguments: tiny kernels whose inputs are ready run inline on the calling thread
(a hand-off would cost more than the kernel); others are queued on the calling task's stream, and the
result is a pending tensor. `apply1` / `apply2` are its fast paths for elementwise ops. If an input
requires grad and grad mode is on, the op's backward node (`OpNode`) is recorded on the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..devices import HOST_CACHE_MIN_BYTES, INLINE_MAX_ELEMENTS, SHARED_INLINE_MAX_MACS, Stream, lane_empty
from . import _capture, _grad_mode
from ._node import OpNode
from ._op import _FLOAT_DTYPES, EMPTY, Op, OpError
from ._runtime import _NO_RUNTIME, NoRuntimeError, _current, current_stream
from ._tensor import Tensor, is_ready, share_version

# bound once: `Tensor._wrap` looked up per op makes a bound-method object each time (a classmethod)
_wrap = Tensor._wrap


def _no_runtime(op: Op) -> None:
    raise NoRuntimeError(_NO_RUNTIME.format(what=op.name))


def apply(op: Op, args: tuple[Any, ...], kw: dict[str, Any] = EMPTY) -> Any:
    """Run ``op`` on ``args``: inline when tiny and its inputs are ready, else queued on the task's stream."""
    rec = _capture.active
    if rec is not None and rec.wants():  # a compiled step records (`autograd._compile`)
        return rec.apply(op, args, kw)
    rt = _current.get()
    if rt is None or rt.closed:
        _no_runtime(op)
    T = Tensor
    dev = None
    ready = True
    rg = False
    for a in args:
        if isinstance(a, T):
            if dev is None:
                dev = a._dev
            elif a._dev is not dev:
                _device_mismatch(op, args)
            # no array on a completed stream: its kernel was dropped (a failed stream, a closing runtime)
            if not is_ready(a):
                ready = False
            if a._rg:
                rg = True
    if dev is None:
        raise TypeError(f"{op.name}: expected at least one Tensor argument")
    shape, dtype = op.meta(*args, **kw)
    kernel = _cast_kernel(op.kernel, args, dtype) if op.cast_in else op.kernel
    stream = None
    # inline needs only ready inputs: a new output cannot race with queued work (in-place updates mark
    # their tensor pending, so readers of it queue behind them)
    n = math.prod(shape)
    if ready and (n <= INLINE_MAX_ELEMENTS or (n <= dev.shared_inline_max and shared_inline_ok(op, args, n, kw))):
        res = kernel(*[a._data if isinstance(a, T) else a for a in args], **kw)
        # the meta dtype is the result's (PyTorch's promotion), whatever numpy would have given
        rd = res.dtype
        if rd is not dtype and rd != dtype:
            res = res.astype(dtype)
        out = T._wrap(res, dev)
    else:
        stream = current_stream(dev)
        out = _enqueue(op, kernel, args, kw, shape, dtype, dev, stream, T)
    if op.view:
        share_version(args[0], out)
    if rg and op.rule is not None and _grad_mode._grad_enabled.get():
        node = OpNode(op, args, kw, stream)
        if op.save_out:
            node.out = out
        out._grad_fn = node
        out._rg = True
    return out


# never run on the calling thread beside other trainings, however small their tensors: their cost is
# not bounded by the elements they read and write (or they leave the process, or draw random numbers)
_SHARED_INLINE_NEVER = frozenset(
    {"dropout", "einsum", "recurrent_layer", "rpc_stage", "scaled_dot_product_attention", "to"}
)  # fmt: skip


def shared_inline_ok(op: Op, args: tuple[Any, ...], n: int, kw: dict[str, Any]) -> bool:
    """Whether ``op`` on ready ``args`` (an output of ``n`` elements, at most the device's shared bound)
    may run inline while several tasks share the device: every tensor input within the bound too, and an
    op with a ``work`` count (`Op.work`) within `SHARED_INLINE_MAX_MACS` (see
    `devices.SHARED_INLINE_MAX_ELEMENTS`)."""
    name = op.name
    if name in _SHARED_INLINE_NEVER:
        return False
    limit = 0
    for a in args:
        if isinstance(a, Tensor):
            d = a._data
            if d is None:
                return False
            limit = a._dev.shared_inline_max
            if d.size > limit:
                return False
    work = op.work
    if work is not None:
        return isinstance(args[0], Tensor) and work(args, n, kw) <= SHARED_INLINE_MAX_MACS
    return limit > 0


_SCALARS = (int, float, bool)
_INT_SCALARS = (int, bool)


def _cast_kernel(kernel: Callable[..., Any], args: tuple[Any, ...], dtype: np.dtype[Any]) -> Callable[..., Any]:
    """``kernel``, computing in ``dtype``: array (and numpy scalar) operands of another dtype are cast first.

    Python numbers stay as they are (numpy treats them as weakly typed, like PyTorch's wrapped numbers)."""
    for a in args:
        if type(a) in _SCALARS:
            continue
        d = a._dtype if isinstance(a, Tensor) else getattr(a, "dtype", None)
        if d is not None and d is not dtype and d != dtype:
            break
    else:
        return kernel
    if isinstance(kernel, np.ufunc):
        # "unsafe": a lower-priority operand converts even across kinds (uint8 tensor + zero-dim int8
        # is uint8 in PyTorch, the int8 value wrapping), as PyTorch's conversion does
        ufunc = kernel
        return lambda *xs, **kw: ufunc(*xs, dtype=dtype, casting="unsafe", **kw)

    def cast(*xs: Any, **kw: Any) -> Any:
        return kernel(
            *[x.astype(dtype) if isinstance(x, (np.ndarray, np.generic)) and x.dtype != dtype else x for x in xs],
            **kw,
        )

    return cast


def apply1(op: Op, a: Any) -> Any:
    """`apply` for a unary elementwise op (the hot path of small graphs)."""
    if _capture.active is not None:
        return apply(op, (a,))
    rt = _current.get()
    if rt is None or rt.closed:
        _no_runtime(op)
    data = a._data
    s = a._stream
    # `is_ready(a)` written out on this path and below: a call per operand costs ~3% of W2's per-node time
    if (
        (s is None or s.completed >= a._seq)
        and data is not None
        and ((n := data.size) <= INLINE_MAX_ELEMENTS or n <= a._dev.shared_inline_max)
        and (op.any_kind or a._dtype in op.fast_dtypes)  # else the meta decides (sqrt of an int: float32)
    ):
        out = _wrap(op.kernel(data), a._dev)
        if a._rg and op.rule is not None and _grad_mode._grad_enabled.get():
            node = OpNode.__new__(OpNode)
            node._fast1(op, a)
            if op.save_out:
                node.out = out
            out._grad_fn = node
            out._rg = True
        return out
    return apply(op, (a,))


def apply2(op: Op, a: Any, b: Any) -> Any:
    """`apply` for a binary elementwise op: inline when both operands are ready, small and same-shaped,
    of one dtype (or a tensor and a Python number) for which numpy's result dtype is PyTorch's."""
    if _capture.active is not None:
        return apply(op, (a, b))
    rt = _current.get()
    if rt is None or rt.closed:
        _no_runtime(op)
    T = Tensor
    if type(a) is T:
        if type(b) is T:
            if (
                a._shape == b._shape
                and a._dtype is b._dtype
                and (op.any_kind or a._dtype in op.fast_dtypes)
                and a._dev is b._dev
                and (a._stream is None or a._stream.completed >= a._seq)
                and (b._stream is None or b._stream.completed >= b._seq)
                and a._data is not None
                and b._data is not None
                and ((n := a._data.size) <= INLINE_MAX_ELEMENTS or n <= a._dev.shared_inline_max)
            ):
                out = _wrap(op.kernel(a._data, b._data), a._dev)
                if (a._rg or b._rg) and op.rule is not None and _grad_mode._grad_enabled.get():
                    node = OpNode.__new__(OpNode)
                    node._fast2t(op, a, b)
                    out._grad_fn = node
                    out._rg = True
                return out
        elif type(b) in _SCALARS:
            if (
                (a._stream is None or a._stream.completed >= a._seq)
                and a._data is not None
                and ((n := a._data.size) <= INLINE_MAX_ELEMENTS or n <= a._dev.shared_inline_max)
                and (a._dtype in _FLOAT_DTYPES or _scalar_fast(op, a._dtype.kind, b))
            ):
                out = _wrap(op.kernel(a._data, b), a._dev)
                if a._rg and op.rule is not None and _grad_mode._grad_enabled.get():
                    node = OpNode.__new__(OpNode)
                    node._fast2s(op, a, b)
                    out._grad_fn = node
                    out._rg = True
                return out
    elif type(b) is T and type(a) in _SCALARS:
        if (
            (b._stream is None or b._stream.completed >= b._seq)
            and b._data is not None
            and ((n := b._data.size) <= INLINE_MAX_ELEMENTS or n <= b._dev.shared_inline_max)
            and (b._dtype in _FLOAT_DTYPES or _scalar_fast(op, b._dtype.kind, a))
        ):
            out = _wrap(op.kernel(a, b._data), b._dev)
            if b._rg and op.rule is not None and _grad_mode._grad_enabled.get():
                out._grad_fn = OpNode(op, (a, b), EMPTY, None)
                out._rg = True
            return out
    return apply(op, (a, b))


def _scalar_fast(op: Op, kind: str, x: Any) -> bool:
    """Whether numpy gives PyTorch's dtype for a tensor of a non-float dtype kind and a Python number:
    only an int or bool number with an int or bool tensor (int + 0.5 is float32 in PyTorch, float64 in
    numpy; a float tensor, tested first, meets any Python number as itself)."""
    return kind in op.fast_kinds and (kind == "c" or type(x) in _INT_SCALARS)


def _enqueue(
    op: Op,
    kernel: Callable[..., Any],
    args: tuple[Any, ...],
    kw: dict[str, Any],
    shape: tuple[int, ...],
    dtype: Any,
    dev: Any,
    stream: Stream,
    T: type[Tensor],
) -> Tensor:
    for a in args:
        if isinstance(a, T):
            wait_for(a, stream)
    out = T._pending(shape, dtype, dev, stream)
    if op.fills_out and math.prod(shape) * dtype.itemsize >= HOST_CACHE_MIN_BYTES:

        def job() -> None:
            if out._defer:  # an in-place update took this kernel over (`_inplace.scaled_update`)
                return
            arrays = [a._data if isinstance(a, T) else a for a in args]
            # only where the ufunc would compute in `dtype` and give a C-ordered result anyway
            if all(x.dtype == dtype and x.flags.c_contiguous for x in arrays if isinstance(x, np.ndarray)):
                out._data = kernel(*arrays, out=lane_empty(shape, dtype), **kw)
                return
            res = kernel(*arrays, **kw)
            out._data = res if res.dtype == dtype else res.astype(dtype)

    else:

        def job() -> None:
            res = kernel(*[a._data if isinstance(a, T) else a for a in args], **kw)
            if res.dtype != dtype:
                res = res.astype(dtype)
            out._data = res

    out._seq = stream.submit(job)
    return out


def wait_for(t: Tensor, stream: Stream) -> None:
    """Order ``stream`` after the pending work that produces ``t`` (a cross-stream event, if needed)."""
    s = t._stream
    if s is not None and s is not stream and not s.is_done(t._seq):
        if s.device is not stream.device:
            s.synchronize_blocking(t._seq)  # cross-device: host-side wait (rare)
        else:
            stream.wait_event(s.record_event())


def _device_mismatch(op: Op, args: tuple[Any, ...]) -> None:
    T = Tensor
    devs = [str(a.device) for a in args if isinstance(a, T)]
    shapes = [tuple(a.shape) for a in args if isinstance(a, T)]
    raise OpError(
        f"{op.name}: expected all tensors on one device, got devices {devs} (shapes {shapes}); "
        "move them with .to(device) first"
    )


# ---- meta helpers shared by the op families ----------------------------------------------------------


