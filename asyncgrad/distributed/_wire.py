"""The wire format: msgpack for plain values, raw buffers for tensors and arrays. No pickle anywhere.

A frame is::

    header (16 bytes: meta length u32, table length u32, payload length u64, little endian)
    meta     msgpack of the message; a tensor or array in it is an ext value holding its index in the table
    table    msgpack list, one entry per buffer: [dtype str, shape, strides (bytes), nbytes]
    payload  the buffers' raw bytes, one after another

The receiver reads the table before any payload byte, allocates each destination buffer with its final
layout (a channels-last tensor arrives channels-last) and receives the bytes straight into it. Every
length is checked against the connection's limits before anything is allocated; a frame that fails a
check is a `ProtocolError` and closes its connection.

Besides msgpack's own types (None, bool, int, float, str, bytes, list, dict) the codec carries tuples,
integers of any size, complex numbers, numpy scalars and dtypes, numpy arrays and asyncgrad tensors.
Anything else is a `TypeError` that names the type and where it was (``args[1]['k']``).
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from ..devices import INLINE_MAX_ELEMENTS, run_parts
from ..runtime import Tensor, is_dense_nonoverlapping
from . import _shm
from ._errors import ProtocolError

HEADER = struct.Struct("<IIQ")
HEADER_SIZE = HEADER.size


DEFAULT_MAX_FRAME_BYTES = 4 << 30  # payload of one frame (tensors): 4 GiB
DEFAULT_MAX_META_BYTES = 64 << 20  # msgpack part of one frame (plain values): 64 MiB
MAX_NDIM = 64
MAX_TENSORS = 1 << 16  # buffers in one frame
_INLINE_BYTES = 32 << 10  # a ready value of at most this size (and INLINE_MAX_ELEMENTS) goes in the message
_JOIN_BYTES = 16 << 10
_SPLIT_BYTES = 8 << 20  # a larger copy-out is split across idle lanes (`run_parts`)
_SPLITS = 8  # a frame with at most this much payload is joined into one buffer to send

EXT_TENSOR = 1  # [index, requires_grad]
EXT_ARRAY = 2  # index
EXT_TUPLE = 3  # msgpack list
EXT_NPSCALAR = 4  # [dtype str, raw bytes]
EXT_BIGINT = 5  # decimal text
EXT_COMPLEX = 6  # [real, imag]
EXT_DTYPE = 7  # dtype str
EXT_RREF = 8  # [owner name, object id]
EXT_INLINE = 9  # kind (0 array, 1 tensor, 2 tensor that requires grad), dtype, shape, strides, slot, bytes
EXT_INLINE_REF = 10  # slot: the same small value again

_ALLOWED_KINDS = frozenset("biufc")
_PLAIN = (type(None), bool, int, float, str, bytes, list, dict)


class Unsupported(TypeError):
    """Raised inside the packer for a value the wire cannot carry (turned into a TypeError with a path)."""

    def __init__(self, obj: Any, why: str = "") -> None:
        super().__init__(why)
        self.obj = obj
        self.why = why


class RRefMarker:
    """What an `RRef` puts on the wire: its owner and object id (the owner resolves it to the object)."""

    __slots__ = ("object_id", "owner")

    def __init__(self, owner: str, object_id: int) -> None:
        self.owner = owner
        self.object_id = object_id


def _check_dtype(dt: np.dtype[Any], obj: Any) -> None:
    if dt.kind not in _ALLOWED_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise Unsupported(obj, f"dtype {dt} is not a plain numeric dtype")


class Encoded:
    """A message packed for the wire; its tensors still to be staged (copied out) before it can be sent.

    ``tensors`` are the distinct tensors and arrays in it, in table order; ``requires_grad`` per tensor.
    """

    __slots__ = ("boxes", "meta", "nbytes", "staged", "tensors")

    def __init__(self, meta: bytes, tensors: list[Any]) -> None:
        self.meta = meta
        self.tensors = tensors
        self.staged: list[Any] = []  # the staged tensors (their kernels may still be queued)
        if tensors:
            # per tensor, filled by the staging kernel: (flat uint8 buffer, strides, shared segment)
            self.boxes: list[list[Any]] = [[] for _ in tensors]
            self.nbytes = len(meta) + sum(_nbytes(t) for t in tensors)
        else:
            self.boxes = []
            self.nbytes = len(meta)

    def frame(self) -> tuple[list[Any], list[Any]]:
        """The frame's parts (header+meta+table, then the in-band buffers) and the shared segments whose
        descriptors go with it, once every tensor is staged."""
        if not self.tensors:  # plain values (and small tensors packed into the message)
            return [HEADER.pack(len(self.meta), 0, 0) + self.meta], []
        entries = []
        bufs = []
        segments = []
        total = 0
        for t, box in zip(self.tensors, self.boxes):
            flat, strides, segment = box[0]
            dt = t.dtype
            if segment is not None:
                entries.append([dt.str, list(t.shape), list(strides), flat.nbytes, segment.size])
                segments.append(segment)
            else:
                entries.append([dt.str, list(t.shape), list(strides), flat.nbytes])
                bufs.append(memoryview(flat))
                total += flat.nbytes
        table = msgpack.packb(entries, use_bin_type=True) if entries else b""
        head = HEADER.pack(len(self.meta), len(table), total) + self.meta + table
        if total <= _JOIN_BYTES:  # one small write: a copy costs less than a gather
            return [b"".join([head, *bufs])], segments
        return [head, *bufs], segments


def _nbytes(t: Any) -> int:
    return math.prod(t.shape) * t.dtype.itemsize


def encode(msg: Any, describe: Sequence[tuple[str, Any]] = ()) -> Encoded:
    """Pack ``msg``; ``describe`` names the parts of it searched for the path of an unsupported value."""
    tensors: list[Any] = []
    index: dict[int, int] = {}
    inlined: dict[int, tuple[Any, int]] = {}  # small ready values packed into the message itself: slot

    def default(obj: Any) -> Any:
        t = type(obj)
        if t is Tensor or t is np.ndarray or isinstance(obj, (Tensor, np.ndarray)):
            key = id(obj)
            i = index.get(key)
            if i is None:
                inline = inlined.get(key)
                if inline is not None:  # sent in this message already
                    return msgpack.ExtType(EXT_INLINE_REF, msgpack.packb(inline[1]))
                ext = _inline(obj, len(inlined))
                if ext is not None:
                    inlined[key] = (obj, len(inlined))  # the object is kept: its id stays its own
                    return ext
                _check_dtype(obj.dtype, obj)
                if len(tensors) >= MAX_TENSORS:
                    raise Unsupported(obj, f"more than {MAX_TENSORS} tensors in one message")
                i = index[key] = len(tensors)
                tensors.append(obj)
            if isinstance(obj, Tensor):
                rg = obj.requires_grad
                if i < _CACHED:
                    return _TENSOR_EXT[rg][i]
                return msgpack.ExtType(EXT_TENSOR, msgpack.packb([i, rg]))
            return _ARRAY_EXT[i] if i < _CACHED else msgpack.ExtType(EXT_ARRAY, msgpack.packb(i))
        if t is tuple:
            return msgpack.ExtType(EXT_TUPLE, _pack(list(obj), default))
        if isinstance(obj, np.generic):
            _check_dtype(obj.dtype, obj)
            return msgpack.ExtType(EXT_NPSCALAR, msgpack.packb([obj.dtype.str, obj.tobytes()], use_bin_type=True))
        if isinstance(obj, np.dtype):
            _check_dtype(obj, obj)
            return msgpack.ExtType(EXT_DTYPE, obj.str.encode())
        if t is int:  # too big for msgpack's 64 bits
            return msgpack.ExtType(EXT_BIGINT, str(obj).encode())
        if t is complex:
            return msgpack.ExtType(EXT_COMPLEX, msgpack.packb([obj.real, obj.imag]))
        if isinstance(obj, RRefMarker):
            return msgpack.ExtType(EXT_RREF, msgpack.packb([obj.owner, obj.object_id]))
        rref = getattr(obj, "_wire_marker", None)  # an RRef (kept out of this module's imports)
        if rref is not None:
            return default(rref())
        # subclasses of the plain types travel as their base type (an OrderedDict as a dict, ...)
        if isinstance(obj, bool):
            return bool(obj)
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, dict):
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        if isinstance(obj, tuple):  # a namedtuple: its values, as a tuple
            return msgpack.ExtType(EXT_TUPLE, _pack(list(obj), default))
        raise Unsupported(obj)

    try:
        meta = _pack(msg, default)
    except Unsupported as e:
        raise _type_error(e, describe) from None
    except (OverflowError, ValueError) as e:  # e.g. a str with lone surrogates
        raise TypeError(f"cannot send this message: {e}") from None
    finally:
        # `default` refers to itself (nested tuples): break that cycle, which would keep the message's
        # tensors alive until the garbage collector runs
        default = None  # type: ignore[assignment]
    return Encoded(meta, tensors)


def _inline(obj: Any, slot: int) -> Any:
    """A small value whose array is there already, packed into the message (no staging, no table)."""
    if isinstance(obj, Tensor):
        if obj.numel() > INLINE_MAX_ELEMENTS:
            return None
        a = obj.value_if_ready()
        if a is None:
            return None
        kind = 2 if obj.requires_grad else 1
    else:
        a = obj
        kind = 0
    if a.nbytes > _INLINE_BYTES or a.size > INLINE_MAX_ELEMENTS:
        return None
    flags = a.flags
    if flags.c_contiguous:
        raw = a.tobytes()
    elif a.size == 0 or flags.f_contiguous or is_dense_nonoverlapping(a):
        raw = np.ravel(a, order="K").tobytes()  # memory order: the strides stay as they are
    else:
        a = np.ascontiguousarray(a)
        raw = a.tobytes()
    layout = (kind, a.dtype, a.shape, a.strides)
    head = _inline_heads.get(layout)
    if head is None:
        _check_dtype(a.dtype, obj)
        dts = a.dtype.str.encode()
        ndim = a.ndim
        head = _INLINE_HEAD.pack(kind, ndim, len(dts)) + dts + struct.pack(f"<{2 * ndim}q", *a.shape, *a.strides)
        if len(_inline_heads) < 1024:
            _inline_heads[layout] = head
    return msgpack.ExtType(EXT_INLINE, head + _SLOT.pack(slot) + raw)


# an inline value: kind u8, ndim u8, dtype length u8, dtype str, shape and strides (int64 each), slot u32, bytes
_INLINE_HEAD = struct.Struct("<BBB")
_SLOT = struct.Struct("<I")
_inline_heads: dict[tuple[Any, ...], bytes] = {}  # the bytes before the slot, per layout (made once)


_CACHED = 64
_TENSOR_EXT = {
    rg: [msgpack.ExtType(EXT_TENSOR, msgpack.packb([i, rg])) for i in range(_CACHED)] for rg in (False, True)
}
_ARRAY_EXT = [msgpack.ExtType(EXT_ARRAY, msgpack.packb(i)) for i in range(_CACHED)]
_tls = threading.local()  # per thread: free packers (a packer is reused; a nested tuple takes another)


class _Default:
    """The packer's ``default``: forwards to the hook of the message being packed."""

    __slots__ = ("hook",)
    hook: Any

    def __call__(self, obj: Any) -> Any:
        return self.hook(obj)


