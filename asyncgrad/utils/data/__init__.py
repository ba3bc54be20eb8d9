"""Datasets, samplers and `DataLoader`, as ``torch.utils.data`` (``for`` and prefetching ``async for``)."""

from ._collate import default_collate, default_convert
from ._dataloader import DataLoader, DataLoaderIterStatistics
from ._dataset import ConcatDataset, Dataset, IterableDataset, Subset, TensorDataset, random_split
from ._sampler import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from ._worker import WorkerInfo, get_worker_info

__all__ = [
    "BatchSampler",
    "ConcatDataset",
    "DataLoader",
    "DataLoaderIterStatistics",
    "Dataset",
    "IterableDataset",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "Subset",
    "SubsetRandomSampler",
    "TensorDataset",
    "WeightedRandomSampler",
    "WorkerInfo",
    "default_collate",
    "default_convert",
    "get_worker_info",
    "random_split",
]
