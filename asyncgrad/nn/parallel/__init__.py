"""Data parallel training: `DistributedDataParallel` over an `asyncgrad.distributed` process group."""

from ._distributed import DistributedDataParallel, ReducerStatistics

__all__ = ["DistributedDataParallel", "ReducerStatistics"]
