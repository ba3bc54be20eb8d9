"""In-place updates in stream order (optimizer steps, `.grad` accumulation, zeroing).

An in-place kernel runs on the calling task's stream after the work that produced the tensor and its
operands; the tensor is then pending on that stream until the kernel completes.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..devices import INLINE_MAX_ELEMENTS, add_scaled
from . import _capture, _grad_mode
from ._dispatch import wait_for
from ._meta import check_int_div
from ._runtime import current_stream
from ._tensor import Tensor, is_ready, views_pending


def inplace(t: Tensor, fn: Callable[..., Any], *others: Any, write: bool = True) -> Tensor:
    """Apply ``fn(t_array, *other_arrays)`` to ``t``'s array in place, in stream order; returns ``t``.

    Every write bumps ``t``'s version counter (PyTorch's; the one place that does, shared with t's views), so a backward
    node that saved ``t`` sees the change; ``write=False`` for a kernel that only reads ``t``.
    """
    rec = _capture.active
    if rec is not None and rec.wants():  # a compiled step records (`autograd._compile`)
        return rec.inplace(t, fn, others, write)  # type: ignore[no-any-return]
    for o in others:
        if isinstance(o, Tensor) and o._dev is not t._dev:
            raise RuntimeError(
                f"in-place update of a tensor on {t._dev} with a tensor on {o._dev}; move it with .to() first"
            )
    if write:
        vc = t._vc
        if vc is None:
            t._vc = [1]
        else:
            vc[0] += 1  # the cell is shared with t's views and base
    stream = current_stream(t._dev)
    ready = is_ready(t) and all(is_ready(o) for o in others if isinstance(o, Tensor))
    if ready and stream.query() and ((n := t.numel()) <= INLINE_MAX_ELEMENTS or n <= t._dev.shared_inline_max):
        fn(t._value(), *[o._value() if isinstance(o, Tensor) else o for o in others])
        return t
    wait_for(t, stream)
    for o in others:
        if isinstance(o, Tensor):
            wait_for(o, stream)

    def job() -> None:
        fn(t._data, *[o._data if isinstance(o, Tensor) else o for o in others])

    t._seq = stream.submit(job)
    t._stream = stream
    if write and len(t._vc) > 1:  # type: ignore[arg-type]  # (views share the memory: see `share_version`)
        views_pending(t, stream, t._seq)
    return t


def scaled_update(p: Tensor, tmp: Tensor, ufunc: Any, decided: list[bool] | None = None) -> Tensor | None:
    """``p += tmp`` / ``p -= tmp`` where ``tmp = k * g`` is queued and nothing was queued after it: take its
    kernel over and update ``p`` in one pass (BLAS axpy), unless ``tmp`` turns out to be used elsewhere.

    The optimizer step users write by hand (``p -= lr * p.grad``) otherwise writes and reads back a whole
    temporary per parameter. Whether ``tmp`` is needed is decided in the kernel, when all the references
    there will ever be to it exist: if anything but the kernel still holds it, it is computed as before.
    Returns None (nothing done) when the pattern does not apply. ``decided``, if given, gets True appended
    when the kernel ran the one-pass update and False when it computed ``tmp`` (a compiled step's replay
    repeats what its recording did).
    """
    g, k = tmp.__dict__["_scaled"]
    stream = tmp._stream
    if (
        (ufunc is not np.add and ufunc is not np.subtract)
        or stream is None
        or tmp._seq != stream.submitted  # a later kernel may read tmp
        or stream.is_done(tmp._seq)  # computed already
        or p._shape != tmp._shape
        or p._dtype is not tmp._dtype
        or p._dev is not tmp._dev
        or stream is not current_stream(p._dev)
    ):
        return None
    alpha = -k if ufunc is np.subtract else k
    tmp._defer = True  # its kernel returns at once (or, already started, computes tmp: handled below)
    box = [tmp]

    def update(a: np.ndarray, garr: np.ndarray, box: list[Tensor]) -> None:
        t = box.pop()
        d = t._data
        # refs to t: `t` and getrefcount's argument, if nothing else (a user's variable) holds it
        if d is None and sys.getrefcount(t) > 2:
            d = t._data = np.multiply(garr, k)
        if d is not None:
            ufunc(a, d, out=a, casting="unsafe")
        else:
            add_scaled(a, alpha, garr)
        if decided is not None:
            decided.append(d is None)

    inplace(p, update, g, box)
    tmp._seq = p._seq  # tmp is pending until the update: it may compute it
    return p


# ---- the in-place Tensor methods (bound in `asyncgrad._tensor_methods`) ----------------------------------
# ---- in-place helpers used by optimizers and zero_grad ---------------------------------------

def zero_(self: Tensor) -> Tensor:
    check_inplace(self, "zero_")
    return inplace(self, lambda a: a.fill(0))

def fill_(self: Tensor, value: builtins.float) -> Tensor:
    check_inplace(self, "fill_")
    return inplace(self, lambda a: a.fill(value))

def copy_(self: Tensor, src: Tensor | np.ndarray) -> Tensor:
    check_inplace(self, "copy_", src)
    return inplace(self, lambda a, s: np.copyto(a, s), src)

def add_(self: Tensor, other: Any, *, alpha: builtins.float = 1.0) -> Tensor:
    check_inplace(self, "add_", other)
    if alpha == 1.0:
        return inplace(self, lambda a, o: np.add(a, o, out=a, casting="unsafe"), other)
    return inplace(self, lambda a, o: add_scaled(a, alpha, o), other)

def mul_(self: Tensor, other: Any) -> Tensor:
    check_inplace(self, "mul_", other)
    return inplace(self, lambda a, o: np.multiply(a, o, out=a, casting="unsafe"), other)

def sub_(self: Tensor, other: Any, *, alpha: builtins.float = 1.0) -> Tensor:
    return add_(self, other, alpha=-alpha)

def iadd(self: Tensor, other: Any) -> Tensor:
    return _iop(self, other, np.add, "add")

def isub(self: Tensor, other: Any) -> Tensor:
    return _iop(self, other, np.subtract, "sub")

def imul(self: Tensor, other: Any) -> Tensor:
    return _iop(self, other, np.multiply, "mul")

def itruediv(self: Tensor, other: Any) -> Tensor:
    return _iop(self, other, np.true_divide, "div")

def _iop(self: Tensor, other: Any, ufunc: Any, name: str) -> Tensor:
    check_inplace(self, name, other)
    if type(other) is Tensor and other._defer is False and "_scaled" in other.__dict__:
        # `p -= lr * g`: one pass over memory, without the temporary, when `lr * g` is not used elsewhere
        rec = _capture.active
        if rec is not None and rec.wants():  # a compiled step records: its replay makes the same choice
            done = rec.scaled_update(self, other, ufunc, scaled_update)
        else:
            done = scaled_update(self, other, ufunc)
        if done is not None:
            return done
    return inplace(self, lambda a, o: ufunc(a, o, out=a, casting="unsafe"), other)


def check_inplace(self: Tensor, name: str, *values: Any) -> None:
    d = self._data
    if d is not None and not d.flags.writeable:
        _refuse_readonly(self, name, d)
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


def _refuse_readonly(t: Tensor, name: str, d: np.ndarray) -> None:
    if any(st == 0 and n > 1 for st, n in zip(d.strides, d.shape)):
        # PyTorch's error: an expanded tensor's elements share memory
        raise RuntimeError(
            f"in-place {name} on a tensor of shape {t._shape} in which more than one element refers to a single "
            "memory location (an expand() or broadcast view); clone() the tensor before the in-place operation"
        )
    raise RuntimeError(
        f"in-place {name} on a read-only tensor of shape {t._shape} (a read-only array it wraps); clone() it first"
    )


def unary_(name: str, ufunc: Any) -> Callable[[Tensor], Tensor]:
    """The in-place method ``name`` (``exp_``, ...): ``ufunc`` applied to the tensor's own array."""

    def method(self: Tensor) -> Tensor:
        check_inplace(self, name)
        return inplace(self, lambda a: ufunc(a, out=a, casting="unsafe"))

    method.__name__ = method.__qualname__ = name
    return method


