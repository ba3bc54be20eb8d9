"""`ag.utils.data` against ``torch.utils.data`` (issue 20, part 2).

Torch's batches come through ``torch_ref`` (live where torch is installed, else recorded under
``tests/references/``) as plain values: see ``_plain``.
"""

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


def _type_name(v: Any) -> str:
    return f"{type(v).__module__}.{type(v).__qualname__}"


def _plain(torch: Any, b: Any) -> Any:
    """A torch batch as a recordable value: ``[kind, type or dtype, contents]`` at every level."""
    if isinstance(b, torch.Tensor):
        return ["tensor", str(b.dtype), b]
    if isinstance(b, dict):
        return ["dict", _type_name(b), [[k, _plain(torch, v)] for k, v in b.items()]]
    if isinstance(b, (list, tuple)):
        return ["seq", _type_name(b), [_plain(torch, x) for x in b]]
    return ["leaf", _type_name(b), b]


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    """An asyncgrad batch equals a torch batch (``_plain``'s form): same structure, types, dtypes and values."""
    kind, name, v = b
    if kind == "tensor":
        assert isinstance(a, ag.Tensor), type(a)
        assert str(a.dtype) == name.replace("torch.", ""), (a.dtype, name)
        np.testing.assert_array_equal(a.numpy(), v)
    elif kind == "dict":
        assert _type_name(a) == name and list(a) == [k for k, _ in v], (_type_name(a), name)
        for k, x in v:
            _same(a[k], x)
    elif kind == "seq":
        assert _type_name(a) == name and len(a) == len(v), (_type_name(a), name)
        for x, y in zip(a, v):
            _same(x, y)
    else:
        assert a == v and _type_name(a) == name, (a, v, _type_name(a), name)


Point = namedtuple("Point", ["x", "y"])


def _samples(i: int) -> list:
    return [
        {"img": np.full((2, 3), i, np.float32), "label": i, "w": float(i) / 2, "flag": bool(i % 2),
         "name": f"s{i}", "pair": (np.int32(i), [i, i + 1]), "pt": Point(i, float(i))},
    ]


