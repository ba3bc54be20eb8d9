"""The optimizers' per-parameter updates as single fused kernels: Adam/AdamW and SGD with momentum.

Each update is one in-place pass over a parameter, its gradient and its state (the moments, the momentum
buffer), where the numpy twin makes 8-12 numpy calls (each ~1 us of fixed cost holding the GIL, which is
most of the update of a parameter of a few hundred elements). The compiled kernels loop over flat 1-D views
of the arrays in memory order; they compute in the arrays' dtype (float32 stays float32: each hyper-parameter
is passed as a float64 and rounded to the dtype once, as numpy rounds a Python float operand) with the numpy
code's operations in its order, so both give the same results up to float32 rounding (measured: bit for bit;
numpy's SIMD loops could fuse a multiply-add where the compiled loop rounds twice).

Arrays the compiled kernels cannot view flat together (another dtype than float32/float64, a state of
another layout than the parameter's, a non-dense view or negative strides) take the numpy twin; a gradient of
another layout is first copied into the parameter's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._jit import ENABLED, K

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

# ---- compiled ------------------------------------------------------------------------------------------


@K.register
def adam_step(p, g, m, v, vmax, first, amsgrad, maximize, decoupled,  # type: ignore[no-untyped-def]
              lr, wd, beta1, beta2, eps, step_size, bc2_sqrt):
    # 1-D arrays of one length (flattening them here instead stops LLVM vectorising the loop: 4x slower)
    t = p.dtype.type
    w = 1.0 - beta1  # lerp's weight, as `_lerp_numpy` takes one of two forms
    small_w = w < 0.5
    c_w = t(w) if small_w else t(1.0 - w)
    c_b2 = t(beta2)
    c_1b2 = t(1.0 - beta2)
    c_wd = t(wd)
    c_decay = t(1.0 - lr * wd)
    c_bc2 = t(bc2_sqrt)
    c_eps = t(eps)
    c_step = t(step_size)
    zero = t(0.0)
    has_wd = wd != 0.0
    for i in range(p.size):
        pi = p[i]
        d = -g[i] if maximize else g[i]
        if has_wd:
            if decoupled:
                pi = pi * c_decay
            else:
                d = d + c_wd * pi
        if first:
            mi = zero
            vi = zero
        else:
            mi = m[i]
            vi = v[i]
        if small_w:
            mi = mi + c_w * (d - mi)
        else:
            mi = d - (d - mi) * c_w
        vi = vi * c_b2
        vi = vi + c_1b2 * (d * d)
        m[i] = mi
        v[i] = vi
        if amsgrad:
            vm = zero if first else vmax[i]
            if not (vm != vm or vm >= vi):  # np.maximum: a NaN on either side wins
                vm = vi
            vmax[i] = vm
            den = np.sqrt(vm)
        else:
            den = np.sqrt(vi)
        den = den / c_bc2
        den = den + c_eps
        p[i] = pi - c_step * (mi / den)


@K.register
def sgd_momentum_step(p, g, b, first, maximize, nesterov,  # type: ignore[no-untyped-def]
                      lr, momentum, dampening, wd):
    t = p.dtype.type
    c_wd = t(wd)
    c_mom = t(momentum)
    c_damp = t(1.0 - dampening)
    c_nlr = t(-lr)
    has_wd = wd != 0.0
    undamped = dampening == 0.0
    for i in range(p.size):
        pi = p[i]
        d = -g[i] if maximize else g[i]
        if has_wd:
            d = d + c_wd * pi
        if first:
            bi = d
        else:
            bi = b[i] * c_mom
            if undamped:
                bi = bi + d
            else:
                bi = bi + c_damp * d
        b[i] = bi
        if nesterov:
            d = d + c_mom * bi
        else:
            d = bi
        p[i] = pi + c_nlr * d


def _flat_order(p: np.ndarray) -> tuple[int, ...] | None:
    """The axes of a dense ``p`` from the largest stride down (its memory order), or None when ``p`` is not
    dense with non-negative strides."""
    if p.ndim < 2:
        return None
    order = tuple(sorted(range(p.ndim), key=lambda i: -p.strides[i]))
    return order if p.transpose(order).flags.c_contiguous else None


def _flat(p: np.ndarray, g: np.ndarray, states: tuple[np.ndarray, ...]) -> list[np.ndarray] | None:
    """1-D views of ``p``, ``g`` and ``states`` in ``p``'s memory order, element for element; None when the
    compiled kernel cannot take them (the caller then runs the numpy twin). A gradient of another layout is copied into
    ``p``'s. The states must have ``p``'s layout and be writeable."""
    dt = p.dtype
    if dt not in _FLOATS or g.dtype != dt or g.shape != p.shape:
        return None
    shape = p.shape
    if p.flags.carray:  # the common case (C-contiguous, aligned, writeable): a few attribute reads an array
        for s in states:
            if not s.flags.carray or s.dtype != dt or s.shape != shape:
                return None
        if not g.flags.c_contiguous:
            g = np.ascontiguousarray(g)
        return [p.ravel(), g.ravel(), *[s.ravel() for s in states]]  # views (ravel: 0.08 us, reshape: 0.25)
    if not p.flags.writeable:
        return None
    order = _flat_order(p)
    if order is None:
        return None
    st = p.strides
    for s in states:
        if s.dtype != dt or s.strides != st or s.shape != shape or not s.flags.writeable:
            return None
    if g.strides != st:
        gc = np.empty_like(p)  # p's layout (numpy keeps a dense array's axis order)
        if gc.strides != st:
            return None
        np.copyto(gc, g)
        g = gc
    return [a.transpose(order).ravel() for a in (p, g, *states)]


def _adam_jit(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, vmax: np.ndarray | None,
              first: bool, maximize: bool, decoupled: bool, lr: float, wd: float, beta1: float, beta2: float,
              eps: float, step_size: float, bc2_sqrt: float) -> None:
    flat = _flat(p, g, (m, v) if vmax is None else (m, v, vmax))
    if flat is None:
        _adam_numpy(p, g, m, v, vmax, first, maximize, decoupled, lr, wd, beta1, beta2, eps, step_size, bc2_sqrt)
        return
    # (the flags are bools and the hyper-parameters floats as the optimizers pass them: another type, an
    # int, compiles one more specialisation with the same results)
    if vmax is None:
        K.adam_step(  # type: ignore[attr-defined]  # set by K.register at run time
            flat[0], flat[1], flat[2], flat[3], flat[3], first, False, maximize, decoupled, lr, wd, beta1,
            beta2, eps, step_size, bc2_sqrt)
    else:
        K.adam_step(  # type: ignore[attr-defined]
            flat[0], flat[1], flat[2], flat[3], flat[4], first, True, maximize, decoupled, lr, wd, beta1,
            beta2, eps, step_size, bc2_sqrt)


def _sgd_jit(p: np.ndarray, g: np.ndarray, b: np.ndarray, first: bool, maximize: bool, nesterov: bool,
             lr: float, momentum: float, dampening: float, wd: float) -> None:
    flat = _flat(p, g, (b,))
    if flat is None:
        _sgd_numpy(p, g, b, first, maximize, nesterov, lr, momentum, dampening, wd)
        return
    K.sgd_momentum_step(  # type: ignore[attr-defined]
        flat[0], flat[1], flat[2], first, maximize, nesterov, lr, momentum, dampening, wd)


# ---- numpy twins -----------------------------------------------------------------------------------------


def _lerp_numpy(a: np.ndarray, b: np.ndarray, w: float) -> None:
    """``a = a + w * (b - a)`` in place, evaluated like PyTorch's CPU ``lerp_``."""
    if w < 0.5:
        a += w * (b - a)
    else:
        np.subtract(b, (b - a) * (1.0 - w), out=a)