def _pack(obj: Any, default: Callable[[Any], Any]) -> bytes:
    free = getattr(_tls, "free", None)
    if free is None:
        free = _tls.free = []
    if free:
        packer, fwd = free.pop()
    else:
        fwd = _Default()
        packer = msgpack.Packer(default=fwd, strict_types=True, use_bin_type=True, datetime=False)
    fwd.hook = default
    try:
        return packer.pack(obj)  # type: ignore[no-any-return]
    except BaseException:
        packer.reset()
        raise
    finally:
        fwd.hook = None
        free.append((packer, fwd))


def _type_error(e: Unsupported, describe: Sequence[tuple[str, Any]]) -> TypeError:
    where = None
    for label, root in describe:
        where = _find(root, e.obj, label, 0)
        if where is not None:
            break
    obj = e.obj
    name = f"{type(obj).__module__}.{type(obj).__qualname__}" if type(obj).__module__ != "builtins" else (
        type(obj).__qualname__
    )
    what = f" ({e.why})" if e.why else ""
    at = f" at {where}" if where else ""
    return TypeError(
        f"cannot send a value of type {name!r}{at}{what}: the RPC wire carries None, bool, int, float, "
        "complex, str, bytes, list, tuple, dict, numpy arrays, scalars and dtypes, asyncgrad tensors and "
        "RRefs (never pickled objects); send plain data or tensors instead"
    )


