"""Devices, streams and events: where kernels run (numpy on CPU lanes; cupy streams on CUDA).

The seam for CUDA: a device subclasses `Device` (an actor owning its streams, pool and apply lock) and
provides `_new_stream()`. Everything above this layer talks only to `Stream` (`submit`, `query`,
`is_done`, `synchronize`/`synchronize_blocking`, `record_event`, `wait_event`) and `Event`. A cupy
stream maps onto it directly: ``submit(job)`` runs ``job`` on the host inside ``with cupy_stream:`` (the
job only *launches* kernels, asynchronously), completion is a cupy ``Event`` recorded after it, and
``wait_event`` is ``cupy_stream.wait_event``; `Runtime.device("cuda")` is where the device gets opened.
The CUDA device itself is not implemented yet (no GPU to test on); asking for one says so.
"""

from ._blas import add_scaled
from ._blas import boost_available as blas_boost_available
from ._blas import boosted as blas_boosted
from ._blas import solo as blas_solo
from ._blas import unboost as blas_unboost
from ._device import (
    DEFAULT_LANE_NICE,
    INLINE_MAX_ELEMENTS,
    SHARED_INLINE_MAX_ELEMENTS,
    SHARED_INLINE_MAX_MACS,
    CPUDevice,
    Device,
    DeviceStatistics,
    GetStatistics,
    StreamPool,
    Synchronize,
)
from ._hostmem import MIN_BYTES as HOST_CACHE_MIN_BYTES
from ._hostmem import HostCache, HostCacheStatistics, lane_empty, private_base
from ._spec import DEVICE_TYPES, device
from ._stream import Event, KernelError, Lane, Stream, StreamStatistics, idle_siblings, run_parts

__all__ = [
    "DEFAULT_LANE_NICE",
    "DEVICE_TYPES",
    "HOST_CACHE_MIN_BYTES",
    "INLINE_MAX_ELEMENTS",
    "SHARED_INLINE_MAX_ELEMENTS",
    "SHARED_INLINE_MAX_MACS",
    "CPUDevice",
    "Device",
    "DeviceStatistics",
    "Event",
    "GetStatistics",
    "HostCache",
    "HostCacheStatistics",
    "KernelError",
    "Lane",
    "Stream",
    "StreamPool",
    "StreamStatistics",
    "Synchronize",
    "add_scaled",
    "blas_boost_available",
    "blas_boosted",
    "blas_solo",
    "blas_unboost",
    "device",
    "idle_siblings",
    "lane_empty",
    "private_base",
    "run_parts",
]
