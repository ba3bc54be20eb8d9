"""`ag.utils.data` against ``torch.utils.data`` (issue 20, part 2)."""

from __future__ import annotations

import gc
import threading
import time
from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.utils import data

torch: Any = pytest.importorskip("torch")
tdata: Any = torch.utils.data


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    """An asyncgrad batch equals a torch batch: same structure, dtypes and values."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, ag.Tensor), type(a)
        assert str(a.dtype) == str(b.dtype).replace("torch.", ""), (a.dtype, b.dtype)
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    elif isinstance(b, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in b:
            _same(a[k], b[k])
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (type(a), type(b))
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b and type(a) is type(b)


Point = namedtuple("Point", ["x", "y"])


def _samples(i: int) -> list:
    return [
        {"img": np.full((2, 3), i, np.float32), "label": i, "w": float(i) / 2, "flag": bool(i % 2),
         "name": f"s{i}", "pair": (np.int32(i), [i, i + 1]), "pt": Point(i, float(i))},
    ]


async def test_default_collate_matches_torch(rt: ag.Runtime) -> None:
    batch = [_samples(i)[0] for i in range(4)]
    tb = [{k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in s.items()} for s in batch]
    _same(data.default_collate(batch), tdata.default_collate(batch))
    ab = [{k: (ag.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in s.items()} for s in batch]
    _same(data.default_collate(ab), tdata.default_collate(tb))
    _same(data.default_collate([(1, 2.0), (3, 4.0)]), tdata.default_collate([(1, 2.0), (3, 4.0)]))
    _same(data.default_collate([np.float32(1), np.float32(2)]), tdata.default_collate([np.float32(1), np.float32(2)]))
    _same(data.default_convert(np.ones(3)), tdata.default_convert(np.ones(3)))
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal size"):
        data.default_collate([[1, 2], [3]])
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        data.default_collate([np.ones(2), np.ones(3)])
    with pytest.raises(TypeError, match="batch must contain tensors, numpy arrays, numbers, dicts or lists"):
        data.default_collate([object(), object()])


class _Squares(data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return np.array([i, i * i], np.float64), i


class _TSquares(tdata.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return np.array([i, i * i], np.float64), i


class _ListSampler(data.Sampler):
    def __init__(self, order: list[int]) -> None:
        self.order = order

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


@pytest.mark.parametrize(
    "kw",
    [
        {"batch_size": 4},
        {"batch_size": 4, "drop_last": True},
        {"batch_size": 3, "sampler": [5, 1, 7, 0, 9, 2, 3]},
        {"batch_sampler": [[0, 1], [5, 2, 9], [4]]},
        {"batch_size": None},
        {"batch_size": 5, "collate_fn": lambda b: [s[1] for s in b]},
    ],
)
async def test_loader_batches_match_torch(rt: ag.Runtime, kw: dict[str, Any]) -> None:
    n = 10
    ours = data.DataLoader(_Squares(n), **kw)
    theirs = tdata.DataLoader(_TSquares(n), **kw)
    assert len(ours) == len(theirs)
    tb = list(theirs)
    ob = list(ours)
    assert len(ob) == len(tb)
    for a, b in zip(ob, tb):
        _same(a, b)
    with trio.fail_after(20):
        ab = [b async for b in data.DataLoader(_Squares(n), **kw)]
    for a, b in zip(ab, tb):
        _same(a, b)


async def test_tensor_dataset_fast_path_and_subsets(rt: ag.Runtime) -> None:
    x = np.random.default_rng(0).standard_normal((11, 2, 3))
    y = np.arange(11)
    ds = data.TensorDataset(ag.tensor(x), ag.tensor(y))
    tds = tdata.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    assert len(ds) == 11
    _same(ds[3], tds[3])
    order = [3, 1, 4, 10, 5, 9, 2, 6]
    kws: list[dict[str, Any]] = [{"batch_size": 3}, {"batch_size": 3, "drop_last": True}]
    for kw in kws:
        ob = list(data.DataLoader(ds, sampler=_ListSampler(order), **kw))
        tb = list(tdata.DataLoader(tds, sampler=order, **kw))
        for a, b in zip(ob, tb, strict=True):
            _same(a, b)
        with trio.fail_after(20):
            ab = [b async for b in data.DataLoader(ds, sampler=_ListSampler(order), **kw)]
        for a, b in zip(ab, tb, strict=True):
            _same(a, b)
    sub = data.Subset(ds, [10, 0, 5])
    _same(list(data.DataLoader(sub, batch_size=2)), list(tdata.DataLoader(tdata.Subset(tds, [10, 0, 5]), batch_size=2)))
    _same(list(data.DataLoader(data.Subset(sub, [2, 0]), batch_size=2)),
          list(tdata.DataLoader(tdata.Subset(tdata.Subset(tds, [10, 0, 5]), [2, 0]), batch_size=2)))
    with pytest.raises(ValueError, match=r"Size mismatch between tensors: first dimensions are \[2, 3\]"):
        data.TensorDataset(ag.zeros(2), ag.zeros(3))
    cat = data.ConcatDataset([ds, ds])
    tcat = tdata.ConcatDataset([tds, tds])
    assert len(cat) == len(tcat) == 22
    _same(cat[15], tcat[15])
    _same(cat[-1], tcat[-1])
    _same((ds + ds)[12], (tds + tds)[12])


async def test_shuffle_with_a_seeded_generator(rt: ag.Runtime) -> None:
    ds = data.TensorDataset(ag.arange(20))

    def epoch(loader: data.DataLoader) -> list[int]:
        return [int(v) for (b,) in loader for v in b.numpy()]

    a = data.DataLoader(ds, batch_size=6, shuffle=True, generator=np.random.default_rng(5))
    b = data.DataLoader(ds, batch_size=6, shuffle=True, generator=np.random.default_rng(5))
    ea1, ea2 = epoch(a), epoch(a)
    assert ea1 == epoch(b) and ea2 == epoch(b)  # the same seed: the same orders, epoch after epoch
    assert sorted(ea1) == list(range(20)) and sorted(ea2) == list(range(20)) and ea1 != ea2
    assert ea1 != list(range(20))
    c = data.DataLoader(ds, batch_size=6, shuffle=True, generator=np.random.default_rng(6))
    assert epoch(c) != ea1
    ag.manual_seed(3)
    d1 = epoch(data.DataLoader(ds, batch_size=6, shuffle=True))
    ag.manual_seed(3)
    assert epoch(data.DataLoader(ds, batch_size=6, shuffle=True)) == d1  # the default generator, seeded
    with trio.fail_after(20):
        a2 = data.DataLoader(ds, batch_size=6, shuffle=True, generator=np.random.default_rng(5))
        assert [int(v) async for (bt,) in a2 for v in bt.numpy()] == ea1


async def test_samplers(rt: ag.Runtime) -> None:
    src = list(range(7))
    assert list(data.SequentialSampler(src)) == list(tdata.SequentialSampler(src))
    g = np.random.default_rng(0)
    r = list(data.RandomSampler(src, generator=g))
    assert sorted(r) == src
    r2 = list(data.RandomSampler(src, num_samples=10, generator=g))
    assert len(r2) == 10 and sorted(r2[:7]) == src
    rr = list(data.RandomSampler(src, replacement=True, num_samples=50, generator=g))
    assert len(rr) == 50 and set(rr) <= set(src)
    bs = data.BatchSampler(data.SequentialSampler(range(10)), batch_size=3, drop_last=False)
    assert list(bs) == list(tdata.BatchSampler(tdata.SequentialSampler(range(10)), 3, False))
    assert len(bs) == 4 and len(data.BatchSampler(range(10), 3, True)) == 3
    assert sorted(data.SubsetRandomSampler([4, 8, 9], generator=g)) == [4, 8, 9]
    w = list(data.WeightedRandomSampler([0.0, 1.0, 0.0, 3.0], 40, generator=g))
    assert set(w) <= {1, 3} and w.count(3) > w.count(1)
    with pytest.raises(ValueError, match="num_samples should be a positive integer"):
        data.RandomSampler(src, num_samples=0)
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        data.BatchSampler(src, 0, False)
    with pytest.raises(TypeError, match=r"numpy\.random\.Generator"):
        data.RandomSampler(src, generator=torch.Generator())


async def test_random_split(rt: ag.Runtime) -> None:
    ds = data.TensorDataset(ag.arange(10))
    parts = data.random_split(ds, [3, 7], generator=np.random.default_rng(0))
    got = sorted(int(p[i][0].item()) for p in parts for i in range(len(p)))
    assert [len(p) for p in parts] == [3, 7] and got == list(range(10))
    fr = data.random_split(ds, [0.5, 0.3, 0.2], generator=np.random.default_rng(0))
    assert [len(p) for p in fr] == [len(p) for p in tdata.random_split(range(10), [0.5, 0.3, 0.2])]
    again = data.random_split(ds, [3, 7], generator=np.random.default_rng(0))
    assert again[0].indices == parts[0].indices
    with pytest.raises(ValueError, match="Sum of input lengths does not equal"):
        data.random_split(ds, [3, 3])


class _Stream(data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(self.n):
            yield {"x": np.array([i, -i], np.float32), "i": i}

    def __len__(self) -> int:
        return self.n


class _TStream(tdata.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(self.n):
            yield {"x": np.array([i, -i], np.float32), "i": i}

    def __len__(self) -> int:
        return self.n


async def test_iterable_dataset(rt: ag.Runtime) -> None:
    kws: list[dict[str, Any]] = [{"batch_size": 3}, {"batch_size": 3, "drop_last": True}, {"batch_size": None}]
    for kw in kws:
        tb = list(tdata.DataLoader(_TStream(8), **kw))
        _same(list(data.DataLoader(_Stream(8), **kw)), tb)
        with trio.fail_after(20):
            _same([b async for b in data.DataLoader(_Stream(8), **kw)], tb)
        assert len(data.DataLoader(_Stream(8), **kw)) == len(tdata.DataLoader(_TStream(8), **kw))
    with pytest.raises(ValueError, match="expected unspecified shuffle option"):
        data.DataLoader(_Stream(3), shuffle=True)
    with pytest.raises(ValueError, match="expected unspecified sampler option"):
        data.DataLoader(_Stream(3), sampler=[0])


async def test_bad_arguments(rt: ag.Runtime) -> None:
    ds = _Squares(4)
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        data.DataLoader(ds, sampler=[0], shuffle=True)
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
        data.DataLoader(ds, batch_sampler=[[0]], batch_size=2)
    with pytest.raises(ValueError, match="mutually exclusive with drop_last"):
        data.DataLoader(ds, batch_size=None, drop_last=True)
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        data.DataLoader(ds, batch_size=0)
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        data.DataLoader(ds, num_workers=-1)
    with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
        data.DataLoader(ds, persistent_workers=True)
    with pytest.raises(TypeError, match="has no __getitem__"):
        data.DataLoader(object())
    # accepted for PyTorch programs (worker processes: tests/utils/test_data_workers.py)
    loader = data.DataLoader(ds, batch_size=2, num_workers=2, pin_memory=True, persistent_workers=True,
                             prefetch_factor=4)
    with trio.fail_after(20):
        assert len([b async for b in loader]) == 2


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncgrad-dataloader-prefetch"]


class _SlowCollate(data.Dataset):
    """Samples whose collation is slow (big arrays), to see the prefetch overlap a step."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.size, float(i))