def _find(root: Any, target: Any, path: str, depth: int) -> str | None:
    if root is target:
        return path
    if depth > 100:
        return None
    if isinstance(root, dict):
        for k, v in root.items():
            if k is target:
                return f"{path} (a key)"
            found = _find(v, target, f"{path}[{k!r}]", depth + 1)
            if found is not None:
                return found
    elif isinstance(root, (list, tuple)):
        for i, v in enumerate(root):
            found = _find(v, target, f"{path}[{i}]", depth + 1)
            if found is not None:
                return found
    return None


# ---- the staging kernel: a tensor's value copied into its wire buffer --------------------------------


def stage_kernel(a: np.ndarray, box: list[Any], shm: bool = False) -> np.ndarray:
    """Copy ``a`` into a fresh buffer of its wire layout: its own strides when it is dense and
    non-overlapping (C, Fortran, channels-last, any permutation), else C order. Runs on a pool stream's
    lane (or inline for a small ready value); puts (flat buffer, strides, shared segment or None) into
    ``box``. With ``shm`` a large buffer is a shared segment (handed to a local peer, never copied again).
    """
    nbytes = a.nbytes
    segment = None
    if shm and nbytes >= _shm.MIN_BYTES:
        segment = _shm.pool.take(nbytes)
        flat = segment.array(nbytes)
    else:
        flat = np.empty(nbytes, np.uint8)
    flags = a.flags
    if flags.c_contiguous or flags.f_contiguous or a.size == 0 or is_dense_nonoverlapping(a):
        strides = a.strides
    else:
        strides = _c_strides(a.shape, a.itemsize)
    out = np.ndarray(a.shape, a.dtype, buffer=flat, strides=strides)
    if nbytes >= _SPLIT_BYTES and strides == a.strides:
        # the same layout: copy the memory block in slices, on this lane and any idle sibling
        src = a.ravel(order="K")
        if src.__array_interface__["data"][0] == a.__array_interface__["data"][0]:
            src = src.view(np.uint8)
            step = -(-nbytes // _SPLITS // 4096) * 4096
            run_parts([_copier(flat[i : i + step], src[i : i + step]) for i in range(0, nbytes, step)])
            box.append((flat, strides, segment))
            return out
    np.copyto(out, a, casting="no")
    box.append((flat, strides, segment))
    return out


def _copier(dst: np.ndarray, src: np.ndarray) -> Callable[[], None]:
    return lambda: np.copyto(dst, src)


def stage_meta(a: Any, box: list[Any], shm: bool = False) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return a.shape, a.dtype


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out = []
    acc = itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


# ---- receiving -------------------------------------------------------------------------------------


def check_header(meta_len: int, table_len: int, payload_len: int, max_meta: int, max_frame: int) -> None:
    if meta_len == 0:
        raise ProtocolError("a frame with an empty message")
    if meta_len + table_len > max_meta:
        raise ProtocolError(f"a frame's message part of {meta_len + table_len} bytes exceeds the limit of {max_meta}")
    if payload_len > max_frame:
        raise ProtocolError(f"a frame's payload of {payload_len} bytes exceeds the limit of {max_frame}")
    if payload_len and not table_len:
        raise ProtocolError("a frame with a payload but no buffer table")


def read_table(
    table: bytes | bytearray | memoryview, payload_len: int, take_fd: Callable[[], int] | None = None
) -> list[tuple[np.ndarray | None, np.ndarray]]:
    """Validate a frame's buffer table and allocate each buffer. Returns (flat destination, array) pairs;
    the in-band ones (flat not None) add up to ``payload_len`` exactly. A buffer in a shared segment
    (``take_fd`` gives the descriptor that came with the frame) is mapped, and its flat is None."""
    if not table:
        return []
    try:
        entries = msgpack.unpackb(table, use_list=True, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"an unreadable buffer table: {type(e).__name__}: {e}") from None
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise ProtocolError("a buffer table that is not a list (or too long)")
    specs = []
    total = 0
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) in (4, 5)):
            raise ProtocolError(f"a malformed buffer table entry {entry!r:.80}")
        dts, shape, strides, nbytes = entry[:4]
        segment = entry[4] if len(entry) == 5 else None
        if not (
            _array_header(dts, shape, strides)
            and type(nbytes) is int
            and (segment is None or (type(segment) is int and segment >= nbytes))
        ):
            raise ProtocolError(f"a malformed buffer table entry {entry!r:.80}")
        dt = _dtype(dts)
        if math.prod(shape) * dt.itemsize != nbytes:
            raise ProtocolError(f"a buffer of {nbytes} bytes for shape {shape} of {dt}")
        if segment is None:
            total += nbytes
            if total > payload_len:
                raise ProtocolError("buffers larger than the frame's payload")
        elif take_fd is None:
            raise ProtocolError("a shared segment on a connection that cannot pass one")
        specs.append((dt, tuple(shape), tuple(strides), nbytes, segment))
    if total != payload_len:
        raise ProtocolError(f"buffers of {total} bytes for a payload of {payload_len}")
    out: list[tuple[np.ndarray | None, np.ndarray]] = []
    for dt, shape, strides, nbytes, segment in specs:
        if segment is None:
            flat = np.empty(nbytes, np.uint8)
            dest: np.ndarray | None = flat
        else:
            assert take_fd is not None
            try:
                flat = _shm.receive(take_fd(), segment).array(nbytes)
            except (OSError, ValueError) as e:
                raise ProtocolError(f"a shared segment that cannot be mapped: {e}") from None
            dest = None
        try:
            arr = np.ndarray(shape, dt, buffer=flat, strides=strides)
        except Exception as e:
            raise ProtocolError(f"strides {strides} do not fit shape {shape} of {dt}: {e}") from None
        if arr.size and not (arr.flags.c_contiguous or arr.flags.f_contiguous or is_dense_nonoverlapping(arr)):
            raise ProtocolError(f"strides {strides} of shape {shape} are not dense and non-overlapping")
        out.append((dest, arr))
    return out


