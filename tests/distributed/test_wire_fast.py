"""The fast paths of the wire: small values packed into the message in a binary layout (checked once per
layout, every value still checked against it), and shared segments whose mapping is kept while lent to
the peer, so a segment coming back is not mapped again."""

from __future__ import annotations

import gc
import random
import struct

import msgpack
import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist
from asyncgrad.distributed import _shm, _wire
from asyncgrad.distributed._errors import ProtocolError

from . import _wire_fns
from .conftest import TIMEOUT, children, fds


def _round_trip(msg: object) -> object:
    enc = _wire.encode(msg)
    assert not enc.tensors  # small ready values: all inline
    (frame,), _ = enc.frame()
    return _wire.decode(frame[_wire.HEADER_SIZE :], [], lambda a, rg: ag.from_numpy(a).requires_grad_(rg))


def _layouts() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    c = rng.standard_normal((2, 3, 4, 5))
    return {
        "C f64": c,
        "F f64": np.asfortranarray(c),
        "channels-last f32": c.astype(np.float32).transpose(0, 2, 3, 1),
        "0-d": np.array(3.5),
        "empty": np.zeros((0, 3), np.float32),
        "strided (not dense)": c[:, ::2, :, ::2],
        "reversed": np.arange(10, dtype=np.int64)[::-1],
        "bool": rng.standard_normal(7) > 0,
        "int8": np.arange(-5, 5, dtype=np.int8),
        "uint16": np.arange(9, dtype=np.uint16).reshape(3, 3),
        "complex128": (rng.standard_normal(4) + 1j * rng.standard_normal(4)),
        "float16 big-endian": np.arange(6, dtype=">f2"),
    }


async def test_inline_values_keep_values_dtype_and_dense_layouts(rt) -> None:
    for name, a in _layouts().items():
        for _ in range(2):  # the second time through the cached layout
            back = _round_trip([a, ag.from_numpy(a.copy(order="C")), {"k": (a,)}])
            arr, t, d = back  # type: ignore[misc]
            for got in (arr, t.numpy(), d["k"][0]):
                assert got.dtype == a.dtype, name
                assert got.shape == a.shape, name
                np.testing.assert_array_equal(got, a, err_msg=name)
                assert not np.shares_memory(got, a)
            assert arr.flags.writeable
            if a.flags.c_contiguous or a.flags.f_contiguous or name == "channels-last f32":
                assert arr.strides == a.strides, name  # a dense layout arrives as it was
            else:
                assert arr.flags.c_contiguous, name  # anything else arrives in C order
    x = ag.from_numpy(np.arange(4.0)).requires_grad_(True)
    y = ag.from_numpy(np.arange(3, dtype=np.float32))
    a, b, c = _round_trip([x, y, x])  # type: ignore[misc]
    assert a.requires_grad and not b.requires_grad and a is c  # the same value twice: one tensor
    np.testing.assert_array_equal(a.numpy(), [0, 1, 2, 3])


def _payload(kind: int, dts: str, shape: tuple[int, ...], strides: tuple[int, ...], slot: int, raw: bytes) -> bytes:
    d = dts.encode()
    n = len(shape)
    return struct.pack("<BBB", kind, n, len(d)) + d + struct.pack(f"<{2 * n}q", *shape, *strides) + struct.pack(
        "<I", slot
    ) + raw


def _decode_ext(payload: bytes) -> object:
    meta = msgpack.packb([msgpack.ExtType(_wire.EXT_INLINE, payload)], use_bin_type=True)
    return _wire.decode(meta, [], lambda a, rg: a)


