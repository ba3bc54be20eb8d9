"""`default_collate` / `default_convert`, as PyTorch's, split so that the copying runs off the event loop.

Collation happens in three steps: `to_arrays` (event-loop thread: tensors in the samples become their
numpy arrays), `collate_arrays` (pure numpy, safe on any thread: this is the copy that costs), and
`to_tensors` (event-loop thread: arrays become tensors, without copying). `default_collate` is the three
together; the loader's ``async for`` runs the middle one on its prefetch thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ...runtime import Tensor, from_numpy

__all__ = [
    "collate_arrays", "convert_arrays", "default_collate", "default_convert", "map_leaves", "to_arrays", "to_tensors",
]

_ERR = "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found {}"


def map_leaves(x: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """``x`` with every ``kind`` inside it (through mappings, named tuples, lists, tuples) replaced by
    ``fn`` of it; everything else kept as it is."""
    if isinstance(x, kind):
        return fn(x)
    if isinstance(x, (str, bytes)) or x is None:
        return x
    if isinstance(x, Mapping):
        out = {k: map_leaves(v, kind, fn) for k, v in x.items()}
        return out if type(x) is dict else _remake(x, out)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(map_leaves(v, kind, fn) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(map_leaves(v, kind, fn) for v in x)
    return x


def to_arrays(x: Any) -> Any:
    """``x`` with every Tensor replaced by its numpy array (waits for pending values)."""
    return map_leaves(x, Tensor, np.asarray)


def _remake(proto: Any, d: dict[Any, Any]) -> Any:
    try:
        return type(proto)(d)
    except TypeError:  # a mapping type that cannot be built from a dict
        return d


def collate_arrays(batch: Sequence[Any]) -> Any:
    """PyTorch's ``default_collate`` rules on samples holding numpy arrays instead of tensors.

    Arrays are stacked along a new first dimension; Python floats give float64, ints int64, bools bool;
    numpy scalars keep their dtype; strings stay a list; dicts, named tuples and sequences are collated
    field by field (a tuple of fields becomes a list, as in PyTorch).
    """
    if len(batch) == 0:
        raise ValueError("default_collate: the batch is empty")
    elem = batch[0]
    if isinstance(elem, np.ndarray):
        if elem.dtype.kind in "USOV":
            raise TypeError(_ERR.format(f"numpy array of dtype {elem.dtype}"))
        shapes = {a.shape for a in batch}
        if len(shapes) > 1:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got shapes {sorted(shapes)}")
        return np.stack(batch)
    if isinstance(elem, np.generic):
        if elem.dtype.kind in "USOV":
            raise TypeError(_ERR.format(f"numpy scalar of dtype {elem.dtype}"))
        return np.array(batch)
    if isinstance(elem, bool):
        return np.array(batch, dtype=np.bool_)
    if isinstance(elem, float):
        return np.array(batch, dtype=np.float64)
    if isinstance(elem, int):
        return np.array(batch, dtype=np.int64)
    if isinstance(elem, (str, bytes)):
        return list(batch)
    if isinstance(elem, Mapping):
        out = {k: collate_arrays([d[k] for d in batch]) for k in elem}
        return out if type(elem) is dict else _remake(elem, out)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return type(elem)(*(collate_arrays(list(s)) for s in zip(*batch)))
    if isinstance(elem, Sequence):
        n = len(elem)
        if any(len(e) != n for e in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        cols = [collate_arrays(list(s)) for s in zip(*batch)]
        if isinstance(elem, tuple):
            return cols
        try:
            return type(elem)(cols)  # type: ignore[call-arg]
        except TypeError:
            return cols
    raise TypeError(_ERR.format(type(elem).__name__))


def to_tensors(x: Any) -> Any:
    """``x`` with every numpy array replaced by a Tensor sharing its memory."""
    return map_leaves(x, np.ndarray, from_numpy)


def default_collate(batch: Sequence[Any]) -> Any:
    """Merge a list of samples into a batch, as PyTorch's ``default_collate`` (tensors stacked, numbers
    made tensors, dicts/sequences collated field by field)."""
    return to_tensors(collate_arrays(to_arrays(list(batch))))


def default_convert(data: Any) -> Any:
    """PyTorch's ``default_convert`` (the loader's ``collate_fn`` when ``batch_size=None``): numpy arrays
    become tensors, anything else is kept."""
    return convert_arrays(data, from_numpy)


def convert_arrays(data: Any, fn: Callable[[np.ndarray], Any] = lambda a: a) -> Any:
    """`default_convert`'s structure (tuples become lists, as in PyTorch) with ``fn`` applied to the numpy
    arrays (Tensors inside are taken as their arrays); the identity keeps them numpy (for a worker)."""
    if isinstance(data, Tensor):
        data = np.asarray(data)
    if isinstance(data, np.ndarray) and data.dtype.kind not in "USOV":
        return fn(data)
    if isinstance(data, Mapping):
        out = {k: convert_arrays(v, fn) for k, v in data.items()}
        return out if type(data) is dict else _remake(data, out)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(convert_arrays(v, fn) for v in data))
    if isinstance(data, (list, tuple)):  # a tuple becomes a list, as in PyTorch
        return [convert_arrays(v, fn) for v in data]
    return data