_dtypes: dict[str, np.dtype[Any]] = {}


def _dtype(dts: str) -> np.dtype[Any]:
    """A plain numeric dtype from its wire name (parsed once)."""
    dt = _dtypes.get(dts)
    if dt is None:
        try:
            dt = np.dtype(dts)
        except Exception:
            raise ProtocolError(f"an unknown dtype {dts!r}") from None
        if dt.kind not in _ALLOWED_KINDS or dt.fields is not None or dt.subdtype is not None:
            raise ProtocolError(f"a dtype {dts!r} that is not plain numeric")
        if len(_dtypes) < 256:
            _dtypes[dts] = dt
    return dt


def _array_header(dts: Any, shape: Any, strides: Any) -> bool:
    """Whether a received (dtype string, shape, strides) has the types and sizes an array's can have."""
    return (
        type(dts) is str
        and len(dts) <= 8
        and type(shape) is list
        and type(strides) is list
        and len(shape) == len(strides) <= MAX_NDIM
        and _ints(shape, 0)
        and _ints(strides, None)
    )


def _ints(xs: list[Any], low: int | None) -> bool:
    for x in xs:
        if type(x) is not int or (low is not None and x < low):
            return False
    return True


class NoRuntime(Exception):
    """A tensor arrived where no asyncgrad runtime is open to hold it."""


