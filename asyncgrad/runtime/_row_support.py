"""Row-sparse gradients kept dense: zeros that cost nothing until written, and which rows were written.

An embedding's gradient is a dense ``(num_embeddings, dim)`` array that is zero outside the few rows a
batch touched. PyTorch's ``.grad`` is that dense array, and so is asyncgrad's; but filling 25 MB with
zeros and then stepping an optimizer over all of it costs far more than the rows themselves (W8).

- `untouched_zeros`: a large zero array backed by fresh anonymous memory (``mmap``), so the kernel maps
  its pages on first write; a zero never written costs no memset and no page.
- `note_rows` / `noted_rows`: the kernel that built such an array records the rows it wrote (keyed by the
  array object, dropped when it dies).
- `bind_rows` / `rows_bound`: the record is trusted only through a Tensor bound to it while that Tensor's
  version counter has not moved since (any in-place op on it or a view bumps the counter; a write through
  ``.numpy()`` does not, as for every version check in asyncgrad). A consumer (an optimizer without
  weight decay or momentum) may then update the noted rows only: the other rows of the gradient are zero.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Any

import numpy as np

# below this an ordinary memset is cheaper than an mmap/munmap pair
_MMAP_MIN_BYTES = 1 << 20

_lock = threading.Lock()
_noted: dict[int, tuple[Any, np.ndarray]] = {}  # id(array) -> (weakref to it, its written rows)
# id(Tensor) -> (weakref to it, its version when bound); not a WeakKeyDictionary: Tensor's == is elementwise
_bound: dict[int, tuple[Any, int]] = {}


def untouched_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A C-contiguous zero array; a large one is fresh anonymous memory whose pages are mapped on first
    write (no memset, nothing resident for rows never written)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n < _MMAP_MIN_BYTES:
        return np.zeros(shape, dtype=dt)
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the array keeps the mapping alive; it is unmapped when the last view of the array dies
    return np.frombuffer(mm, dtype=dt).reshape(shape)


def note_rows(arr: np.ndarray, rows: np.ndarray) -> None:
    """Record that ``arr`` (just built, 2-d or more) is zero outside ``rows`` of its first axis."""
    key = id(arr)

    def gone(_: Any, key: int = key) -> None:
        with _lock:
            _noted.pop(key, None)

    with _lock:
        _noted[key] = (weakref.ref(arr, gone), rows)


def noted_rows(arr: np.ndarray) -> np.ndarray | None:
    """The rows noted for ``arr`` (the very object), or None."""
    with _lock:
        got = _noted.get(id(arr))
    if got is None or got[0]() is not arr:
        return None
    return got[1]


def bind_rows(t: Any) -> None:
    """Trust the rows noted for ``t``'s array while ``t`` is not written in place."""
    key = id(t)

    def gone(_: Any, key: int = key) -> None:
        with _lock:
            _bound.pop(key, None)

    with _lock:
        _bound[key] = (weakref.ref(t, gone), t._version)


def unbind_rows(t: Any) -> None:
    """Stop trusting the rows noted for ``t``'s array."""
    with _lock:
        _bound.pop(id(t), None)


def rows_bound(t: Any) -> bool:
    """Whether ``t`` was bound by `bind_rows` and not written in place since (read when queueing a kernel
    that will call `noted_rows` on its array)."""
    with _lock:
        got = _bound.get(id(t))
    return got is not None and got[0]() is t and got[1] == t._version
