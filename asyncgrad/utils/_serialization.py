"""`save` / `load`: checkpoints as safetensors files, with no pickle anywhere.

Why safetensors: it is the format made for exactly this (a JSON header naming each tensor's dtype, shape and
byte range, then the raw bytes), it is well kept, and other tools read it (``safetensors.torch.load_file``
gives PyTorch a state dict back). A file is written by the ``safetensors`` library; nesting and plain values
(dicts, lists, tuples, None, bool, int, float, str) travel as one JSON document in the header's
``__metadata__`` under ``"asyncgrad"``, in a closed vocabulary of tags, so loading builds only containers,
numbers, strings and arrays: it can never run code.

Tensors keep their dtype and their layout: a dense tensor stored in another order (channels-last, a transpose)
is written in its memory order with the permutation recorded, and comes back with the same strides. Arrays
saved together whose memory overlaps (a tensor and its transpose, slices, unfold windows: views of one buffer)
are written as that buffer once, each recorded as a view of it (element offset, shape, strides), and load as
views of one buffer again, sharing one version counter, as PyTorch's ``torch.save`` stores one storage for its
views; the buffer keeps the name of a member that covers it densely (other tools then read that member as it
is), else it is an entry ``<first member>.storage``. Tensors are named by their place in the object
(``"fc.weight"`` for a state dict key, ``"state.0.exp_avg"`` deeper), so a saved state dict is a plain
safetensors state dict to other tools.

Loading validates the whole header itself before touching any data (size limits, JSON shape, dtypes, shapes
against byte ranges, ranges inside the file and not overlapping) and views the tensors in one buffer (no copy
per tensor); a view is checked to lie inside its entry, with non-negative strides and bounded sizes (at most
`MAX_VIEW_EXPANSION` times the elements of its entry). A pickle, a PyTorch zip checkpoint, a truncated or
oversized header, or a header that lies about sizes is refused with a ValueError saying what is wrong.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import IO, Any

import numpy as np

from ..devices import Device
from ..devices import device as device_spec
from ..nn import Parameter
from ..runtime import Tensor, current_runtime, from_numpy, no_grad, share_version

__all__ = ["MAX_HEADER_BYTES", "MAX_NESTING", "load", "save"]

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_NESTING = 64  # containers inside containers, in a saved object
# a tensor stored as a view of a buffer has at most this many times the elements its memory spans (an unfold
# with overlapping windows has more elements than memory); one with more is stored as a dense copy
MAX_VIEW_EXPANSION = 64
_MAX_DIMS = 64  # numpy's limit
_MAX_INDEX = 1 << 62  # bytes: offsets, strides and sizes of a view stay below numpy's index range
_META_KEY = "asyncgrad"
_FORMAT_VERSION = 1

# safetensors dtype codes <-> numpy (bfloat16 has no numpy dtype)
_CODES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
}
_DTYPE_CODES = {v: k for k, v in _CODES.items()}

PathOrFile = str | os.PathLike[str] | IO[bytes]


# ---- save -------------------------------------------------------------------------------------------


def save(obj: Any, f: PathOrFile, **kwargs: Any) -> None:
    """Save ``obj`` to ``f`` (a path or a binary file object) as a safetensors file, without pickle.

    Args:
        obj: A Tensor, a numpy array, or dicts / lists / tuples nesting them and plain values (None,
            bool, int, float, str; dtypes and devices too). Dict keys may be str, int, float, bool or
            None. The same Tensor object appearing twice is stored once and comes back as one object;
            tensors and arrays viewing one buffer store it once and come back as views of one buffer.
        f: A path (parent directories are not created) or a file object opened for binary writing.
        **kwargs: PyTorch's ``pickle_module`` / ``pickle_protocol`` / ``_use_new_zipfile_serialization``
            are accepted and ignored (nothing is pickled).

    Raises:
        TypeError: For a value of another type (named with its place in ``obj``), or a dtype safetensors
            cannot hold.
    """
    unknown = set(kwargs) - {"pickle_module", "pickle_protocol", "_use_new_zipfile_serialization"}
    if unknown:
        raise TypeError(f"asyncgrad.save() got unexpected keyword argument(s) {sorted(unknown)}")
    enc = _Encoder()
    structure = enc.encode(obj, (), 0)
    enc.store()
    meta = {_META_KEY: json.dumps({"version": _FORMAT_VERSION, "obj": structure}, allow_nan=True)}
    import safetensors.numpy

    data = safetensors.numpy.save(enc.arrays, metadata=meta)
    if hasattr(f, "write"):
        f.write(data)  # type: ignore[union-attr]
    else:
        with open(f, "wb") as fh:  # type: ignore[arg-type]
            fh.write(data)


class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self._by_id: dict[int, str] = {}
        self._keep: list[Any] = []  # keeps encoded objects alive so their ids stay unique
        self._found: list[tuple[dict[str, Any], np.ndarray]] = []  # (node, array), in encoding order
        self._used: set[str] = set()  # every name given: entries, and the views' names in the structure

    def _name(self, path: tuple[str, ...]) -> str:
        base = ".".join(path) or "tensor"
        name, i = base, 1
        while name in self._used:
            name = f"{base}#{i}"
            i += 1
        self._used.add(name)
        return name

    def _array(self, arr: np.ndarray, path: tuple[str, ...], node: dict[str, Any]) -> str:
        """Name ``arr`` (its node is finished by `store`, once every array of the object is known)."""
        if arr.dtype not in _DTYPE_CODES:
            raise TypeError(
                f"asyncgrad.save: {_where(path)} has dtype {arr.dtype}, which safetensors cannot store "
                f"(supported: {', '.join(sorted(str(d) for d in _DTYPE_CODES))})"
            )
        name = self._name(path)
        self.arrays[name] = arr  # reserves the name; `store` puts what is written in its place
        node["k"] = name
        self._found.append((node, arr))
        return name

    def store(self) -> None:
        """Decide what is written: an array sharing no memory with another is stored alone, dense (in its
        memory order, the permutation noted); arrays viewing one buffer are stored as that buffer once,
        each of them a view of it (offset, shape, strides), as PyTorch stores one storage for its views."""
        for group in _sharing_groups(self._found):
            if len(group) == 1 or not self._store_views(group):
                for node, arr in group:
                    self._store_alone(node, arr)

    def _store_alone(self, node: dict[str, Any], arr: np.ndarray) -> None:
        perm = _memory_order(arr)
        stored = arr if perm is None else arr.transpose(perm)
        if not stored.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
            stored = np.array(stored, order="C")
        self.arrays[node["k"]] = stored
        if perm is not None:
            node["perm"] = perm

    def _store_views(self, group: list[tuple[dict[str, Any], np.ndarray]]) -> bool:
        """Store ``group`` (one dtype, overlapping memory) as one buffer and views of it; False if some
        member's offset is not a whole number of elements from the buffer's start (then each is stored alone)."""
        isz = group[0][1].itemsize
        bounds = [_byte_bounds(a) for _, a in group]
        lo, hi = min(b[0] for b in bounds), max(b[1] for b in bounds)
        if any((b[0] - lo) % isz for b in bounds) or (hi - lo) % isz:
            return False
        # a member that is the whole buffer, densely, keeps its place and shape (other tools read it as
        # it is); otherwise the buffer is an entry of its own, next to the first member's name
        holder = None
        for (node, arr), b in zip(group, bounds):
            if b == (lo, hi) and arr.nbytes == hi - lo and (arr.flags.c_contiguous or _memory_order(arr)):
                holder = node
                self._store_alone(node, arr)
                break
        if holder is None:
            # the buffer's bytes, read through the member that starts there (strides are non-negative: its
            # data pointer is its lowest byte), copied once
            first = next(a for (_, a), b in zip(group, bounds) if b[0] == lo)
            span = np.lib.stride_tricks.as_strided(first, ((hi - lo) // isz,), (isz,), writeable=False)
            buf_name = self._name((group[0][0]["k"], "storage"))
            self.arrays[buf_name] = np.array(span)
        else:
            buf_name = holder["k"]
        for (node, arr), b in zip(group, bounds):
            if node is holder:
                continue
            del self.arrays[node["k"]]  # the name stays the member's identity in the structure
            node["view"] = {
                "of": buf_name,
                "offset": (b[0] - lo) // isz,
                "shape": list(arr.shape),
                "stride": [st // isz for st in arr.strides],
            }
        return True

    def encode(self, x: Any, path: tuple[str, ...], depth: int) -> Any:
        if depth > MAX_NESTING:
            raise TypeError(f"asyncgrad.save: {_where(path)} is nested more than {MAX_NESTING} containers deep")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return x
        if isinstance(x, np.generic) and not isinstance(x, np.void):
            return {"T": "scalar", "dtype": str(x.dtype), "v": x.item()} if x.dtype in _DTYPE_CODES else _bad(x, path)
        if isinstance(x, Tensor):
            known = self._by_id.get(id(x))
            if known is not None:
                return {"T": "ref", "k": known}
            # a non-leaf's value is saved (it loads as a leaf), as PyTorch does
            node: dict[str, Any] = {"T": "tensor"}
            name = self._array(x.detach().cpu().numpy(), path, node)
            self._by_id[id(x)] = name
            self._keep.append(x)
            node["device"] = str(x.device)
            if x.requires_grad and x.is_leaf:
                node["rg"] = True
            if isinstance(x, Parameter):
                node["param"] = True
            return node
        if isinstance(x, np.ndarray):
            known = self._by_id.get(id(x))
            if known is not None:
                return {"T": "ref", "k": known}
            node = {"T": "ndarray"}
            self._by_id[id(x)] = self._array(x, path, node)
            self._keep.append(x)
            return node
        if isinstance(x, np.dtype):
            return {"T": "dtype", "v": str(x)}
        if isinstance(x, (device_spec, Device)):
            return {"T": "device", "v": str(x)}
        if isinstance(x, Mapping):
            items = []
            for k, v in x.items():
                if not (k is None or isinstance(k, (str, int, float))):
                    raise TypeError(
                        f"asyncgrad.save: {_where(path)} has a key of type {type(k).__name__}; keys must be "
                        "str, int, float, bool or None"
                    )
                items.append([self.encode(k, path, depth + 1), self.encode(v, (*path, str(k)), depth + 1)])
            return {"T": "odict" if isinstance(x, OrderedDict) else "dict", "items": items}
        if isinstance(x, (list, tuple)):
            vals = [self.encode(v, (*path, str(i)), depth + 1) for i, v in enumerate(x)]
            return {"T": "list" if isinstance(x, list) else "tuple", "items": vals}
        return _bad(x, path)


def _bad(x: Any, path: tuple[str, ...]) -> Any:
    raise TypeError(
        f"asyncgrad.save: {_where(path)} is a {type(x).__name__}; only tensors, numpy arrays, dicts, lists, "
        "tuples, None, bool, int, float, str, dtypes and devices can be saved (nothing is pickled); "
        "save a state_dict() rather than the object"
    )


def _where(path: tuple[str, ...]) -> str:
    return "the object" if not path else "obj[" + "][".join(repr(p) for p in path) + "]"


def _byte_bounds(arr: np.ndarray) -> tuple[int, int]:
    lo, hi = np.lib.array_utils.byte_bounds(arr)
    return int(lo), int(hi)


def _groupable(arr: np.ndarray) -> bool:
    """Whether ``arr`` may be stored as a view of a buffer: not empty, strides non-negative whole elements,
    and no more elements than `MAX_VIEW_EXPANSION` times the elements its memory spans (what `load` allows)."""
    if arr.size == 0 or any(st < 0 or st % arr.itemsize for st in arr.strides):
        return False
    lo, hi = _byte_bounds(arr)
    return arr.size <= MAX_VIEW_EXPANSION * ((hi - lo) // arr.itemsize)


def _sharing_groups(found: list[tuple[dict[str, Any], np.ndarray]]) -> list[list[tuple[dict[str, Any], np.ndarray]]]:
    """``found`` split into groups of one dtype whose memory ranges overlap (arrays of one buffer: a tensor
    and its views), each in encoding order; an array that cannot be a view (`_groupable`) is a group alone."""
    groups: list[list[int]] = []
    spans: list[tuple[int, int, int]] = []  # (lo, hi, index in found)
    for i, (_, arr) in enumerate(found):
        if _groupable(arr):
            lo, hi = _byte_bounds(arr)
            spans.append((lo, hi, i))
        else:
            groups.append([i])
    spans.sort()
    open_: dict[np.dtype[Any], tuple[int, list[int]]] = {}  # dtype -> (end of its open group, the group)
    for lo, hi, i in spans:
        dt = found[i][1].dtype
        cur = open_.get(dt)
        if cur is not None and lo < cur[0]:
            cur[1].append(i)
            open_[dt] = (max(cur[0], hi), cur[1])
        else:
            open_[dt] = (hi, [i])
            groups.append(open_[dt][1])
    return [[found[i] for i in sorted(g)] for g in sorted(groups, key=min)]


def _memory_order(arr: np.ndarray) -> list[int] | None:
    """The axis permutation that makes a dense non-C-contiguous ``arr`` C-contiguous, or None (C order
    already, or not dense: then it is stored C-contiguous)."""
    if arr.ndim < 2 or arr.flags.c_contiguous:
        return None
    perm = sorted(range(arr.ndim), key=lambda i: (-abs(arr.strides[i]), i))
    if arr.transpose(perm).flags.c_contiguous:
        return perm
    return None


# ---- load -------------------------------------------------------------------------------------------


def load(
    f: PathOrFile,
    map_location: Any = None,
    weights_only: bool | None = None,
    *,
    mmap: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Load an object saved by `save` (or any safetensors file) from a path or a binary file object.

    Never unpickles and never runs code: the file is checked before anything is built from it.

    Args:
        f: A path or a file object opened for binary reading.
        map_location: Where tensors go: None (the device they were saved from), a device name or
            ``asyncgrad.device``, a dict ``{saved_device: device}``, or a callable
            ``(tensor, saved_device_name) -> tensor``.
        weights_only: Accepted for PyTorch programs; loading is always weights-only here (True or
            False behave the same: there is nothing else a file can hold).
        mmap: Accepted and ignored (the file is read into one buffer that the tensors view).
        **kwargs: PyTorch's ``pickle_module`` and pickle load arguments are accepted and ignored.

    Returns:
        The saved object; a safetensors file written by another tool gives ``{name: Tensor}``.
        Tensors need an open runtime; numpy arrays saved as such come back as numpy arrays.

    Raises:
        ValueError: If the file is not a valid safetensors file (a pickle or PyTorch zip checkpoint, a
            truncated file, a header over `MAX_HEADER_BYTES`, a header that lies about sizes) or its
            asyncgrad structure is malformed.
    """
    unknown = set(kwargs) - {"pickle_module", "encoding", "errors", "fix_imports"}
    if unknown:
        raise TypeError(f"asyncgrad.load() got unexpected keyword argument(s) {sorted(unknown)}")
    buf, where = _read_all(f)
    header, data_start = _parse_header(buf, where)
    meta = header.pop("__metadata__", None)
    views = _views(buf, data_start, header, where)
    dec = _Decoder(views, map_location, where)
    if meta is not None and _META_KEY in meta:
        try:
            doc = json.loads(meta[_META_KEY])
        except (ValueError, RecursionError) as e:
            raise ValueError(f"asyncgrad.load: {where}: the asyncgrad structure is not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("version") != _FORMAT_VERSION or "obj" not in doc:
            raise ValueError(
                f"asyncgrad.load: {where}: the asyncgrad structure has an unknown layout or version "
                f"(expected version {_FORMAT_VERSION})"
            )
        return dec.decode(doc["obj"], 0)
    # a plain safetensors file (e.g. from safetensors.torch.save_file): its tensors by name
    return OrderedDict((k, dec.tensor(k, None, "cpu", False, False)) for k in views)


def _read_all(f: PathOrFile) -> tuple[bytearray, str]:
    if hasattr(f, "read"):
        if isinstance(f, io.TextIOBase):
            raise TypeError("asyncgrad.load: the file object must be opened in binary mode ('rb')")
        data = f.read()  # type: ignore[union-attr]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("asyncgrad.load: the file object must be opened in binary mode ('rb')")
        return bytearray(data), getattr(f, "name", "<file object>")
    where = os.fspath(f)  # type: ignore[arg-type]
    size = os.path.getsize(where)
    buf = bytearray(size)
    with open(where, "rb") as fh:
        got = fh.readinto(buf)
    if got != size:
        raise ValueError(f"asyncgrad.load: {where!r} changed while being read ({got} of {size} bytes)")
    return buf, repr(where)


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(f"asyncgrad.load: {where} is not a valid checkpoint: {what}")


def _kind_hint(buf: bytearray) -> str:
    """What a file that is not safetensors seems to be, for the error message."""
    if buf[:2] == b"PK":
        return (" (it is a zip archive: a PyTorch torch.save checkpoint holds pickles, which asyncgrad never "
                "loads; convert it once where you trust it, e.g. safetensors.torch.save_file(torch.load(path), out))")
    if buf[:1] == b"\x80" or buf[:1] in (b"(", b"c", b"}", b"]"):
        return " (it looks like a pickle, which asyncgrad never loads: it could run code)"
    return ""


def _parse_header(buf: bytearray, where: str) -> tuple[dict[str, Any], int]:
    if len(buf) < 8:
        raise _refuse(where, f"it has {len(buf)} bytes, fewer than the 8-byte safetensors header length"
                      + _kind_hint(buf))
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > MAX_HEADER_BYTES:
        raise _refuse(where, f"its header claims {n} bytes, over the {MAX_HEADER_BYTES}-byte limit" + _kind_hint(buf))
    if 8 + n > len(buf):
        raise _refuse(where, f"its header claims {n} bytes but the file has only {len(buf) - 8} after the length"
                      + _kind_hint(buf))
    if n < 2 or buf[8:9] != b"{":
        raise _refuse(where, "its header does not start with a JSON object" + _kind_hint(buf))
    try:
        header = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        what = f"its header is not valid UTF-8 JSON ({type(e).__name__}: {e})"
        raise _refuse(where, what + _kind_hint(buf)) from None
    if not isinstance(header, dict):
        raise _refuse(where, "its header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _refuse(where, "its __metadata__ is not a string-to-string map")
    return header, 8 + n


def _views(buf: bytearray, start: int, header: dict[str, Any], where: str) -> dict[str, np.ndarray]:
    """Check every entry's dtype, shape and byte range, then view the arrays in ``buf`` (no copies)."""
    size = len(buf) - start
    spans: list[tuple[int, int, str]] = []
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if not (isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"}):
            raise _refuse(where, f"entry {name!r} must have exactly dtype, shape and data_offsets")
        dt = _CODES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dt is None:
            raise _refuse(where, f"entry {name!r} has dtype {info['dtype']!r}, not one asyncgrad reads "
                          f"({', '.join(_CODES)})")
        shape, offs = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            raise _refuse(where, f"entry {name!r} has a bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            raise _refuse(where, f"entry {name!r} has bad data_offsets {offs!r}")
        b, e = offs
        nbytes = math.prod(shape) * dt.itemsize
        if not 0 <= b <= e <= size:
            raise _refuse(where, f"entry {name!r} claims bytes [{b}, {e}) but the data section has {size} bytes")
        if e - b != nbytes:
            raise _refuse(where, f"entry {name!r} of shape {shape} and dtype {dt} needs {nbytes} bytes but claims "
                          f"{e - b}")
        spans.append((b, e, name))
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise _refuse(where, f"entries {n0!r} and {n1!r} overlap")
    mv = memoryview(buf)
    for b, e, name in spans:
        info = header[name]
        dt = _CODES[info["dtype"]]
        arr = np.frombuffer(mv[start + b : start + e], dtype=dt.newbyteorder("<")).reshape(info["shape"])
        if not arr.dtype.isnative:
            arr = arr.astype(dt)
        if not arr.flags.aligned:
            arr = arr.copy()
        out[name] = arr
    return out


_SCALAR_TAGS = frozenset({"dtype", "device", "scalar"})


class _Decoder:
    def __init__(self, views: dict[str, np.ndarray], map_location: Any, where: str) -> None:
        self._views = views
        self._map = map_location
        self._where = where
        self._made: dict[str, Any] = {}
        self._family: dict[str, Tensor] = {}  # entry -> the first CPU tensor made on its memory

    def _bad(self, what: str) -> ValueError:
        return _refuse(self._where, f"its asyncgrad structure {what}")

    def decode(self, x: Any, depth: int) -> Any:
        if depth > MAX_NESTING + 1:
            raise self._bad(f"is nested more than {MAX_NESTING} containers deep")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if not isinstance(x, dict) or not isinstance(x.get("T"), str):
            raise self._bad(f"has an untagged {type(x).__name__}")
        tag = x["T"]
        if tag in ("list", "tuple"):
            items = x.get("items")
            if not isinstance(items, list):
                raise self._bad(f"has a {tag} without items")
            vals = [self.decode(v, depth + 1) for v in items]
            return vals if tag == "list" else tuple(vals)
        if tag in ("dict", "odict"):
            items = x.get("items")
            if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
                raise self._bad(f"has a {tag} whose items are not [key, value] pairs")
            out: dict[Any, Any] = OrderedDict() if tag == "odict" else {}
            for k, v in items:
                key = self.decode(k, depth + 1)
                if not (key is None or isinstance(key, (str, int, float))):
                    raise self._bad(f"has a dict key of type {type(key).__name__}")
                out[key] = self.decode(v, depth + 1)
            return out
        if tag in ("tensor", "ndarray", "ref"):
            k = x.get("k")
            if tag == "ref":
                if not isinstance(k, str) or k not in self._made:
                    raise self._bad(f"refers to {k!r} before it is defined")
                return self._made[k]
            view = x.get("view")
            if view is not None:
                if not isinstance(k, str) or k in self._views:
                    raise self._bad(f"names a view {k!r} that is not a fresh name (it must not be a stored entry)")
            elif not isinstance(k, str) or k not in self._views:
                raise self._bad(f"names a tensor {k!r} that the file does not hold")
            if k in self._made:
                raise self._bad(f"defines tensor {k!r} twice")
            if view is not None:
                entry, arr = self._view(k, view)
                perm = None
            else:
                entry, arr = k, self._views[k]
                perm = x.get("perm")
                if perm is not None:
                    if not (isinstance(perm, list) and sorted(perm) == list(range(arr.ndim))
                            and all(type(p) is int for p in perm)):
                        raise self._bad(f"has a bad permutation {perm!r} for {k!r}")
            if tag == "ndarray":
                res: Any = arr if perm is None else arr.transpose(np.argsort(perm))
            else:
                dev = x.get("device", "cpu")
                if not isinstance(dev, str):
                    raise self._bad(f"has a bad device for {k!r}")
                res = self.tensor(k, perm, dev, bool(x.get("rg")), bool(x.get("param")), arr)
                self._same_memory(entry, res)
            self._made[k] = res
            return res
        if tag == "dtype":
            try:
                return np.dtype(str(x.get("v")))
            except TypeError:
                raise self._bad(f"has an unknown dtype {x.get('v')!r}") from None
        if tag == "device":
            try:
                return device_spec(str(x.get("v")))
            except (RuntimeError, TypeError):
                raise self._bad(f"has an unknown device {x.get('v')!r}") from None
        if tag == "scalar":
            dt = np.dtype(str(x.get("dtype"))) if str(x.get("dtype")) in {str(d) for d in _DTYPE_CODES} else None
            v = x.get("v")
            if dt is None or not isinstance(v, (bool, int, float, list)):
                raise self._bad("has a bad numpy scalar")
            return np.array(complex(*v) if isinstance(v, list) else v, dtype=dt)[()]
        raise self._bad(f"has an unknown tag {tag!r}")

    def _view(self, k: str, view: Any) -> tuple[str, np.ndarray]:
        """The array of view node ``k``: its entry's elements at ``offset`` with ``shape`` and ``stride``
        (in elements), checked to lie inside the entry, with non-negative strides and a bounded size."""
        if not (isinstance(view, dict) and set(view) == {"of", "offset", "shape", "stride"}):
            raise self._bad(f"has a view {k!r} without exactly of, offset, shape and stride")
        of, off, shape, stride = view["of"], view["offset"], view["shape"], view["stride"]
        if not isinstance(of, str) or of not in self._views:
            raise self._bad(f"has a view {k!r} of {of!r}, which the file does not hold")
        flat = self._views[of].reshape(-1)  # the entries are C-contiguous: a view of the buffer
        isz = flat.itemsize

        def ok(v: Any) -> bool:  # non-negative ints whose byte sizes fit numpy's index type
            return isinstance(v, list) and all(type(i) is int and 0 <= i <= _MAX_INDEX // isz for i in v)

        if not (ok([off]) and ok(shape) and ok(stride) and len(shape) == len(stride) <= _MAX_DIMS
                and math.prod(max(d, 1) for d in shape) <= _MAX_INDEX // isz):
            raise self._bad(
                f"has a view {k!r} with a bad offset {off!r}, shape {shape!r} or strides {stride!r} (non-negative "
                f"ints of bounded size, as many strides as dims, at most {_MAX_DIMS} dims)"
            )
        n, numel = flat.size, math.prod(shape)
        last = off + sum((d - 1) * st for d, st in zip(shape, stride)) if numel else off - 1
        if last >= n or off > n:
            raise self._bad(
                f"has a view {k!r} (offset {off}, shape {shape}, strides {stride}) reaching element {max(last, off)} "
                f"of {of!r}, which has {n}"
            )
        if numel > MAX_VIEW_EXPANSION * n:
            raise self._bad(
                f"has a view {k!r} of {numel} elements over {n} stored ones (more than {MAX_VIEW_EXPANSION} times)"
            )
        # a zero stride on a dim of more than one element makes elements share memory: read-only, as an
        # expanded tensor is (PyTorch refuses in-place writes to it); other views write through
        repeats = any(st == 0 and d > 1 for d, st in zip(shape, stride))
        arr = np.lib.stride_tricks.as_strided(
            flat[off:], tuple(shape), tuple(st * isz for st in stride), writeable=not repeats
        )
        return of, arr

    def _same_memory(self, entry: str, t: Tensor) -> None:
        """Tensors loaded from one entry share its memory: give them one version counter (as views do)."""
        if t.device.type != "cpu" or not np.may_share_memory(t.numpy(), self._views[entry]):
            return  # moved elsewhere by map_location: a copy of its own
        first = self._family.get(entry)
        if first is None:
            self._family[entry] = t
        else:
            share_version(first, t)

    def tensor(
        self, k: str, perm: list[int] | None, saved_dev: str, rg: bool, param: bool, arr: np.ndarray | None = None
    ) -> Tensor:
        if arr is None:
            arr = self._views[k]
        if perm is not None:
            arr = arr.reshape(arr.shape).transpose(np.argsort(perm))
        m = self._map
        target: Any = saved_dev
        if isinstance(m, Mapping):
            target = m.get(saved_dev, saved_dev)
        elif m is not None and not callable(m):
            target = m
        rt = current_runtime("asyncgrad.load (tensors)")
        try:
            dev = rt.device(target)
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(
                f"asyncgrad.load: tensor {k!r} was saved on {saved_dev!r}, which cannot be opened here ({e}); "
                "pass map_location='cpu'"
            ) from None
        t = from_numpy(arr)
        if dev.type != "cpu" or dev is not t.device:
            with no_grad():
                t = t.to(dev)
        if callable(m) and not isinstance(m, (str, device_spec, Device)) and not isinstance(m, Mapping):
            t = _call_map(m, t, saved_dev)
        if param:
            t = Parameter(t, requires_grad=rg)
        elif rg:
            t.requires_grad_(True)
        return t


def _call_map(m: Callable[[Tensor, str], Any], t: Tensor, loc: str) -> Tensor:
    out = m(t, loc)
    if out is None:
        return t
    if not isinstance(out, Tensor):
        raise TypeError(f"asyncgrad.load: map_location returned a {type(out).__name__}, not a Tensor")
    return out
