"""`DataLoader(num_workers > 0)`: forked worker processes, frames without pickle (issue 22)."""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.utils import data
from asyncgrad.utils.data import _codec


def _children() -> set[int]:
    out: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return out


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _np(b: Any) -> Any:
    if isinstance(b, ag.Tensor):
        return ("T", str(b.dtype), b.numpy().tolist())
    if isinstance(b, dict):
        return {k: _np(v) for k, v in b.items()}
    if isinstance(b, (list, tuple)):
        return type(b)(_np(v) for v in b)
    if isinstance(b, np.ndarray):
        return ("a", str(b.dtype), b.tolist())
    return b


class _Samples(data.Dataset):
    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": np.arange(4.0) + i, "y": i, "name": f"s{i}", "pair": (np.int32(i), float(i) / 2)}


class _Info(data.Dataset):
    """Samples that say which worker made them, its seed and what the seeded generators drew."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> list[Any]:
        info = data.get_worker_info()
        assert (info is not None and info.dataset is not self) or True
        return [info.id, info.num_workers, info.seed, _INIT.get("id", -1), random.random(), np.random.rand()]


_INIT: dict[str, int] = {}


def _init(wid: int) -> None:
    _INIT["id"] = wid * 10


async def test_batches_equal_to_no_workers(rt: ag.Runtime) -> None:
    for ds in (_Samples(), data.TensorDataset(ag.arange(46.0).reshape(23, 2), ag.arange(23))):
        for drop_last in (False, True):
            def make(n: int, ds: Any = ds, drop_last: bool = drop_last) -> data.DataLoader:
                return data.DataLoader(ds, batch_size=4, shuffle=True, drop_last=drop_last, num_workers=n,
                                       generator=np.random.default_rng(7))
            ref, lo = make(0), make(3)
            for _ in range(2):  # two epochs: the generator's stream is the same
                want = [_np(b) for b in ref]
                assert [_np(b) for b in lo] == want
            with trio.fail_after(60):
                assert [_np(b) async for b in make(2)] == [_np(b) for b in make(0)]
    # batch_size=None: samples one by one through default_convert
    lo = data.DataLoader(_Samples(5), batch_size=None, num_workers=2)
    assert [_np(b) for b in lo] == [_np(b) for b in data.DataLoader(_Samples(5), batch_size=None)]


async def test_worker_info_seeds_and_init(rt: ag.Runtime) -> None:
    assert data.get_worker_info() is None
    def run() -> list[list[Any]]:
        lo = data.DataLoader(_Info(), batch_size=2, num_workers=3, worker_init_fn=_init,
                             generator=np.random.default_rng(11))
        return [b for b in lo]

    a, b = run(), run()
    rows = [[t.numpy().tolist() for t in batch] for batch in a]
    seeds = {}
    for k, (wid, nw, seed, init, _, _) in enumerate(rows):
        assert wid == [k % 3] * 2 and nw == [3, 3] and init == [10 * (k % 3)] * 2  # round robin, in order
        seeds[k % 3] = seed[0]
    assert seeds[1] == seeds[0] + 1 and seeds[2] == seeds[0] + 2  # base_seed + id
    # the same generator seed: the same worker seeds and draws
    assert rows == [[t.numpy().tolist() for t in batch] for batch in b]
    # the first draws of a worker are those of random / np.random seeded with its seed
    r0 = rows[0]
    random.seed(seeds[0])
    np.random.seed(seeds[0] % 2**32)
    assert r0[4] == [random.random(), random.random()]
    np.testing.assert_array_equal(r0[5], np.random.rand(2))
    other = data.DataLoader(_Info(), batch_size=2, num_workers=3, generator=np.random.default_rng(12))
    assert next(iter(other))[2].numpy()[0] != seeds[0]


class _Stream(data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = data.get_worker_info()
        lo, hi = 0, self.n
        if info is not None:  # PyTorch's documented sharding
            per = -(-self.n // info.num_workers)
            lo, hi = info.id * per, min(self.n, (info.id + 1) * per)
        for i in range(lo, hi):
            yield np.array([i, -1 if info is None else info.id])


async def test_iterable_dataset_sharding(rt: ag.Runtime) -> None:
    lo = data.DataLoader(_Stream(10), batch_size=2, num_workers=2)
    got = [b.numpy().tolist() for b in lo]
    # as PyTorch: batches alternate between the workers, each worker its own shard
    assert got == [[[0, 0], [1, 0]], [[5, 1], [6, 1]], [[2, 0], [3, 0]], [[7, 1], [8, 1]], [[4, 0]], [[9, 1]]]
    lo = data.DataLoader(_Stream(10), batch_size=2, num_workers=2, drop_last=True)
    assert [b.numpy()[:, 0].tolist() for b in lo] == [[0, 1], [5, 6], [2, 3], [7, 8]]
    lo = data.DataLoader(_Stream(3), batch_size=None, num_workers=3)
    with trio.fail_after(60):
        assert sorted([b.numpy().tolist() async for b in lo]) == [[0, 0], [1, 1], [2, 2]]


class _Failing(data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        if i == 5:
            raise ValueError(f"bad sample {i}")
        if i == 6:
            return {"obj": object()}
        return np.zeros(2)


async def test_worker_exception(rt: ag.Runtime) -> None:
    before = _children()
    lo = data.DataLoader(_Failing(), batch_size=2, num_workers=2)
    it = iter(lo)
    assert next(it).numpy().tolist() == [[0, 0], [0, 0]]
    assert next(it).shape == (2, 2)
    with pytest.raises(ValueError, match=r"Caught ValueError in DataLoader worker process 0") as ei:
        next(it)
    text = str(ei.value)
    assert "Original Traceback (most recent call last)" in text and "__getitem__" in text and "bad sample 5" in text
    assert _children() == before  # the failing pass ended its workers
    with pytest.raises(StopIteration):
        next(it)
    # a value the codec cannot carry: a TypeError naming the type and where it sits
    lo = data.DataLoader(_Failing(), batch_size=None, sampler=[6], num_workers=1)
    with pytest.raises(TypeError, match=r"cannot send a builtins.object \(at batch\['obj'\]\)"):
        list(lo)
    # worker_init_fn failing
    def bad_init(wid: int) -> None:
        raise KeyError("no init")

    with trio.fail_after(60):
        with pytest.raises(KeyError, match="in DataLoader worker process"):
            [b async for b in data.DataLoader(_Samples(4), num_workers=2, worker_init_fn=bad_init)]
    assert _children() == before


class _Slow(data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        if i >= 2:
            time.sleep(0.5)
        return np.array([i, os.getpid()])


async def test_killed_worker(rt: ag.Runtime) -> None:
    before = _children()
    for form in ("sync", "async"):
        lo = data.DataLoader(_Slow(), batch_size=1, num_workers=2)
        t0 = time.monotonic()
        with trio.fail_after(30):
            if form == "sync":
                it: Any = iter(lo)
                first = next(it)
            else:
                it = aiter(lo)
                first = await it.__anext__()
            pid = int(first.numpy()[0, 1])
            assert pid in _children()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(RuntimeError, match=rf"DataLoader worker 0 \(pid {pid}\) exited unexpectedly "
                               r"\(killed by signal SIGKILL\)"):
                while True:
                    await it.__anext__() if form == "async" else next(it)
        assert time.monotonic() - t0 < 20
        assert _children() == before


async def test_no_leaks(rt: ag.Runtime) -> None:
    gc.collect()
    kids, fds, threads = _children(), _fds(), threading.active_count()
    def same() -> None:
        gc.collect()
        assert _children() == kids and _fds() <= fds, (_children(), kids, _fds(), fds)

    lo = data.DataLoader(_Samples(), batch_size=3, num_workers=3)
    assert len(list(lo)) == 8  # exhausted
    same()
    it = iter(lo)
    next(it)
    assert len(_children() - kids) == 3
    del it  # garbage collected after a break
    same()
    it = iter(lo)
    next(it)
    it.close()
    same()
    with trio.fail_after(60):
        async for _ in lo:
            break  # the iterator is dropped: collected
        same()
        ait = aiter(lo)
        await ait.__anext__()
        await ait.aclose()
        same()
        # persistent workers: the same processes across passes, also after a break; gone with the loader
        lo = data.DataLoader(_Info(), batch_size=2, num_workers=2, persistent_workers=True)
        pids = None
        for epoch in range(3):
            got = [b async for b in lo] if epoch == 1 else list(lo)
            assert len(got) == 6 and [b[0].numpy()[0] for b in got] == [0, 1] * 3
            live = _children() - kids
            assert len(live) == 2 and (pids is None or live == pids)
            pids = live
        for _ in lo:
            break
        assert [b[0].numpy()[0] for b in lo] == [0, 1] * 3 and _children() - kids == pids
        del lo, got
        same()
    # trio's cached worker threads idle out on their own; no thread of ours is left
    assert not [t for t in threading.enumerate() if "dataloader" in t.name.lower()]
    assert threading.active_count() <= threads + 4


async def test_async_for_never_blocks_the_loop(rt: ag.Runtime) -> None:
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await trio.sleep(0.01)

    lo = data.DataLoader(_Slow(), batch_size=2, num_workers=1, timeout=30)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(ticker)
            got = [b.numpy()[:, 0].tolist() async for b in lo]
            done = True
    assert got == [[0, 1], [2, 3], [4, 5]]
    assert ticks >= 50  # about 2 s of slow samples: the loop kept running the whole time
    lo = data.DataLoader(_Slow(), batch_size=1, num_workers=1, timeout=0.2)
    with trio.fail_after(30), pytest.raises(RuntimeError, match=r"timed out after 0\.2 seconds"):
        [b async for b in lo]


async def test_bad_arguments(rt: ag.Runtime) -> None:
    with pytest.raises(ValueError, match="only None or 'fork'"):
        data.DataLoader(_Samples(), num_workers=1, multiprocessing_context="spawn")


def _pipe_frame(raw: bytes) -> Any:
    r, w = os.pipe()
    try:
        os.write(w, raw)
        os.close(w)
        w = -1
        msg, body = _codec.read_frame(r, timeout=5)
        return _codec.decode(msg[-1], body, lambda a: ("T", a))
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_codec_round_trip_and_malformed_frames() -> None:
    batch = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [1, 2.5, "s", b"x", None, True],
             "c": (np.int16(3), np.zeros((0, 4))), 7: np.array(["ab", "c"]), "t": np.arange(10)[::3]}
    header, bufs, size = _codec.encode(["b", 0], batch)
    r, w = os.pipe()
    try:
        t = threading.Thread(target=_codec.write_frame, args=(w, header, bufs, size))
        t.start()
        msg, body = _codec.read_frame(r, timeout=5)
        t.join()
    finally:
        os.close(r)
        os.close(w)
    out = _codec.decode(msg[-1], body, lambda a: a)
    assert list(out) == list(batch)
    np.testing.assert_array_equal(out["a"], batch["a"])
    assert out["a"].dtype == np.float32 and out["b"] == batch["b"] and out["c"][0] == np.int16(3)
    assert out["c"][1].shape == (0, 4) and out[7].tolist() == ["ab", "c"] and out["t"].tolist() == [0, 3, 6, 9]
    good = _codec.frame_prefix(len(header), size) + header + b"".join(bytes(b) for b in bufs)
    with pytest.raises(_codec.FrameError, match="bad magic"):
        _pipe_frame(b"XXXX" + good[4:])
    with pytest.raises(_codec.FrameError, match="too large"):
        _pipe_frame(_codec.frame_prefix(1, _codec.MAX_BODY + 1))
    import msgpack

    def frame(tree: Any, body: bytes = b"") -> bytes:
        h = msgpack.packb(["b", 0, tree], use_bin_type=True)
        return _codec.frame_prefix(len(h), len(body)) + h + body

    with pytest.raises(_codec.FrameError, match="outside the body"):
        _pipe_frame(frame(["a", "<f8", [4], 0], bytes(16)))
    with pytest.raises(_codec.FrameError, match="dtype"):
        _pipe_frame(frame(["a", "|O", [1], 0], bytes(8)))
    with pytest.raises(_codec.FrameError, match="unknown tag"):
        _pipe_frame(frame(["zz", 1]))
    with pytest.raises(_codec.WorkerEOF):
        _pipe_frame(good[:-3])
    with pytest.raises(TypeError, match="cannot send a numpy array of dtype object"):
        _codec.encode(["b", 0], [np.array([object()])])
    with pytest.raises(TypeError, match="does not fit 64 bits"):
        _codec.encode(["b", 0], {"k": [2**70]})


class _Premade(data.Dataset):
    """Samples that are tensors made in the parent (a ready value is read as its array in the worker)."""

    def __init__(self) -> None:
        self.items = [ag.full((3,), float(i)) for i in range(5)]
        self.big = ag.ones(400_000)

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> Any:
        if i == 4:
            return (self.big * 2.0).sum()  # an op in a worker: no runtime there, a clear error (no hang)
        return self.items[i]


async def test_tensors_in_a_worker(rt: ag.Runtime) -> None:
    ds = _Premade()
    lo = data.DataLoader(ds, batch_size=2, num_workers=1, sampler=[0, 1, 2, 3])
    assert [b.numpy()[:, 0].tolist() for b in lo] == [[0, 1], [2, 3]]
    lo = data.DataLoader(ds, batch_size=2, num_workers=1, sampler=[0, 4])
    with trio.fail_after(60), pytest.raises(RuntimeError, match="has no asyncgrad runtime"):
        list(lo)
    # a custom collate_fn runs in the worker: its numpy arrays stay numpy arrays, tensors become tensors
    def collate(samples: list[Any]) -> dict[str, Any]:
        return {"np": np.stack([np.asarray(s) for s in samples]), "t": samples[0]}

    lo = data.DataLoader(ds, batch_size=2, num_workers=1, sampler=[1, 2], collate_fn=collate)
    (b,) = list(lo)
    assert isinstance(b["np"], np.ndarray) and b["np"][:, 0].tolist() == [1, 2]
    assert isinstance(b["t"], ag.Tensor) and b["t"].numpy().tolist() == [1, 1, 1]


class _Rows(data.Dataset):
    def __init__(self, n: int, width: int) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return np.full(self.width, i, dtype=np.int64) if self.width > 1 else i


async def test_big_batches_and_big_index_lists(rt: ag.Runtime) -> None:
    # 4 MiB batches (more than a pipe holds) with tasks in flight, sync and async
    lo = data.DataLoader(_Rows(40, 1 << 16), batch_size=8, num_workers=2, prefetch_factor=3, shuffle=True,
                         generator=np.random.default_rng(1))
    ref = data.DataLoader(_Rows(40, 1), batch_size=8, shuffle=True, generator=np.random.default_rng(1))
    order = [i for b in ref for i in b.numpy().tolist()]
    got = [b.numpy() for b in lo]
    assert all(b.shape[1] == 1 << 16 and (b == b[:, :1]).all() for b in got)
    assert [i for b in got for i in b[:, 0].tolist()] == order
    with trio.fail_after(60):
        got = [b.numpy()[:, 0].tolist() async for b in lo]
    assert [i for b in got for i in b] == [i for b in ref for i in b.numpy().tolist()]  # the next epoch
    # index lists bigger than a pipe's buffer: the task frames are written as the workers read them
    n, bs = 1_000_000, 200_000  # a task frame of about 1 MB, the pipes hold 1 MiB at most
    lo = data.DataLoader(_Rows(n, 1), batch_size=bs, num_workers=2, prefetch_factor=2)
    with trio.fail_after(120):
        got = [b async for b in lo]
    assert all(np.array_equal(b.numpy(), np.arange(k, k + bs)) for b, k in zip(got, range(0, n, bs), strict=True))


class _Keyed(data.Dataset):
    def __getitem__(self, k: Any) -> Any:
        return {"k": k, "v": np.array([len(str(k))])}


async def test_sampler_keys_and_statistics(rt: ag.Runtime) -> None:
    lo = data.DataLoader(_Keyed(), batch_size=2, sampler=["a", "bb", "ccc"], num_workers=2)
    assert [_np(b) for b in lo] == [{"k": ["a", "bb"], "v": ("T", "int64", [[1], [2]])},
                                    {"k": ["ccc"], "v": ("T", "int64", [[3]])}]
    lo = data.DataLoader(_Rows(6, 1), batch_size=None, sampler=np.array([5, 0, 3]), num_workers=2)
    assert [int(b) for b in lo] == [5, 0, 3]
    lo = data.DataLoader(_Slow(), batch_size=2, num_workers=1)
    with trio.fail_after(60):
        it = aiter(lo)
        async for _ in it:
            pass
    st = it.statistics()
    assert st.batches == 3 and st.waited >= 2 and st.wait_seconds > 0.5 and not st.thread_alive