async def test_malformed_inline_values_are_protocol_errors(rt) -> None:
    good = _payload(0, "<f8", (2, 3), (24, 8), 0, bytes(48))
    got = _decode_ext(good)
    assert isinstance(got, list) and got[0].shape == (2, 3)  # type: ignore[index]
    bad = {
        "too short": b"\x00\x01",
        "kind": _payload(3, "<f8", (2,), (8,), 0, bytes(16)),
        "object dtype": _payload(0, "|O", (1,), (8,), 0, bytes(8)),
        "structured dtype": _payload(0, "|V8", (1,), (8,), 0, bytes(8)),
        "unknown dtype": _payload(0, "<q9", (1,), (8,), 0, bytes(8)),
        "non-ascii dtype": _payload(0, "\xe9f8", (1,), (8,), 0, bytes(8)),
        "negative dim": _payload(0, "<f8", (-1, 2), (16, 8), 0, b""),
        "too many bytes": _payload(0, "<f8", (2,), (8,), 0, bytes(17)),
        "too few bytes": _payload(0, "<f8", (2,), (8,), 0, bytes(15)),
        "overlapping": _payload(0, "<f8", (4,), (0,), 0, bytes(32)),
        "out of bounds": _payload(0, "<f8", (4,), (16,), 0, bytes(32)),
        "negative stride": _payload(0, "<f8", (4,), (-8,), 0, bytes(32)),
        "wrong slot": _payload(0, "<f8", (1,), (8,), 5, bytes(8)),
        "larger than inline values": _payload(0, "|u1", (1 << 20,), (1,), 0, bytes(1 << 20)),
        "huge shape": _payload(0, "<f8", (1 << 40, 1 << 40), (8 << 40, 8), 0, b""),
        "ndim too large": struct.pack("<BBB", 0, 200, 3) + b"<f8" + bytes(16 * 200 + 4),
    }
    for name, payload in bad.items():
        with pytest.raises(ProtocolError):
            _decode_ext(payload)
            pytest.fail(name)
    for cut in range(len(good)):  # every truncation
        with pytest.raises(ProtocolError):
            _decode_ext(good[:cut])
    rnd = random.Random(16)
    for i in range(300):  # random bytes and random corruptions of a good payload: a value or a ProtocolError
        if i % 2:
            payload = bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(0, 80)))
        else:
            b = bytearray(good)
            for _ in range(rnd.randrange(1, 4)):
                b[rnd.randrange(len(b))] = rnd.getrandbits(8)
            payload = bytes(b)
        try:
            v = _decode_ext(payload)
        except ProtocolError:
            continue
        arr = v[0]  # type: ignore[index]
        assert isinstance(arr, np.ndarray) and arr.nbytes <= len(payload)


@pytest.mark.skipif(not _shm.available, reason="needs memfd_create")
async def test_lent_segments_come_back_without_being_mapped_again(rt) -> None:
    rng = np.random.default_rng(2)
    src = rng.standard_normal((512, 1024))  # 4 MiB: a shared segment each way
    kids, files = children(), fds()
    before = _shm.pool.mapped, _shm.pool.reclaimed
    with trio.fail_after(TIMEOUT):
        async with dist.open_workers(1, transport="unix") as workers:
            w = workers[0]
            t = ag.from_numpy(src)
            for i in range(6):
                back = await w.call(_wire_fns.plus_one, t)
                a = back.numpy()
                np.testing.assert_array_equal(a, src + 1)
                assert not np.shares_memory(a, src)
                a[0, 0] = -i  # ours: writing it changes nothing elsewhere
                del back, a
                gc.collect()
            np.testing.assert_array_equal(t.numpy(), src)
            theirs = await w.call(_wire_fns.shm_counts)
            mapped = _shm.pool.mapped - before[0]
            reclaimed = _shm.pool.reclaimed - before[1]
            # steady state: segments go back and forth, mapped once each at either end
            assert mapped <= 3 and reclaimed >= 3, (mapped, reclaimed)
            assert theirs["mapped"] <= 3 and theirs["reclaimed"] >= 3, theirs
            assert _shm.pool.lent <= _shm.POOL_SEGMENTS
    gc.collect()
    assert _shm.pool.lent == 0 and len(_shm.pool) == 0  # closing unmapped what was kept
    assert children() == kids and fds() <= files


async def test_lent_table_is_bounded(rt) -> None:
    if not _shm.available:
        pytest.skip("needs memfd_create")
    pool = _shm.Pool()
    maps = [pool.take(_shm.MIN_BYTES + i * 4096) for i in range(_shm.POOL_SEGMENTS + 3)]
    for m in maps:
        m.given_away()
    del m
    maps.clear()
    gc.collect()
    assert pool.lent == _shm.POOL_SEGMENTS  # the oldest were unmapped
    pool.clear()
    assert pool.lent == 0