async def test_default_collate_matches_torch(rt: ag.Runtime, torch_ref) -> None:
    batch = [_samples(i)[0] for i in range(4)]

    def reference(torch: Any) -> Any:
        tdata = torch.utils.data
        tb = [{k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in s.items()} for s in batch]
        return {
            "numpy": tdata.default_collate(batch),
            "tensors": tdata.default_collate(tb),
            "tuples": tdata.default_collate([(1, 2.0), (3, 4.0)]),
            "np_scalars": tdata.default_collate([np.float32(1), np.float32(2)]),
            "convert": tdata.default_convert(np.ones(3)),
        }

    want = torch_ref("collate", lambda torch: {k: _plain(torch, v) for k, v in reference(torch).items()},
                     batch=batch)
    _same(data.default_collate(batch), want["numpy"])
    ab = [{k: (ag.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in s.items()} for s in batch]
    _same(data.default_collate(ab), want["tensors"])
    _same(data.default_collate([(1, 2.0), (3, 4.0)]), want["tuples"])
    _same(data.default_collate([np.float32(1), np.float32(2)]), want["np_scalars"])
    _same(data.default_convert(np.ones(3)), want["convert"])
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


def _t_squares(torch: Any, n: int) -> Any:
    """``_Squares`` as a ``torch.utils.data.Dataset``."""

    class _TSquares(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
            return np.array([i, i * i], np.float64), i

    return _TSquares(n)


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
async def test_loader_batches_match_torch(rt: ag.Runtime, kw: dict[str, Any], torch_ref) -> None:
    n = 10
    ours = data.DataLoader(_Squares(n), **kw)

    def reference(torch: Any) -> Any:
        theirs = torch.utils.data.DataLoader(_t_squares(torch, n), **kw)
        return len(theirs), [_plain(torch, b) for b in theirs]

    # the collate_fn (a lambda) is recorded by its source
    kw_in = {k: "lambda b: [s[1] for s in b]" if k == "collate_fn" else v for k, v in kw.items()}
    t_len, tb = torch_ref("batches", reference, n=n, kw=kw_in)
    assert len(ours) == t_len
    ob = list(ours)
    assert len(ob) == len(tb)
    for a, b in zip(ob, tb):
        _same(a, b)
    with trio.fail_after(20):
        ab = [b async for b in data.DataLoader(_Squares(n), **kw)]
    for a, b in zip(ab, tb):
        _same(a, b)


async def test_tensor_dataset_fast_path_and_subsets(rt: ag.Runtime, torch_ref) -> None:
    x = np.random.default_rng(0).standard_normal((11, 2, 3))
    y = np.arange(11)
    order = [3, 1, 4, 10, 5, 9, 2, 6]
    kws: list[dict[str, Any]] = [{"batch_size": 3}, {"batch_size": 3, "drop_last": True}]

    def reference(torch: Any) -> Any:
        tdata = torch.utils.data
        tds = tdata.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        tcat = tdata.ConcatDataset([tds, tds])
        loaders = [_plain(torch, list(tdata.DataLoader(tds, sampler=order, **kw))) for kw in kws]
        out = {
            "item3": tds[3],
            "subset": list(tdata.DataLoader(tdata.Subset(tds, [10, 0, 5]), batch_size=2)),
            "subset_of_subset": list(tdata.DataLoader(tdata.Subset(tdata.Subset(tds, [10, 0, 5]), [2, 0]),
                                                      batch_size=2)),
            "cat15": tcat[15],
            "cat_last": tcat[-1],
            "plus12": (tds + tds)[12],
        }
        return {"cat_len": len(tcat), "loaders": loaders, **{k: _plain(torch, v) for k, v in out.items()}}

    want = torch_ref("tensor_dataset", reference, x=x, y=y, order=order, kws=kws)
    ds = data.TensorDataset(ag.tensor(x), ag.tensor(y))
    assert len(ds) == 11
    _same(ds[3], want["item3"])
    for kw, (_, _, tb) in zip(kws, want["loaders"], strict=True):  # tb: the batches (_plain's contents)
        ob = list(data.DataLoader(ds, sampler=_ListSampler(order), **kw))
        for a, b in zip(ob, tb, strict=True):
            _same(a, b)
        with trio.fail_after(20):
            ab = [b async for b in data.DataLoader(ds, sampler=_ListSampler(order), **kw)]
        for a, b in zip(ab, tb, strict=True):
            _same(a, b)
    sub = data.Subset(ds, [10, 0, 5])
    _same(list(data.DataLoader(sub, batch_size=2)), want["subset"])
    _same(list(data.DataLoader(data.Subset(sub, [2, 0]), batch_size=2)), want["subset_of_subset"])
    with pytest.raises(ValueError, match=r"Size mismatch between tensors: first dimensions are \[2, 3\]"):
        data.TensorDataset(ag.zeros(2), ag.zeros(3))
    cat = data.ConcatDataset([ds, ds])
    assert len(cat) == want["cat_len"] == 22
    _same(cat[15], want["cat15"])
    _same(cat[-1], want["cat_last"])
    _same((ds + ds)[12], want["plus12"])


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


async def test_samplers(rt: ag.Runtime, torch_ref) -> None:
    src = list(range(7))

    def reference(torch: Any) -> Any:
        tdata = torch.utils.data
        g = type(torch.Generator())
        return {
            "sequential": list(tdata.SequentialSampler(src)),
            "batch": list(tdata.BatchSampler(tdata.SequentialSampler(range(10)), 3, False)),
            "generator_type": [g.__module__, g.__qualname__],
        }

    want = torch_ref("samplers", reference, src=src)
    assert list(data.SequentialSampler(src)) == want["sequential"]
    g = np.random.default_rng(0)
    r = list(data.RandomSampler(src, generator=g))
    assert sorted(r) == src
    r2 = list(data.RandomSampler(src, num_samples=10, generator=g))
    assert len(r2) == 10 and sorted(r2[:7]) == src
    rr = list(data.RandomSampler(src, replacement=True, num_samples=50, generator=g))
    assert len(rr) == 50 and set(rr) <= set(src)
    bs = data.BatchSampler(data.SequentialSampler(range(10)), batch_size=3, drop_last=False)
    assert list(bs) == want["batch"]
    assert len(bs) == 4 and len(data.BatchSampler(range(10), 3, True)) == 3
    assert sorted(data.SubsetRandomSampler([4, 8, 9], generator=g)) == [4, 8, 9]
    w = list(data.WeightedRandomSampler([0.0, 1.0, 0.0, 3.0], 40, generator=g))
    assert set(w) <= {1, 3} and w.count(3) > w.count(1)
    with pytest.raises(ValueError, match="num_samples should be a positive integer"):
        data.RandomSampler(src, num_samples=0)
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        data.BatchSampler(src, 0, False)
    # a torch.Generator (a PyTorch program's): a stand-in of its recorded type, so this runs without torch
    module, qualname = want["generator_type"]
    torch_generator = type(qualname.rpartition(".")[2], (), {"__module__": module, "__qualname__": qualname})()
    with pytest.raises(TypeError, match=r"numpy\.random\.Generator.*got Generator"):
        data.RandomSampler(src, generator=torch_generator)


async def test_random_split(rt: ag.Runtime, torch_ref) -> None:
    ds = data.TensorDataset(ag.arange(10))
    parts = data.random_split(ds, [3, 7], generator=np.random.default_rng(0))
    got = sorted(int(p[i][0].item()) for p in parts for i in range(len(p)))
    assert [len(p) for p in parts] == [3, 7] and got == list(range(10))
    fr = data.random_split(ds, [0.5, 0.3, 0.2], generator=np.random.default_rng(0))
    t_lens = torch_ref("random_split_lengths",
                       lambda torch: [len(p) for p in torch.utils.data.random_split(range(10), [0.5, 0.3, 0.2])])
    assert [len(p) for p in fr] == t_lens
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


def _t_stream(torch: Any, n: int) -> Any:
    """``_Stream`` as a ``torch.utils.data.IterableDataset``."""

    class _TStream(torch.utils.data.IterableDataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __iter__(self):  # type: ignore[no-untyped-def]
            for i in range(self.n):
                yield {"x": np.array([i, -i], np.float32), "i": i}

        def __len__(self) -> int:
            return self.n

    return _TStream(n)


async def test_iterable_dataset(rt: ag.Runtime, torch_ref) -> None:
    kws: list[dict[str, Any]] = [{"batch_size": 3}, {"batch_size": 3, "drop_last": True}, {"batch_size": None}]

    def reference(torch: Any) -> Any:
        loaders = [torch.utils.data.DataLoader(_t_stream(torch, 8), **kw) for kw in kws]
        return [(_plain(torch, list(loader)), len(loader)) for loader in loaders]

    want = torch_ref("iterable", reference, n=8, kws=kws)
    for kw, (tb, t_len) in zip(kws, want, strict=True):
        _same(list(data.DataLoader(_Stream(8), **kw)), tb)
        with trio.fail_after(20):
            _same([b async for b in data.DataLoader(_Stream(8), **kw)], tb)
        assert len(data.DataLoader(_Stream(8), **kw)) == t_len
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
