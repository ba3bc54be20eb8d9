"""`DataLoaderIterStatistics`: counters of one ``async for`` pass over a `DataLoader`."""

from __future__ import annotations

import attrs

__all__ = ["DataLoaderIterStatistics"]


@attrs.frozen
class DataLoaderIterStatistics:
    """Counters of one ``async for`` pass over a `DataLoader`.

    Attributes:
        batches: Batches handed out so far.
        waited: How many of them were not ready when asked for (the step waited for data).
        wait_seconds: Total time spent waiting for them.
        in_flight: Batches being prefetched now.
        thread_alive: Whether the prefetch thread is running.
    """

    batches: int
    waited: int
    wait_seconds: float
    in_flight: int
    thread_alive: bool
