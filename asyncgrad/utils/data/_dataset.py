"""Datasets as in ``torch.utils.data``: map-style `Dataset`, `IterableDataset`, `TensorDataset`, `Subset`,
`ConcatDataset`, and `random_split`."""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from ...runtime import Tensor, default_generator

__all__ = ["ConcatDataset", "Dataset", "IterableDataset", "Subset", "TensorDataset", "random_split"]

T_co = TypeVar("T_co", covariant=True)


class Dataset(Generic[T_co]):
    """A map-style dataset: subclasses define ``__getitem__(index)`` and usually ``__len__``.

    A `DataLoader` iterated with ``async for`` calls ``__getitem__`` on the event-loop thread and
    collates on its prefetch thread (see `DataLoader`).
    """

    def __getitem__(self, index: Any) -> T_co:
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__.")

    def __add__(self, other: Dataset[T_co]) -> ConcatDataset[T_co]:
        return ConcatDataset([self, other])


class IterableDataset(Dataset[T_co]):
    """A dataset of samples produced by ``__iter__`` (a stream: no indices, no sampler)."""

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError("Subclasses of IterableDataset should implement __iter__.")

    def __add__(self, other: Dataset[T_co]) -> Any:
        raise TypeError("IterableDataset does not support '+' (ConcatDataset takes map-style datasets only)")


class TensorDataset(Dataset[tuple[Tensor, ...]]):
    """Samples ``(t[i] for t in tensors)`` of tensors that share their first dimension.

    Args:
        *tensors: Tensors with the same size of dimension 0.

    Raises:
        ValueError: If the first dimensions differ (naming each size).
    """

    def __init__(self, *tensors: Tensor) -> None:
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor")
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"TensorDataset takes asyncgrad Tensors, got {type(t).__name__}")
            if t.ndim == 0:
                raise ValueError("TensorDataset: a 0-d tensor has no first dimension to index")
        sizes = [t.shape[0] for t in tensors]
        if any(s != sizes[0] for s in sizes):
            raise ValueError(f"Size mismatch between tensors: first dimensions are {sizes}")
        self.tensors = tensors

    def __getitem__(self, index: Any) -> tuple[Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __len__(self) -> int:
        return self.tensors[0].shape[0]

    def _arrays(self) -> tuple[np.ndarray, ...]:
        # the loader's batch fast path gathers rows from these (on the event-loop thread: waits for values)
        return tuple(np.asarray(t) for t in self.tensors)


class Subset(Dataset[T_co]):
    """The samples of ``dataset`` at ``indices``."""

    def __init__(self, dataset: Dataset[T_co], indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = indices

    def __getitem__(self, idx: Any) -> T_co:
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]  # type: ignore[index]
        return self.dataset[self.indices[idx]]

    def __len__(self) -> int:
        return len(self.indices)


class ConcatDataset(Dataset[T_co]):
    """The samples of several map-style datasets, one after another."""

    def __init__(self, datasets: Sequence[Dataset[T_co]]) -> None:
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("datasets should not be an empty iterable")
        for d in self.datasets:
            if isinstance(d, IterableDataset):
                raise TypeError("ConcatDataset does not support IterableDataset")
        self.cumulative_sizes = list(np.cumsum([len(d) for d in self.datasets]))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return int(self.cumulative_sizes[-1])

    def __getitem__(self, idx: int) -> T_co:
        if idx < 0:
            if -idx > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            idx = len(self) + idx
        d = bisect.bisect_right(self.cumulative_sizes, idx)
        start = 0 if d == 0 else int(self.cumulative_sizes[d - 1])
        return self.datasets[d][idx - start]


def random_split(
    dataset: Dataset[T_co], lengths: Sequence[int | float], generator: np.random.Generator | None = None
) -> list[Subset[T_co]]:
    """Split ``dataset`` into non-overlapping random `Subset` s of the given lengths.

    Args:
        dataset: A map-style dataset with ``__len__``.
        lengths: Lengths summing to ``len(dataset)``, or fractions summing to 1 (the remainder is dealt
            round-robin, as in PyTorch).
        generator: The numpy generator of the permutation (default: asyncgrad's default generator).

    Raises:
        ValueError: If the lengths do not add up.
    """
    n = len(dataset)  # type: ignore[arg-type]
    lens = list(lengths)
    if math.isclose(sum(lens), 1) and sum(lens) <= 1:
        counts = [math.floor(n * f) for f in lens]
        for i in range(n - sum(counts)):
            counts[i % len(counts)] += 1
        for i, c in enumerate(counts):
            if c == 0:
                warnings.warn(f"Length of split at index {i} is 0. This might result in an empty dataset.",
                              stacklevel=2)
        lens = counts  # type: ignore[assignment]
    if sum(lens) != n:
        raise ValueError("Sum of input lengths does not equal the length of the input dataset!")
    g = default_generator() if generator is None else generator
    perm = g.permutation(n).tolist()
    out, off = [], 0
    for ln in lens:
        out.append(Subset(dataset, perm[off : off + int(ln)]))
        off += int(ln)
    return out


def array_source(ds: Any) -> tuple[tuple[np.ndarray, ...], np.ndarray | None] | None:
    """For a `TensorDataset` (or a `Subset` of one): its arrays and the index map, for batched gathers."""
    if type(ds) is TensorDataset:
        return ds._arrays(), None
    if type(ds) is Subset:
        base = array_source(ds.dataset)
        if base is None:
            return None
        arrays, imap = base
        idx = np.asarray(ds.indices, dtype=np.int64)
        return arrays, idx if imap is None else imap[idx]
    return None
