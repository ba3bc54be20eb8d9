"""Tensor factories: from data, filled, ranges and random numbers."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import _capture, _promote
from ._lane_factories import big, child_generator, copy_on_lane, on_lane
from ._runtime import current_runtime
from ._tensor import Tensor

_default_dtype = np.dtype(np.float32)
_rng_local = threading.local()


def set_default_dtype(dtype: Any) -> None:
    """Set the dtype that floating point factories and Python floats use (default float32, like PyTorch)."""
    global _default_dtype
    d = np.dtype(dtype)
    if d.kind != "f":
        raise TypeError(f"the default dtype must be a floating point dtype, got {d}")
    _default_dtype = d
    _promote.set_default_float(d)


def get_default_dtype() -> np.dtype[Any]:
    return _default_dtype


def manual_seed(seed: int) -> np.random.Generator:
    """Seed this thread's default generator (used by randn/rand/dropout when no generator is given)."""
    _rng_local.gen = np.random.default_rng(seed)
    return _rng_local.gen  # type: ignore[no-any-return]


def default_generator() -> np.random.Generator:
    """This thread's default generator (what randn/rand/dropout/nn.init draw from when given none)."""
    g = getattr(_rng_local, "gen", None)
    if g is None:
        g = _rng_local.gen = np.random.default_rng()
    rec = _capture.active
    if rec is not None and rec.wants():
        # a compiled step records: it sees the generator through its recorder (seeds drawn for random ops
        # are drawn again on each replay; other draws make the step run eagerly)
        return rec.generator(g)  # type: ignore[no-any-return]
    return g  # type: ignore[no-any-return]


@contextlib.contextmanager
def fork_default_generator(gen: np.random.Generator, state: dict[str, Any]) -> Iterator[None]:
    """Inside the block, this thread's default generator is ``gen`` set to ``state``; on the way out both
    are put back (``gen`` to the state it had on the way in), so the block advances no one's stream.

    PyTorch's ``fork_rng`` plus ``set_rng_state``, for `checkpoint`'s recompute: ``gen`` is the generator
    the forward drew from (a thread's default generator is per thread and `manual_seed` replaces it, so
    the one in place now may be another object). The block must not yield to other tasks.
    """
    had = getattr(_rng_local, "gen", None)
    bg = gen.bit_generator
    before = bg.state
    bg.state = state
    _rng_local.gen = gen
    try:
        yield
    finally:
        bg.state = before
        _rng_local.gen = had


def _finish(data: np.ndarray, device: Any, requires_grad: bool, what: str) -> Tensor:
    rt = current_runtime(what)
    t = Tensor._wrap(data, rt.device(device))
    if requires_grad:
        t.requires_grad_(True)
    return t


def _shape(size: Any) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = size[0]
    return tuple(int(s) for s in size)


def tensor(data: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False) -> Tensor:
    """A new tensor holding a copy of ``data`` (Python floats become the default dtype, float32)."""
    from_user = not isinstance(data, Tensor)
    if not from_user:
        data = data.numpy()
    # a user's array only: a tensor's own array is written by kernels, which must not find it read-only
    if from_user and type(data) is np.ndarray and data.dtype.kind != "O":
        dt = data.dtype if dtype is None else np.dtype(dtype)
        if big(data.shape, dt):  # the copy runs on a lane (see `_lane_factories`)
            return copy_on_lane(data, dt, device, requires_grad)
    if dtype is None:
        arr = np.array(data, copy=True)
        # numpy and PyTorch infer the same bool and integer dtypes; floats differ (a Python float is
        # float64 to numpy, the default dtype to PyTorch; a numpy scalar keeps its dtype in both)
        if arr.dtype.kind in "fc" and not isinstance(data, np.ndarray):
            dt = _infer_dtype(data)
            if dt != arr.dtype:
                arr = arr.astype(dt)
    else:
        arr = np.array(data, dtype=np.dtype(dtype), copy=True)
    return _finish(arr, device, requires_grad, "asyncgrad.tensor")


_SEQ = (list, tuple)
_PY_LEAVES = frozenset((bool, int, float, complex))


def _infer_dtype(data: Any) -> np.dtype[Any]:
    """The dtype ``torch.tensor(data)`` infers: the promotion (torch.promote_types) of its elements'
    dtypes, where Python bool/int/float/complex are bool/int64/default float/default complex and numpy
    scalars, arrays and tensors keep their own dtypes."""
    found: set[Any] = set()
    _collect(data, found)
    dt: np.dtype[Any] | None = None
    for t in found:
        d = _leaf_dtype(t)
        dt = d if dt is None else _promote.promote_types(dt, d)
    return _default_dtype if dt is None else dt  # an empty list: the default dtype, like PyTorch