async def test_async_for_prefetches_so_the_step_does_not_wait(rt: ag.Runtime) -> None:
    # collating a batch (64 x 256k floats: ~130 MB copied) takes longer than nothing, but less than the
    # "step" below; with prefetching only the first batch is waited for
    loader = data.DataLoader(_SlowCollate(6 * 16, 1 << 15), batch_size=16, prefetch_factor=2)
    t0 = time.perf_counter()
    list(loader)
    sync_s = (time.perf_counter() - t0) / len(loader)
    with trio.fail_after(60):
        it = aiter(loader)
        seen = []
        async for b in it:
            seen.append(float(b.numpy()[0, 0]))
            await trio.sleep(max(0.05, 4 * sync_s))  # the training step
        st = it.statistics()
    assert seen == [16.0 * k for k in range(6)]
    assert st.batches == 6 and st.waited <= 1, st
    assert not st.thread_alive and _prefetch_threads() == []


async def test_prefetch_thread_ends_with_break_error_and_aclose(rt: ag.Runtime) -> None:
    base = len(_prefetch_threads())
    assert base == 0
    loader = data.DataLoader(_Squares(50), batch_size=2)
    with trio.fail_after(20):
        async for _b in loader:
            assert len(_prefetch_threads()) == 1
            break
        gc.collect()
        while _prefetch_threads():  # the collected iterator stopped its thread
            await trio.sleep(0.01)
        it = aiter(loader)
        await it.__anext__()
        await it.aclose()
        assert _prefetch_threads() == [] and not it.statistics().thread_alive
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()

    class _Bad(data.Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> np.ndarray:
            if i == 3:
                raise KeyError(f"sample {i} is missing")
            return np.zeros(2)

    got = []
    with trio.fail_after(20), pytest.raises(KeyError, match="sample 3 is missing"):
        async for b in data.DataLoader(_Bad(), batch_size=1):
            got.append(b)
    assert len(got) == 3 and _prefetch_threads() == []

    class _BadCollate(data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> np.ndarray:
            return np.zeros(i + 1)  # ragged: collation fails on the prefetch thread

    with trio.fail_after(20), pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        async for _b in data.DataLoader(_BadCollate(), batch_size=2):
            pass
    assert _prefetch_threads() == []


async def test_timeout(rt: ag.Runtime) -> None:
    class _SlowDs(data.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> np.ndarray:
            return np.zeros(1)

    loader = data.DataLoader(_SlowDs(), batch_size=1, timeout=0.1)
    real = loader._collate

    def slow(samples):  # type: ignore[no-untyped-def]
        kind, fn = real(samples)
        return kind, lambda: (time.sleep(0.5), fn())[1]

    loader._collate = slow  # type: ignore[method-assign]
    with trio.fail_after(20), pytest.raises(RuntimeError, match=r"DataLoader timed out after 0\.1 seconds"):
        async for _ in loader:
            pass