def decode(
    meta: bytes | bytearray | memoryview,
    arrays: list[np.ndarray],
    make_tensor: Callable[[np.ndarray, bool], Any],
    resolve_rref: Callable[[str, int], Any] | None = None,
) -> Any:
    """Unpack a message; ext values become the given arrays (as tensors through ``make_tensor``)."""
    hook = _ExtHook(arrays, make_tensor, resolve_rref)
    try:
        msg = _unpack(meta, hook)
    except (ProtocolError, NoRuntime, LookupError):
        raise
    except Exception as e:
        raise ProtocolError(f"an unreadable message: {type(e).__name__}: {e}") from None
    finally:
        used = len(hook.used)
        hook.made.clear()  # nothing here may keep a received tensor alive once the message is gone
        hook.inlined.clear()
        hook.arrays = []
    if used != len(arrays):
        raise ProtocolError(f"a frame with {len(arrays)} buffers, {used} of them used")
    return msg


_REFS: dict[tuple[int, bytes], Any] = {}  # ext payloads of tensor references, unpacked once
# inline values' layouts (the bytes up to the slot), checked once: (dtype, shape, strides, nbytes)
_inline_layouts: dict[bytes, tuple[np.dtype[Any], tuple[int, ...], tuple[int, ...], int]] = {}


