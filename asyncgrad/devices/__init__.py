"""Devices, streams and events: where kernels run (numpy on CPU lanes; cupy streams on CUDA)."""

from ._device import (
    INLINE_MAX_ELEMENTS,
    CPUDevice,
    Device,
    DeviceStatistics,
    GetStatistics,
    StreamPool,
    Synchronize,
)
from ._stream import Event, KernelError, Lane, Stream, StreamStatistics

__all__ = [
    "INLINE_MAX_ELEMENTS",
    "CPUDevice",
    "Device",
    "DeviceStatistics",
    "Event",
    "GetStatistics",
    "KernelError",
    "Lane",
    "Stream",
    "StreamPool",
    "StreamStatistics",
    "Synchronize",
]
