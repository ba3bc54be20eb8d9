"""The fused optimizer updates (Adam/AdamW, SGD with momentum) compiled against their numpy twins.

Both implementations run in every process (the tests call ``_optim._adam_jit`` / ``_optim._adam_numpy`` and
the SGD pair directly), whatever ``ASYNCGRAD_JIT`` says. Bounds: float64 within 1e-12 relative; float32
within 4 ulps (``rtol=4 * eps32``, and ``atol`` 4 ulps of the values' scale for entries near zero). The
compiled loops do the twins' float32 operations in the twins' order with the hyper-parameters rounded to
float32 as numpy rounds a Python float, so in practice they agree bit for bit; the bound leaves room for a
multiply-add that numpy's SIMD loops or BLAS fuse where the loop rounds twice.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asyncgrad.kernels import _optim
from asyncgrad.kernels._jit import K

jit_only = pytest.mark.skipif(not _optim.ENABLED, reason="compiled kernels are off (ASYNCGRAD_JIT=0)")

EPS32 = float(np.finfo(np.float32).eps)
ULPS = 4.0
STEPS = 5
LAYOUTS = {"C": (7, 13), "F": (7, 13), "permuted": (3, 5, 4), "vector": (29,), "scalar": ()}


def _close(a: np.ndarray, b: np.ndarray, dtype: Any) -> None:
    if np.dtype(dtype) == np.float64:
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-300)
    else:
        scale = max(float(np.nanmax(np.abs(b))), 1.0) if b.size else 1.0
        np.testing.assert_allclose(a, b, rtol=ULPS * EPS32, atol=ULPS * EPS32 * scale)


def _in_layout(a: np.ndarray, layout: str) -> np.ndarray:
    """A copy of ``a`` in memory layout ``layout`` (a dense permuted one for "permuted")."""
    if layout == "F":
        return np.asfortranarray(a)
    if layout == "permuted":
        base = np.empty((a.shape[2], a.shape[0], a.shape[1]), a.dtype)
        out = base.transpose(1, 2, 0)
        out[...] = a
        assert not out.flags.c_contiguous and not out.flags.f_contiguous
        return out
    return np.array(a, order="C")


def _state(p: np.ndarray) -> np.ndarray:
    s = np.empty_like(p)  # p's layout, as the optimizer's state_like
    s.fill(np.nan)  # the first step must overwrite it
    return s


def _adam_run(fn: Callable[..., None], dtype: Any, layout: str, amsgrad: bool, maximize: bool, decoupled: bool,
              wd: float, beta1: float, grad_layout: str | None = None) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    shape = LAYOUTS[layout]
    p = _in_layout(rng.standard_normal(shape).astype(dtype), layout)
    m, v = _state(p), _state(p)
    vmax = _state(p) if amsgrad else None
    lr, beta2, eps = 1e-2, 0.999, 1e-8
    for step in range(1, STEPS + 1):
        g = _in_layout(rng.standard_normal(shape).astype(dtype), grad_layout or layout)
        step_size = lr / (1.0 - beta1**step)
        bc2_sqrt = math.sqrt(1.0 - beta2**step)
        fn(p, g, m, v, vmax, step == 1, maximize, decoupled, lr, wd, beta1, beta2, eps, step_size, bc2_sqrt)
    return [p, m, v] + ([vmax] if vmax is not None else [])


def _sgd_run(fn: Callable[..., None], dtype: Any, layout: str, maximize: bool, nesterov: bool, dampening: float,
             wd: float, grad_layout: str | None = None) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    shape = LAYOUTS[layout]
    p = _in_layout(rng.standard_normal(shape).astype(dtype), layout)
    b = _state(p)
    for step in range(1, STEPS + 1):
        g = _in_layout(rng.standard_normal(shape).astype(dtype), grad_layout or layout)
        fn(p, g, b, step == 1, maximize, nesterov, 0.05, 0.9, dampening, wd)
    return [p, b]


ADAM_FLAGS = list(itertools.product([False, True], [False, True], [False, True], [0.0, 0.1], [0.9, 0.3]))
SGD_FLAGS = [f for f in itertools.product([False, True], [False, True], [0.0, 0.5], [0.0, 0.1])
             if not (f[1] and f[2])]  # nesterov needs zero dampening


@jit_only
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adam_compiled_matches_the_twin(dtype: Any, layout: str) -> None:
    # every flag combination: amsgrad, maximize, AdamW's decoupled decay, weight decay, and both forms of
    # the moment's lerp (1 - beta1 below and above 0.5); the first step zero-fills the NaN-filled states
    for amsgrad, maximize, decoupled, wd, beta1 in ADAM_FLAGS:
        got = _adam_run(_optim._adam_jit, dtype, layout, amsgrad, maximize, decoupled, wd, beta1)
        want = _adam_run(_optim._adam_numpy, dtype, layout, amsgrad, maximize, decoupled, wd, beta1)
        for a, b in zip(got, want, strict=True):
            assert a.strides == b.strides
            assert np.isfinite(b).all()
            _close(a, b, dtype)


@jit_only
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sgd_momentum_compiled_matches_the_twin(dtype: Any, layout: str) -> None:
    # maximize, nesterov, dampening, weight decay; the first step copies d into the NaN-filled buffer
    for maximize, nesterov, dampening, wd in SGD_FLAGS:
        got = _sgd_run(_optim._sgd_jit, dtype, layout, maximize, nesterov, dampening, wd)
        want = _sgd_run(_optim._sgd_numpy, dtype, layout, maximize, nesterov, dampening, wd)
        for a, b in zip(got, want, strict=True):
            assert np.isfinite(b).all()
            _close(a, b, dtype)


@jit_only
@pytest.mark.parametrize("layout", ["C", "F", "permuted"])
def test_dense_layouts_take_the_compiled_kernel(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    want_a = _adam_run(_optim._adam_numpy, np.float32, layout, True, False, True, 0.1, 0.9)
    want_s = _sgd_run(_optim._sgd_numpy, np.float32, layout, False, True, 0.0, 0.1)

    def no_twin(*args: Any) -> None:
        raise AssertionError("took the numpy twin")

    monkeypatch.setattr(_optim, "_adam_numpy", no_twin)
    monkeypatch.setattr(_optim, "_sgd_numpy", no_twin)
    # also with a gradient of another layout than the parameter's (copied into the parameter's first)
    other = "C" if layout != "C" else "F"
    for grad_layout in (layout, other):
        for a, b in zip(_adam_run(_optim._adam_jit, np.float32, layout, True, False, True, 0.1, 0.9, grad_layout),
                        want_a, strict=True):
            _close(a, b, np.float32)
        for a, b in zip(_sgd_run(_optim._sgd_jit, np.float32, layout, False, True, 0.0, 0.1, grad_layout),
                        want_s, strict=True):
            _close(a, b, np.float32)


def test_what_the_compiled_kernels_cannot_view_flat_takes_the_twin() -> None:
    rng = np.random.default_rng(2)
    p = rng.standard_normal((6, 8)).astype(np.float32)
    g = rng.standard_normal((6, 8)).astype(np.float32)
    f_state = np.asfortranarray(np.zeros_like(p))
    assert _optim._flat(p, g, (f_state,)) is None  # a state of another layout than the parameter's
    assert _optim._flat(p[:, ::2], g[:, ::2], ()) is None  # not dense
    assert _optim._flat(p[::-1], g, ()) is None  # negative strides
    assert _optim._flat(p.astype(np.float16), g.astype(np.float16), ()) is None  # not float32/float64
    assert _optim._flat(p, g.astype(np.float64), ()) is None  # another dtype
    views = _optim._flat(p, g, (np.zeros_like(p),))
    assert views is not None and all(np.shares_memory(v, a) for v, a in zip(views, (p, g), strict=False))
    # the selected kernel on a state of another layout falls back to the twin, with the twin's result
    results = []
    for fn in (_optim.adam_update, _optim._adam_numpy):
        q, m, v = p.copy(), np.asfortranarray(np.zeros_like(p)), np.zeros_like(p)
        fn(q, g, m, v, None, True, False, False, 1e-2, 0.0, 0.9, 0.999, 1e-8, 0.1, math.sqrt(0.001))
        results.append(q)
    np.testing.assert_array_equal(results[0], results[1])


@jit_only
def test_adam_amsgrad_propagates_nan_as_the_twin() -> None:
    g = np.array([1.0, np.nan, -2.0, np.inf], np.float32)
    out = []
    for fn in (_optim._adam_jit, _optim._adam_numpy):
        p, m, v, vm = np.ones(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)
        vm[0] = np.nan
        with np.errstate(invalid="ignore"):  # inf / inf in the twin
            fn(p, g, m, v, vm, False, False, False, 1e-2, 0.0, 0.9, 0.999, 1e-8, 0.1, 0.05)
        out.append((p, m, v, vm))
    for a, b in zip(*out, strict=True):
        np.testing.assert_array_equal(a, b)  # NaN where the twin has NaN


@jit_only
def test_the_compiled_optimizer_kernels_release_the_gil() -> None:
    _adam_run(_optim._adam_jit, np.float32, "C", False, False, False, 0.0, 0.9)
    _sgd_run(_optim._sgd_jit, np.float32, "C", False, False, 0.0, 0.0)
    for name in ("adam_step", "sgd_momentum_step"):
        disp = getattr(K, name)
        assert disp.targetoptions.get("nogil") is True, name
        assert type(disp._cache).__name__ != "NullCache", name  # cached on disk
    # two threads, each updating its own large parameter at once, both complete with the twin's result
    n = 1 << 20
    rng = np.random.default_rng(3)
    ps = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    want = []
    for p, g in zip(ps, gs, strict=True):
        q, m, v = p.copy(), np.empty_like(p), np.empty_like(p)
        _optim._adam_numpy(q, g, m, v, None, True, False, True, 1e-3, 0.01, 0.9, 0.999, 1e-8, 1e-2, 0.0316)
        want.append(q)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            m, v = np.empty_like(ps[i]), np.empty_like(ps[i])
            _optim._adam_jit(ps[i], gs[i], m, v, None, True, False, True, 1e-3, 0.01, 0.9, 0.999, 1e-8, 1e-2,
                             0.0316)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    for p, w in zip(ps, want, strict=True):
        _close(p, w, np.float32)


@jit_only
async def test_adam_and_sgd_optimizers_run_the_compiled_kernels() -> None:
    import asyncgrad as ag

    async with ag.open_runtime():
        w = ag.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), requires_grad=True)
        for opt in (ag.optim.AdamW([w], lr=1e-2, amsgrad=True),
                    ag.optim.SGD([w], lr=1e-2, momentum=0.9, nesterov=True)):
            w.grad = ag.tensor(np.full((3, 4), 0.5, np.float32))
            opt.step()
        assert np.isfinite(w.numpy()).all()
    assert {"adam_step", "sgd_momentum_step"} <= set(K.compiled)