def _adam_numpy(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, vmax: Any, first: bool,
                maximize: bool, decoupled: bool, lr: float, wd: float, beta1: float, beta2: float, eps: float,
                step_size: float, bc2_sqrt: float) -> None:
    if first:
        m.fill(0)
        v.fill(0)
        if vmax is not None:
            vmax.fill(0)
    d = -g if maximize else g
    if wd != 0:
        if decoupled:
            p *= 1 - lr * wd
        else:
            d = d + wd * p
    _lerp_numpy(m, d, 1.0 - beta1)
    v *= beta2
    v += (1.0 - beta2) * (d * d)
    if vmax is not None:
        np.maximum(vmax, v, out=vmax)
        denom = np.sqrt(vmax)
    else:
        denom = np.sqrt(v)
    denom /= bc2_sqrt
    denom += eps
    p -= step_size * (m / denom)


def _sgd_numpy(p: np.ndarray, g: np.ndarray, b: np.ndarray, first: bool, maximize: bool, nesterov: bool,
               lr: float, momentum: float, dampening: float, wd: float) -> None:
    d = -g if maximize else g
    if wd != 0:
        d = d + wd * p
    if first:
        np.copyto(b, d)
    else:
        b *= momentum
        if dampening == 0.0:
            b += d
        else:
            b += (1.0 - dampening) * d
    d = d + momentum * b if nesterov else b
    np.add(p, -lr * d, out=p, casting="unsafe")


# ---- the selected implementations ------------------------------------------------------------------------

adam_update = _adam_jit if ENABLED else _adam_numpy
adam_update.__doc__ = """One Adam/AdamW step of parameter ``p`` in place (PyTorch's single-tensor update).

``g`` is the gradient; ``m``, ``v`` (and ``vmax`` for AMSGrad, else None) are the moment estimates, in
``p``'s layout, overwritten from zero on the ``first`` step. ``g`` is negated if ``maximize``; ``wd`` is
AdamW's decoupled decay (``p *= 1 - lr * wd``) when ``decoupled``, else Adam's L2 term (``g + wd * p``).
Then ``m = lerp(m, g, 1 - beta1)``, ``v = beta2 * v + (1 - beta2) * g * g``, ``vmax = max(vmax, v)`` and
``p -= step_size * m / (sqrt(vmax or v) / bc2_sqrt + eps)``, with ``step_size = lr / (1 - beta1**t)`` and
``bc2_sqrt = sqrt(1 - beta2**t)`` computed by the caller."""
sgd_momentum_update = _sgd_jit if ENABLED else _sgd_numpy
sgd_momentum_update.__doc__ = """One step of SGD with momentum of parameter ``p`` in place (PyTorch's
single-tensor update): ``d = -g if maximize else g``, plus ``wd * p``; the momentum buffer ``b`` (``p``'s
layout) becomes ``d`` on the ``first`` step, else ``momentum * b + (1 - dampening) * d``; then
``p -= lr * (d + momentum * b if nesterov else b)``."""