def _inline_layout(
    data: bytes, ndim: int, dtlen: int, end: int
) -> tuple[np.dtype[Any], tuple[int, ...], tuple[int, ...], int]:
    try:
        dts = data[3 : 3 + dtlen].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("a malformed inline value") from None
    dt = _dtype(dts)
    dims = struct.unpack_from(f"<{2 * ndim}q", data, 3 + dtlen)
    shape, strides = dims[:ndim], dims[ndim:]
    if min(shape, default=0) < 0:
        raise ProtocolError(f"an inline value of shape {list(shape)}")
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes > _INLINE_BYTES:
        raise ProtocolError(f"an inline value of {nbytes} bytes (at most {_INLINE_BYTES})")
    try:  # the layout checked on a buffer of its size: it must fit, dense and non-overlapping
        arr = np.ndarray(shape, dt, buffer=bytearray(nbytes), strides=strides)
    except Exception as e:
        raise ProtocolError(f"strides {list(strides)} do not fit shape {list(shape)} of {dt}: {e}") from None
    if arr.size and not (arr.flags.c_contiguous or arr.flags.f_contiguous or is_dense_nonoverlapping(arr)):
        raise ProtocolError(f"strides {list(strides)} of shape {list(shape)} are not dense and non-overlapping")
    return dt, shape, strides, nbytes


