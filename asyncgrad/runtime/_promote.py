"""PyTorch's type promotion (c10 ``result_type``), for numpy dtypes.

Operands fall in three priority groups: dimensioned tensors (ndim >= 1), zero-dim tensors, and wrapped
scalars (Python bool/int/float/complex and numpy scalars, taken as bool / int64 / the default float dtype /
the default complex dtype). Within a group dtypes promote with `promote_types`; across groups a lower
group only wins when its category (bool < integer < floating < complex) is higher, as c10's
``combine_categories`` does. numpy arrays given as operands count as tensors of their ndim.

This module imports only numpy: the dispatcher and the op families use it, and so do the factories.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._tensor import Tensor

_default_float: np.dtype[Any] = np.dtype(np.float32)
_default_complex: np.dtype[Any] = np.dtype(np.complex64)

_BOOL = np.dtype(np.bool_)
_INT64 = np.dtype(np.int64)

_promote_cache: dict[tuple[np.dtype[Any], np.dtype[Any]], np.dtype[Any]] = {}
_result_cache: dict[tuple[Any, ...], np.dtype[Any]] = {}


def set_default_float(dtype: np.dtype[Any]) -> None:
    """Called by `set_default_dtype`: wrapped floats and integer-to-float ops follow the default."""
    global _default_float, _default_complex
    _default_float = np.dtype(dtype)
    _default_complex = np.dtype(np.complex128 if _default_float == np.float64 else np.complex64)
    _result_cache.clear()


def promote_types(a: np.dtype[Any], b: np.dtype[Any]) -> np.dtype[Any]:
    """torch.promote_types: like numpy's, except that an integer or bool meets a float (or complex)
    as that float (int64 + float32 is float32, int16 + float16 is float16; numpy widens those)."""
    if a is b:
        return a
    key = (a, b)
    r = _promote_cache.get(key)
    if r is None:
        ka, kb = a.kind, b.kind
        if ka in "fc" and kb in "biu":
            r = a
        elif kb in "fc" and ka in "biu":
            r = b
        else:
            r = np.promote_types(a, b)
        _promote_cache[key] = r
    return r


def _combine(higher: np.dtype[Any] | None, lower: np.dtype[Any] | None) -> np.dtype[Any] | None:
    """c10's combine_categories: ``higher`` (a higher-priority group) wins unless ``lower`` is of a
    higher category."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    kh, kl = higher.kind, lower.kind
    if kh == "c":
        return higher
    if kl == "c":
        # keep the float width of ``higher``
        if kh == "f":
            return np.result_type(higher, np.complex64)
        return lower
    if kh == "f":
        return higher
    if kh == "b" or kl == "f":
        return promote_types(higher, lower)
    return higher


# wrapped numbers: Python scalars by type; "f" and "c" stand for the default float / complex dtype
_PY_KEYS: dict[type, Any] = {float: "f", int: _INT64, bool: _BOOL, complex: "c"}
_KIND_KEYS: dict[str, Any] = {"f": "f", "c": "c", "b": _BOOL, "i": _INT64, "u": _INT64}


def _key(x: Any) -> Any:
    """What promotion needs of an operand: a wrapped number's key, or (dtype, has dims) for a tensor."""
    t = type(x)
    if t is Tensor:
        return (x._dtype, x._shape != ())
    k = _PY_KEYS.get(t)
    if k is not None:
        return k
    if isinstance(x, np.generic):  # numpy scalars count as Python numbers (np.float64 is a float)
        k = _KIND_KEYS.get(x.dtype.kind)
        if k is not None:
            return k
    elif isinstance(x, np.ndarray):  # a numpy array counts as a tensor
        return (x.dtype, x.ndim > 0)
    elif isinstance(x, Tensor):
        return (x._dtype, x._shape != ())
    raise TypeError(f"unsupported operand type {t.__name__}; use a Tensor or a number")


def result_type(*operands: Any) -> np.dtype[Any]:
    """The dtype PyTorch gives an op over these operands (Tensors, numpy arrays, Python/numpy scalars;
    None, such as an absent clamp bound, is skipped)."""
    key = tuple([_key(x) for x in operands if x is not None])
    r = _result_cache.get(key)
    if r is None:
        r = _result_cache[key] = _result_of_keys(key)
    return r


def result_type2(a: Any, b: Any) -> np.dtype[Any]:
    """`result_type` of two operands (the binary elementwise ops' meta: once per op on the slow path)."""
    if type(a) is Tensor and type(b) is Tensor:
        da = a._dtype
        if da is b._dtype:
            return da  # one dtype in every group: that dtype
        key: tuple[Any, ...] = ((da, a._shape != ()), (b._dtype, b._shape != ()))
    else:
        key = (_key(a), _key(b))
    r = _result_cache.get(key)
    if r is None:
        r = _result_cache[key] = _result_of_keys(key)
    return r


def _result_of_keys(key: tuple[Any, ...]) -> np.dtype[Any]:
    dim: np.dtype[Any] | None = None
    zero: np.dtype[Any] | None = None
    wrapped: np.dtype[Any] | None = None
    for k in key:
        if isinstance(k, tuple):
            dt, has_dims = k
            if has_dims:
                dim = dt if dim is None else promote_types(dim, dt)
            else:
                zero = dt if zero is None else promote_types(zero, dt)
        else:
            w = k if not isinstance(k, str) else _default_float if k == "f" else _default_complex
            wrapped = w if wrapped is None else promote_types(wrapped, w)
    r = _combine(dim, _combine(zero, wrapped))
    if r is None:
        raise TypeError("result_type: expected at least one operand")
    return r


def to_float(dt: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype of an op that always computes in floating point (true division, sqrt, exp, ...):
    bool and integer dtypes become the default float dtype."""
    return dt if dt.kind in "fc" else _default_float