def _collect(x: Any, found: set[Any]) -> None:
    """Add to ``found`` the Python scalar types and the dtypes of everything else under ``x``."""
    if type(x) in _SEQ:
        types = set(map(type, x))
        if types <= _PY_LEAVES:  # a flat list of Python numbers: one pass in C
            found |= types
            return
        for e in x:
            _collect(e, found)
    elif type(x) in _PY_LEAVES:
        found.add(type(x))
    elif isinstance(x, (np.ndarray, np.generic, Tensor)):
        found.add(np.dtype(x.dtype))
    else:
        found.add(np.asarray(x).dtype)


def _leaf_dtype(t: Any) -> np.dtype[Any]:
    if isinstance(t, np.dtype):
        return t
    if t is float:
        return _default_dtype
    if t is complex:
        return _promote.result_type(1j)
    return np.dtype(np.bool_) if t is bool else np.dtype(np.int64)


def from_numpy(arr: np.ndarray) -> Tensor:
    """A tensor sharing ``arr``'s memory and strides."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"from_numpy expects a numpy.ndarray, got {type(arr).__name__}")
    return _finish(arr, "cpu", False, "asyncgrad.from_numpy")


def _dt(dtype: Any) -> np.dtype[Any]:
    return _default_dtype if dtype is None else np.dtype(dtype)


def zeros(*size: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False) -> Tensor:
    """A tensor of zeros."""
    return _finish(np.zeros(_shape(size), _dt(dtype)), device, requires_grad, "asyncgrad.zeros")


def ones(*size: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False) -> Tensor:
    """A tensor of ones."""
    shape, dt = _shape(size), _dt(dtype)
    if big(shape, dt):
        return on_lane(lambda: np.ones(shape, dt), shape, dt, device, requires_grad, "asyncgrad.ones")
    return _finish(np.ones(_shape(size), _dt(dtype)), device, requires_grad, "asyncgrad.ones")


def empty(*size: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False) -> Tensor:
    """An uninitialised tensor."""
    return _finish(np.empty(_shape(size), _dt(dtype)), device, requires_grad, "asyncgrad.empty")


def full(
    size: Any, fill_value: Any, *, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False
) -> Tensor:
    """A tensor filled with ``fill_value``."""
    if dtype is None:
        # PyTorch's dtype of a wrapped number: bool, int64 (numpy ints too), the default float / complex
        if isinstance(fill_value, (bool, int, float, complex, np.generic)):
            dtype = _promote.result_type(fill_value)
        else:
            dtype = np.asarray(fill_value).dtype
    shape, dt = _shape((size,)), np.dtype(dtype)
    if big(shape, dt):
        return on_lane(lambda: np.full(shape, fill_value, dt), shape, dt, device, requires_grad, "asyncgrad.full")
    return _finish(np.full(shape, fill_value, dt), device, requires_grad, "asyncgrad.full")


def arange(
    start: Any, end: Any = None, step: Any = 1, *, dtype: Any = None, device: Any = "cpu",
    requires_grad: bool = False,
) -> Tensor:
    """Values from ``start`` to ``end`` (exclusive) by ``step``; int64 for integer arguments."""
    if end is None:
        start, end = 0, start
    arr = np.arange(start, end, step)
    if dtype is not None:
        arr = arr.astype(dtype)
    elif arr.dtype == np.float64:
        arr = arr.astype(_default_dtype)
    return _finish(arr, device, requires_grad, "asyncgrad.arange")


def _sample(
    draw: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray], shape: tuple[int, ...], dt: np.dtype[Any],
    device: Any, requires_grad: bool, generator: np.random.Generator | None, what: str,
) -> Tensor:
    """``draw(generator, shape)`` as ``dt``; a large draw runs on a lane from a child generator."""
    g = generator or default_generator()
    if big(shape, dt):
        c = child_generator(g)
        return on_lane(lambda: draw(c, shape), shape, dt, device, requires_grad, what)
    return _finish(draw(g, shape).astype(dt, copy=False), device, requires_grad, what)


def _normal(g: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return g.standard_normal(shape, dtype=np.float64)


def _uniform(g: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return g.random(shape)


def randn(
    *size: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False,
    generator: np.random.Generator | None = None,
) -> Tensor:
    """Standard normal samples."""
    return _sample(_normal, _shape(size), _dt(dtype), device, requires_grad, generator, "asyncgrad.randn")


def rand(
    *size: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False,
    generator: np.random.Generator | None = None,
) -> Tensor:
    """Uniform samples in [0, 1)."""
    return _sample(_uniform, _shape(size), _dt(dtype), device, requires_grad, generator, "asyncgrad.rand")


def zeros_like(t: Tensor, *, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """Zeros with ``t``'s shape, dtype and device."""
    arr = np.zeros(t.shape, dtype=t.dtype if dtype is None else np.dtype(dtype))
    out = Tensor._wrap(arr, _like_dev(t, device))
    return out.requires_grad_(True) if requires_grad else out