class _ExtHook:
    """msgpack's ``ext_hook`` for one message (an object, not a closure: no reference cycle that would
    keep the message's tensors alive until the garbage collector runs)."""

    __slots__ = ("arrays", "inlined", "made", "make_tensor", "resolve_rref", "used")

    def __init__(self, arrays: list[np.ndarray], make_tensor: Any, resolve_rref: Any) -> None:
        self.arrays = arrays
        self.make_tensor = make_tensor
        self.resolve_rref = resolve_rref
        self.made: dict[int, Any] = {}
        self.used: set[int] = set()
        self.inlined: dict[int, Any] = {}

    def _inline(self, data: bytes) -> Any:
        n = len(data)
        if n < 3:
            raise ProtocolError("a malformed inline value")
        kind, ndim, dtlen = _INLINE_HEAD.unpack_from(data)
        end = 3 + dtlen + 16 * ndim
        if kind > 2 or ndim > MAX_NDIM or dtlen > 8 or n < end + 4:
            raise ProtocolError("a malformed inline value")
        head = data[:end]
        layout = _inline_layouts.get(head)
        if layout is None:
            layout = _inline_layout(data, ndim, dtlen, end)
            if len(_inline_layouts) < 1024:
                _inline_layouts[head] = layout
        dt, shape, strides, nbytes = layout
        (slot,) = _SLOT.unpack_from(data, end)
        if slot != len(self.inlined):
            raise ProtocolError("a malformed inline value")
        if n - end - 4 != nbytes:
            raise ProtocolError(f"an inline value of {n - end - 4} bytes for shape {list(shape)} of {dt}")
        # a writable buffer of our own (the layout was checked to fit it)
        arr = np.ndarray(shape, dt, buffer=bytearray(memoryview(data)[end + 4 :]), strides=strides)
        value = arr if kind == 0 else self.make_tensor(arr, kind == 2)
        self.inlined[slot] = value
        return value

    def __call__(self, code: int, data: bytes) -> Any:
        if code == EXT_TENSOR or code == EXT_ARRAY:
            ref = _REFS.get((code, data))
            if ref is None:
                v = msgpack.unpackb(data)
                ref = v if code == EXT_TENSOR and isinstance(v, list) and len(v) == 2 else (v, None)
                if len(_REFS) < 1024:
                    _REFS[code, data] = ref
            i, rg = ref
            arrays = self.arrays
            if type(i) is not int or not 0 <= i < len(arrays):
                raise ProtocolError(f"a reference to buffer {i!r} of {len(arrays)}")
            self.used.add(i)
            if code == EXT_ARRAY:
                return arrays[i]
            t = self.made.get(i)
            if t is None:
                t = self.made[i] = self.make_tensor(arrays[i], bool(rg))
            return t
        if code == EXT_INLINE:
            return self._inline(data)
        if code == EXT_INLINE_REF:
            v = msgpack.unpackb(data)
            got = self.inlined.get(v) if type(v) is int else None
            if got is None:
                raise ProtocolError(f"a reference to an inline value {v!r} not sent before")
            return got
        if code == EXT_TUPLE:
            v = _unpack(data, self)
            if not isinstance(v, list):
                raise ProtocolError("a malformed tuple")
            return tuple(v)
        if code == EXT_NPSCALAR:
            v = msgpack.unpackb(data, raw=False)
            if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], bytes)):
                raise ProtocolError("a malformed numpy scalar")
            dt = np.dtype(v[0])
            if dt.kind not in _ALLOWED_KINDS or dt.itemsize != len(v[1]) or dt.fields is not None:
                raise ProtocolError("a malformed numpy scalar")
            return np.frombuffer(v[1], dt)[0]
        if code == EXT_BIGINT:
            if len(data) > 10000:
                raise ProtocolError("an integer of more than 10000 digits")
            return int(data.decode("ascii"))
        if code == EXT_COMPLEX:
            v = msgpack.unpackb(data)
            if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, float) for x in v)):
                raise ProtocolError("a malformed complex number")
            return complex(v[0], v[1])
        if code == EXT_DTYPE:
            dt = np.dtype(data.decode("ascii"))
            if dt.kind not in _ALLOWED_KINDS or dt.fields is not None or dt.subdtype is not None:
                raise ProtocolError("a dtype that is not plain numeric")
            return dt
        if code == EXT_RREF:
            v = msgpack.unpackb(data, raw=False)
            if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and type(v[1]) is int):
                raise ProtocolError("a malformed RRef")
            if self.resolve_rref is None:
                raise ProtocolError("an RRef where none is expected")
            return self.resolve_rref(v[0], v[1])
        raise ProtocolError(f"an unknown ext type {code}")


def _unpack(data: Any, ext_hook: Callable[[int, bytes], Any]) -> Any:
    return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False, use_list=True)


def plain(value: Any) -> bool:
    """Whether ``value`` is built only of msgpack's own types (used for exception args)."""
    t = type(value)
    if t in (list, tuple):
        return all(plain(v) for v in value)
    if t is dict:
        return all(plain(k) and plain(v) for k, v in value.items())
    return t in _PLAIN and (t is not int or -(1 << 63) <= value < (1 << 64))
