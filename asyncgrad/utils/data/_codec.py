"""The frames a `DataLoader` and its worker processes exchange over pipes: msgpack for the nesting, raw
buffers for arrays (nothing is pickled).

A frame is a 16-byte prefix (magic, header length, body length), a msgpack header and a body holding the
arrays' bytes, each at a 64-byte aligned offset. The header's tree tags every container: ``["l", items]``,
``["t", items]`` (tuple), ``["d", k0, v0, k1, v1, ...]``, ``["n", module, qualname, items]`` (a named tuple
whose class the receiver already has), ``["a", dtype, shape, offset]`` (an array), ``["T", ...]`` (an
array the receiver turns into a Tensor), ``["g", dtype, bytes]`` (a numpy scalar); None, bools, ints,
floats, strings and bytes are themselves. Anything else is a `TypeError` naming the type and where it sits.
A malformed frame (bad magic, sizes over the limits, an array outside the body, an unknown tag) is a
`ValueError`.
"""

from __future__ import annotations

import os
import select
import struct
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np

__all__ = ["FrameError", "WorkerEOF", "decode", "encode", "frame_prefix", "read_frame", "write_frame"]

MAGIC = b"AGDL"
_PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 64 << 20
MAX_BODY = 64 << 30
_ALIGN = 64
_MAX_DEPTH = 64
_KINDS = "biufcSUmM"  # dtypes whose bytes are the whole value (no objects, no structured records)


class FrameError(ValueError):
    """A malformed frame."""


class WorkerEOF(EOFError):
    """The other end closed the pipe (mid-frame when ``partial``)."""

    def __init__(self, partial: bool) -> None:
        super().__init__("pipe closed" + (" mid-frame" if partial else ""))
        self.partial = partial


