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
- Reuse: when such an array dies and the trust above held to the end (rows noted, bound, its version
  counter never moved), only the noted rows can be non-zero, so they are zeroed and the mapping is kept
  for the next `untouched_zeros` of that size (at most ``_KEEP_PER_SIZE`` each): its pages stay mapped,
  so the next batch's writes pay no page faults (a fresh mapping's first write to each page is a fault
  that has the kernel zero the page: ~2.5 us per page, 0.6 ms for W8's 256 rows). Any other end (never
  bound, written in place, bound again after a write) unmaps it as before.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Any

import numpy as np

from ._inplace import inplace

# below this an ordinary memset is cheaper than an mmap/munmap pair
_MMAP_MIN_BYTES = 1 << 20
_KEEP_PER_SIZE = 2  # clean mappings kept for reuse, per size in bytes


class _Mapping:
    """What is known of one mapping while an array of `untouched_zeros` uses it."""

    __slots__ = ("arr", "base", "cell", "mm", "n_rows", "rows", "version")

    def __init__(self, mm: mmap.mmap, base: np.ndarray, arr: np.ndarray) -> None:
        self.mm: mmap.mmap | None = mm
        self.n_rows = arr.shape[0] if arr.ndim else 1
        self.base: Any = weakref.ref(base)  # the flat array over ``mm``: every view of ``arr`` keeps it alive
        self.arr = weakref.ref(arr)
        self.rows: np.ndarray | None = None  # noted by the kernel that wrote it
        self.cell: list[Any] | None = None  # the version counter cell of the Tensor bound to it
        self.version = -1  # that counter when bound


_kept: dict[int, list[mmap.mmap]] = {}  # bytes -> clean (all zero) mappings ready for reuse
_mappings: dict[int, _Mapping] = {}  # id(array returned by untouched_zeros) -> its mapping
MAPPINGS_MADE = [0]  # fresh mappings made (for tests)

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
    with _lock:
        kept = _kept.get(n)
        mm = kept.pop() if kept else None
    if mm is None:
        mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        MAPPINGS_MADE[0] += 1
    # the array keeps the mapping alive; when the last view of it dies the mapping is unmapped, or kept
    # for reuse (`_retire`)
    base = np.frombuffer(mm, dtype=dt)
    arr = base.reshape(shape)
    rec = _Mapping(mm, base, arr)
    key = id(arr)

    def gone(_: Any, key: int = key, rec: _Mapping = rec) -> None:
        _retire(key, rec, n)

    rec.base = weakref.ref(base, gone)
    with _lock:
        _mappings[key] = rec
    return arr


def _retire(key: int, rec: _Mapping, n: int) -> None:
    """(any thread: the one that dropped the last view) The array over ``rec.mm`` is gone: keep the
    mapping, its noted rows zeroed, if nothing else can have written it; else let it be unmapped."""
    # (weakref callbacks run before the dying array lets go of the mapping: nobody can read it any more,
    # and it is unmapped once the last holder drops it)
    mm, rec.mm, rec.base = rec.mm, None, None  # break rec -> weakref -> callback -> rec
    if _lock is None:  # the interpreter is shutting down
        return
    with _lock:
        if _mappings.get(key) is rec:
            del _mappings[key]
        kept = _kept.setdefault(n, [])
        room = len(kept) < _KEEP_PER_SIZE
    rows, cell = rec.rows, rec.cell
    if mm is None or not room or rows is None or cell is None or cell[0] != rec.version:
        return
    view = np.frombuffer(mm, dtype=np.uint8).reshape(rec.n_rows, n // rec.n_rows)
    view[rows] = 0
    del view  # no export of the mapping may outlive this
    with _lock:
        if len(kept) < _KEEP_PER_SIZE:
            kept.append(mm)


def _mapping_of(arr: Any) -> _Mapping | None:
    """(under ``_lock``) The mapping record of ``arr`` if it is an array `untouched_zeros` returned."""
    rec = _mappings.get(id(arr))
    if rec is None or rec.arr() is not arr:
        return None
    return rec


def note_rows(arr: np.ndarray, rows: np.ndarray) -> None:
    """Record that ``arr`` (just built, 2-d or more) is zero outside ``rows`` of its first axis."""
    key = id(arr)

    def gone(_: Any, key: int = key) -> None:
        with _lock:
            _noted.pop(key, None)

    with _lock:
        _noted[key] = (weakref.ref(arr, gone), rows)
        rec = _mapping_of(arr)
        if rec is not None:
            # a second note (another kernel writing it) leaves it to be unmapped: only one writer is known
            rec.rows = rows if rec.rows is None else None
            if rec.rows is None:
                rec.cell = None


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

    if t._vc is None:  # a cell of its own now, so a later in-place write is seen by `_retire` too
        t._vc = [0]
    cell, version = t._vc, t._version
    with _lock:
        _bound[key] = (weakref.ref(t, gone), version)

    def link(arr: np.ndarray) -> None:
        _link(arr, cell, version)

    # in stream order: the array exists once the kernel that makes it ran (a pending gradient is bound)
    inplace(t, link, write=False)


def _link(arr: np.ndarray, cell: list[Any], version: int) -> None:
    """A Tensor with version counter ``cell`` (at ``version``) was bound over ``arr``: if ``arr`` is an
    array of `untouched_zeros` and that Tensor never wrote it, its reuse may trust the noted rows."""
    with _lock:
        rec = _mapping_of(arr)
        if rec is None or rec.rows is None:
            return
        if rec.cell is None and version == 0:
            # never written in place since the kernel (a fresh Tensor over it): trusted to its end
            rec.cell, rec.version = cell, 0
        elif rec.cell is not cell or cell[0] != rec.version:
            rec.rows = rec.cell = None  # written, or bound through another counter: unmapped at its end


def unbind_rows(t: Any) -> None:
    """Stop trusting the rows noted for ``t``'s array."""
    with _lock:
        _bound.pop(id(t), None)
    inplace(t, _distrust, write=False)


def _distrust(arr: np.ndarray) -> None:
    with _lock:
        rec = _mapping_of(arr)
        if rec is not None:
            rec.rows = rec.cell = None


def rows_bound(t: Any) -> bool:
    """Whether ``t`` was bound by `bind_rows` and not written in place since (read when queueing a kernel
    that will call `noted_rows` on its array)."""
    with _lock:
        got = _bound.get(id(t))
    return got is not None and got[0]() is t and got[1] == t._version