def sigmoid_(self: Tensor) -> Tensor:
    check_inplace(self, "sigmoid_")

    def f(a: np.ndarray) -> None:
        np.negative(a, out=a)
        np.exp(a, out=a)
        np.add(a, 1, out=a, casting="unsafe")
        np.reciprocal(a, out=a)

    return inplace(self, f)

def relu_(self: Tensor) -> Tensor:
    check_inplace(self, "relu_")
    return inplace(self, lambda a: np.maximum(a, 0, out=a, casting="unsafe"))

def clamp_(self: Tensor, min: Any = None, max: Any = None) -> Tensor:
    check_inplace(self, "clamp_")
    if min is None and max is None:
        raise ValueError("clamp_: at least one of min and max must be given")
    return inplace(self, lambda a: np.clip(a, min, max, out=a, casting="unsafe"))

def div_(self: Tensor, other: Any) -> Tensor:
    return _iop(self, other, np.true_divide, "div_")

def pow_(self: Tensor, other: Any) -> Tensor:
    return _iop(self, other, np.power, "pow_")


def masked_fill_(self: Tensor, mask: Any, value: Any) -> Tensor:
    check_inplace(self, "masked_fill_")
    return inplace(self, lambda a, m: np.copyto(a, value, casting="unsafe", where=m), mask)



def addcmul_(self: Tensor, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Tensor:
    check_inplace(self, "addcmul_", tensor1, tensor2)
    return inplace(
        self, lambda a, t1, t2: np.add(a, value * (t1 * t2), out=a, casting="unsafe"), tensor1, tensor2
    )



def addcdiv_(self: Tensor, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Tensor:
    check_inplace(self, "addcdiv_", tensor1, tensor2)
    check_int_div("addcdiv_", tensor1, tensor2)
    return inplace(
        self, lambda a, t1, t2: np.add(a, value * (t1 / t2), out=a, casting="unsafe"), tensor1, tensor2
    )