def _like_dev(t: Tensor, device: Any) -> Any:
    return t.device if device is None else current_runtime("a *_like factory").device(device)


def ones_like(t: Tensor, *, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """Ones with ``t``'s shape, dtype and device."""
    arr = np.ones(t.shape, dtype=t.dtype if dtype is None else np.dtype(dtype))
    out = Tensor._wrap(arr, _like_dev(t, device))
    return out.requires_grad_(True) if requires_grad else out


def empty_like(t: Tensor, *, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """An uninitialised tensor with ``t``'s shape, dtype and device."""
    out = Tensor._wrap(np.empty(t.shape, dtype=t.dtype if dtype is None else np.dtype(dtype)), _like_dev(t, device))
    return out.requires_grad_(True) if requires_grad else out


def full_like(
    t: Tensor, fill_value: Any, *, dtype: Any = None, device: Any = None, requires_grad: bool = False
) -> Tensor:
    """``fill_value`` everywhere, with ``t``'s shape, dtype and device."""
    arr = np.full(t.shape, fill_value, dtype=t.dtype if dtype is None else np.dtype(dtype))
    out = Tensor._wrap(arr, _like_dev(t, device))
    return out.requires_grad_(True) if requires_grad else out


def randn_like(
    t: Tensor, *, dtype: Any = None, device: Any = None, requires_grad: bool = False,
    generator: np.random.Generator | None = None,
) -> Tensor:
    """Standard normal samples with ``t``'s shape, dtype and device."""
    dt = t.dtype if dtype is None else np.dtype(dtype)
    return _sample(_normal, t.shape, dt, _like_dev(t, device), requires_grad, generator, "asyncgrad.randn_like")


def rand_like(
    t: Tensor, *, dtype: Any = None, device: Any = None, requires_grad: bool = False,
    generator: np.random.Generator | None = None,
) -> Tensor:
    """Uniform samples in [0, 1) with ``t``'s shape, dtype and device."""
    dt = t.dtype if dtype is None else np.dtype(dtype)
    return _sample(_uniform, t.shape, dt, _like_dev(t, device), requires_grad, generator, "asyncgrad.rand_like")


def randint(
    low: int, high: int | None = None, size: Any = (), *, dtype: Any = None, device: Any = "cpu",
    requires_grad: bool = False, generator: np.random.Generator | None = None,
) -> Tensor:
    """Integers drawn uniformly from [low, high) (``randint(high, size)`` draws from [0, high)), int64."""
    if isinstance(high, (tuple, list)):  # randint(high, size)
        low, high, size = 0, low, high
    elif high is None:
        low, high = 0, low
    g = generator or default_generator()
    arr = g.integers(low, high, _shape((size,))).astype(np.int64 if dtype is None else np.dtype(dtype))
    return _finish(arr, device, requires_grad, "asyncgrad.randint")


def normal(
    mean: float, std: float, size: Any, *, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False,
    generator: np.random.Generator | None = None,
) -> Tensor:
    """Normal samples with the given mean and standard deviation."""
    g = generator or default_generator()
    shape, dt = _shape((size,)), _dt(dtype)
    if big(shape, dt):
        c = child_generator(g)
        return on_lane(lambda: c.normal(mean, std, shape), shape, dt, device, requires_grad, "asyncgrad.normal")
    arr = g.normal(mean, std, shape).astype(dt)
    return _finish(arr, device, requires_grad, "asyncgrad.normal")


def linspace(
    start: float, end: float, steps: int, *, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False
) -> Tensor:
    """``steps`` values evenly spaced from ``start`` to ``end`` inclusive."""
    return _finish(np.linspace(start, end, steps).astype(_dt(dtype)), device, requires_grad, "asyncgrad.linspace")


def eye(
    n: int, m: int | None = None, *, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False
) -> Tensor:
    """The ``n`` x ``m`` identity matrix (``m`` defaults to ``n``)."""
    return _finish(np.eye(n, m, dtype=_dt(dtype)), device, requires_grad, "asyncgrad.eye")
