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
- Recycling: a fresh mapping still page-faults once per page its rows touch (~2 us each on a virtual
  machine: 0.5 ms for W8's 256 random rows of a 25 MB table, 40x the rows' own writes). So when such an
  array dies and every write to it is accounted for (its rows noted by the kernel that built it, bound
  through a tensor whose version counter has not moved since, never handed out by ``.numpy()``), its
  noted rows are cleared and the mapping is kept for the next `untouched_zeros` of that size, its pages
  mapped already. Any other end (never noted or bound, written in place, a raw array handed out) frees
  the mapping as before, so a recycled array is all zero whatever was done to the last one.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Any

import numpy as np

# below this an ordinary memset is cheaper than an mmap/munmap pair
_MMAP_MIN_BYTES = 1 << 20
# cleared mappings kept for reuse, all sizes together (one W8 table gradient is 25 MB)
_POOL_MAX_BYTES = 256 << 20

_lock = threading.Lock()
_noted: dict[int, tuple[Any, np.ndarray]] = {}  # id(array) -> (weakref to it, its written rows)
# id(Tensor) -> (weakref to it, its version when bound); not a WeakKeyDictionary: Tensor's == is elementwise
_bound: dict[int, tuple[Any, int]] = {}


class _Life:
    """What is known of the writes to one large zero array while it lives (see Recycling above)."""

    __slots__ = ("cell", "escaped", "mm", "nbytes", "nrows", "ref", "rows", "whole")

    def __init__(self, mm: mmap.mmap, nbytes: int, nrows: int, whole: np.ndarray) -> None:
        self.mm = mm
        self.nbytes = nbytes
        self.nrows = nrows
        self.whole = weakref.ref(whole)  # the array handed out (the rows are noted on it alone)
        self.rows: np.ndarray | None = None
        # the version counter of the tensor it was bound through, at 0 then: recycled if still at 0
        self.cell: list[Any] | None = None
        self.escaped = False
        self.ref: Any = None


# id(the 1-d array over a mapping, which every view of it refers to as its base) -> its life
_lives: dict[int, _Life] = {}
_pool: dict[int, list[mmap.mmap]] = {}  # nbytes -> cleared mappings
_pooled = [0]  # bytes in `_pool`


def untouched_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A C-contiguous zero array; a large one is anonymous memory whose pages are mapped on first write
    (no memset, nothing resident for rows never written), or a recycled mapping cleared to zero."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n < _MMAP_MIN_BYTES:
        return np.zeros(shape, dtype=dt)
    mm = None
    with _lock:
        free = _pool.get(n)
        if free:
            mm = free.pop()
            _pooled[0] -= n
    if mm is None:
        mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the array keeps the mapping alive; it is unmapped (or recycled) when the last view of it dies. Every
    # numpy view of the result has `flat` as its base, so `flat` dies with the last of them
    flat = np.frombuffer(mm, dtype=dt)
    z = flat.reshape(shape)
    if len(shape) >= 2:
        key = id(flat)
        life = _Life(mm, n, shape[0], z)
        life.ref = weakref.ref(flat, lambda _: _ended(key))
        with _lock:
            _lives[key] = life
    return z


def _life_of(arr: Any) -> _Life | None:
    base = getattr(arr, "base", None)
    # (a dict read is atomic: no lock on the path of `.numpy()`)
    return None if base is None else _lives.get(id(base))


def _ended(key: int) -> None:
    """(any thread: where the last view died) Keep the mapping, cleared, if every write is accounted for."""
    try:
        with _lock:
            life = _lives.pop(key, None)
    except TypeError:  # the module is torn down at interpreter exit
        return
    if life is None:
        return
    mm, rows, cell = life.mm, life.rows, life.cell
    life.mm = life.rows = life.cell = None  # type: ignore[assignment]
    if rows is None or cell is None or cell[0] != 0 or life.escaped:
        return  # the mapping goes with `mm`
    n = life.nbytes
    if _pooled[0] + n > _POOL_MAX_BYTES:  # (checked again below, under the lock)
        return
    view = np.frombuffer(mm, np.uint8).reshape(life.nrows, n // life.nrows)
    view[rows] = 0  # the only rows written: a few hundred of them, microseconds
    del view
    with _lock:
        if _pooled[0] + n <= _POOL_MAX_BYTES:
            _pool.setdefault(n, []).append(mm)
            _pooled[0] += n


def handed_out(arr: Any) -> None:
    """``arr`` (a tensor's own array) leaves asyncgrad's view (``Tensor.numpy()``): writes through it are
    not seen, so a mapping under it is not recycled."""
    if _lives:
        life = _life_of(arr)
        if life is not None:
            life.escaped = True


def pooled_bytes() -> int:
    """Bytes of cleared mappings kept for reuse (for tests)."""
    return _pooled[0]


def note_rows(arr: np.ndarray, rows: np.ndarray) -> None:
    """Record that ``arr`` (just built, 2-d or more) is zero outside ``rows`` of its first axis."""
    key = id(arr)

    def gone(_: Any, key: int = key) -> None:
        with _lock:
            _noted.pop(key, None)

    with _lock:
        _noted[key] = (weakref.ref(arr, gone), rows)
    life = _life_of(arr)
    if life is not None and life.whole() is arr:
        life.rows = rows


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
    # the mapping under it may be recycled if this tensor is never written from now on, and was not
    # before (version 0: written by nothing but the kernel that noted its rows); the cell (made here when
    # the tensor has none yet) is shared with the views made from now on
    vc = t._vc
    if vc is None:
        vc = t._vc = [0, weakref.ref(t)]
    if vc[0] != 0:
        return
    arr = t._data
    if arr is not None:
        _adopt(arr, vc)
        return
    s = t._stream
    if s is not None:  # still being computed (a gradient stolen in stream order): look once it is there
        ref = weakref.ref(t)
        s.submit(lambda: _adopt_later(ref, vc))


def _adopt(arr: np.ndarray, vc: list[Any]) -> None:
    life = _life_of(arr)
    if life is not None and life.whole() is arr and life.rows is not None and life.cell is None and vc[0] == 0:
        life.cell = vc


def _adopt_later(ref: Any, vc: list[Any]) -> None:
    # (a job on the stream that fills the tensor; never raises, which would fail the stream)
    t = ref()
    arr = None if t is None else t._data
    if arr is not None:
        _adopt(arr, vc)


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