class _Enc:
    def __init__(self, tensor_arrays: bool, tensor_type: type | None, tensor_value: Callable[[Any], Any]) -> None:
        self.tensor_arrays = tensor_arrays
        self.tensor_type = tensor_type
        self.tensor_value = tensor_value
        self.bufs: list[memoryview] = []
        self.size = 0

    def array(self, a: np.ndarray, tag: str, where: str) -> list[Any]:
        if a.dtype.kind not in _KINDS or a.dtype.hasobject or a.dtype.fields is not None:
            raise TypeError(f"DataLoader worker: cannot send a numpy array of dtype {a.dtype} (at {where})")
        a = np.ascontiguousarray(a)
        off = -(-self.size // _ALIGN) * _ALIGN
        self.size = off + a.nbytes
        self.bufs.append(a.reshape(-1).view(np.uint8).data if a.nbytes else memoryview(b""))
        return [tag, a.dtype.str, list(a.shape), off]

    def tree(self, x: Any, where: str, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise TypeError(f"DataLoader worker: batch nested deeper than {_MAX_DEPTH} (at {where})")
        if x is None or isinstance(x, (bool, str, bytes, float)):
            return x
        if isinstance(x, int):
            if not -(2**63) <= x < 2**64:
                raise TypeError(f"DataLoader worker: integer {x} does not fit 64 bits (at {where})")
            return int(x)
        if isinstance(x, np.ndarray):
            return self.array(x, "T" if self.tensor_arrays else "a", where)
        if self.tensor_type is not None and isinstance(x, self.tensor_type):
            return self.array(np.asarray(self.tensor_value(x)), "T", where)
        if isinstance(x, np.generic):
            if x.dtype.kind not in _KINDS:
                raise TypeError(f"DataLoader worker: cannot send a numpy scalar of dtype {x.dtype} (at {where})")
            return ["g", x.dtype.str, x.tobytes()]
        if isinstance(x, Mapping):
            out: list[Any] = ["d"]
            for k, v in x.items():
                out.append(self.tree(k, f"{where} key", depth + 1))
                out.append(self.tree(v, f"{where}[{k!r}]", depth + 1))
            return out
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            t = type(x)
            return ["n", t.__module__, t.__qualname__,
                    [self.tree(v, f"{where}.{f}", depth + 1) for f, v in zip(x._fields, x)]]
        if isinstance(x, (list, tuple)):
            return ["t" if isinstance(x, tuple) else "l",
                    [self.tree(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]]
        raise TypeError(
            f"DataLoader worker: cannot send a {type(x).__module__}.{type(x).__qualname__} (at {where}); a batch "
            "may hold numpy arrays, tensors, numbers, strings, bytes, None, and dicts/lists/tuples of them"
        )


def encode(msg: list[Any], payload: Any = None, *, tensor_arrays: bool = False,
           tensor_type: type | None = None,
           tensor_value: Callable[[Any], Any] = np.asarray) -> tuple[bytes, list[memoryview], int]:
    """``msg`` (a list of plain values) plus ``payload`` (a batch) as (header, buffers, body size); a
    ``tensor_type`` leaf is sent as ``tensor_value`` of it, marked to become a Tensor again."""
    enc = _Enc(tensor_arrays, tensor_type, tensor_value)
    tree = enc.tree(payload, "batch")
    header = msgpack.packb([*msg, tree], use_bin_type=True)
    return header, enc.bufs, enc.size


def frame_prefix(header_len: int, body_len: int) -> bytes:
    """The 16 bytes a frame starts with."""
    return _PREFIX.pack(MAGIC, header_len, body_len)


def write_frame(fd: int, header: bytes, bufs: list[memoryview], size: int) -> None:
    """Write one frame to the blocking file descriptor ``fd``."""
    pieces: list[memoryview] = [memoryview(_PREFIX.pack(MAGIC, len(header), size)), memoryview(header)]
    pos = 0
    for b in bufs:
        pad = -pos % _ALIGN if b.nbytes else 0
        if pad:
            pieces.append(memoryview(bytes(pad)))
        pieces.append(b)
        pos += pad + b.nbytes
    if pos < size:  # trailing empty arrays were aligned past the last bytes
        pieces.append(memoryview(bytes(size - pos)))
    for p in pieces:
        while p.nbytes:
            n = os.write(fd, p)
            p = p[n:]


def _read_into(fd: int, view: memoryview, deadline: float | None, started: bool) -> None:
    while view.nbytes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        n = os.readv(fd, [view])
        if n == 0:
            raise WorkerEOF(started)
        view = view[n:]
        started = True


def read_frame(fd: int, timeout: float | None = None) -> tuple[list[Any], bytearray]:
    """Read one frame from the blocking ``fd``: (the header's list, the body). Raises `WorkerEOF` at end of
    file, `TimeoutError` after ``timeout`` seconds, `FrameError` for a malformed frame."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pre = bytearray(_PREFIX.size)
    _read_into(fd, memoryview(pre), deadline, False)
    magic, hlen, blen = _PREFIX.unpack(pre)
    if magic != MAGIC:
        raise FrameError(f"DataLoader: malformed frame (bad magic {bytes(magic)!r})")
    if hlen > MAX_HEADER or blen > MAX_BODY:
        raise FrameError(f"DataLoader: frame too large (header {hlen} bytes, body {blen} bytes)")
    head = bytearray(hlen)
    _read_into(fd, memoryview(head), deadline, True)
    body = bytearray(blen)
    _read_into(fd, memoryview(body), deadline, True)
    try:
        msg = msgpack.unpackb(bytes(head), raw=False, use_list=True, max_bin_len=MAX_HEADER,
                              max_str_len=MAX_HEADER, max_array_len=MAX_HEADER, max_map_len=0)
    except Exception as e:
        raise FrameError(f"DataLoader: malformed frame header ({e})") from None
    if not isinstance(msg, list) or not msg:
        raise FrameError("DataLoader: malformed frame header (not a list)")
    return msg, body


def _bad(what: str) -> FrameError:
    return FrameError(f"DataLoader: malformed frame ({what})")


def decode(tree: Any, body: bytearray, to_tensor: Any, depth: int = 0) -> Any:
    """The batch of a frame's tree; arrays are views of ``body``; ``to_tensor`` makes the "T" ones Tensors."""
    if depth > _MAX_DEPTH + 2:
        raise _bad("nested too deep")
    if tree is None or isinstance(tree, (bool, int, float, str, bytes)):
        return tree
    if not isinstance(tree, list) or not tree or not isinstance(tree[0], str):
        raise _bad(f"unexpected {type(tree).__name__}")
    tag = tree[0]
    try:
        if tag in ("a", "T"):
            _, dstr, shape, off = tree
            dt = np.dtype(dstr)
            if dt.kind not in _KINDS or dt.hasobject or dt.fields is not None:
                raise _bad(f"dtype {dt}")
            if not all(isinstance(s, int) and s >= 0 for s in shape) or not isinstance(off, int) or off < 0:
                raise _bad("bad shape or offset")
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if off + n * dt.itemsize > len(body):
                raise _bad("array outside the body")
            a = np.frombuffer(body, dtype=dt, count=n, offset=off).reshape(shape)
            return to_tensor(a) if tag == "T" else a
        if tag == "g":
            _, dstr, raw = tree
            dt = np.dtype(dstr)
            if dt.kind not in _KINDS or dt.hasobject or not isinstance(raw, bytes) or len(raw) != dt.itemsize:
                raise _bad("numpy scalar")
            return np.frombuffer(raw, dtype=dt)[0]
        if tag in ("l", "t"):
            items = [decode(v, body, to_tensor, depth + 1) for v in tree[1]]
            return tuple(items) if tag == "t" else items
        if tag == "d":
            kv = tree[1:]
            if len(kv) % 2:
                raise _bad("odd dict")
            return {decode(kv[i], body, to_tensor, depth + 1): decode(kv[i + 1], body, to_tensor, depth + 1)
                    for i in range(0, len(kv), 2)}
        if tag == "n":
            _, mod, qual, items = tree
            cls: Any = sys.modules.get(mod)  # only a class the parent has already imported: nothing is loaded
            for part in str(qual).split("."):
                cls = getattr(cls, part, None)
            vals = [decode(v, body, to_tensor, depth + 1) for v in items]
            if isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
                return cls(*vals)
            return tuple(vals)
    except FrameError:
        raise
    except (TypeError, ValueError) as e:
        raise _bad(f"{tag!r} node: {e}") from None
    raise _bad(f"unknown tag {tag!r}")
