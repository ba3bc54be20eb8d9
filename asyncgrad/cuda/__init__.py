"""PyTorch's ``torch.cuda`` names that programs test before choosing a device.

``device = "cuda" if ag.cuda.is_available() else "cpu"`` picks the CPU until asyncgrad has a CUDA
device: `is_available` is True only when the devices layer provides one (``devices.CUDADevice``) AND
cupy sees a GPU, so a program never chooses a device it then cannot open.
"""

from __future__ import annotations

from typing import Any

from .. import devices as _devices

__all__ = ["device_count", "is_available", "manual_seed", "manual_seed_all", "synchronize"]


def _cupy_device_count() -> int:
    try:
        import cupy  # type: ignore[import-not-found]
    except Exception:  # not installed, or its CUDA libraries do not load
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # a driver without a GPU raises here
        return 0


def device_count() -> int:
    """How many CUDA devices asyncgrad can use (0 without cupy, a GPU, or asyncgrad's CUDA device)."""
    if not hasattr(_devices, "CUDADevice"):
        return 0
    return _cupy_device_count()


def is_available() -> bool:
    """Whether a CUDA device can be used (``device_count() > 0``)."""
    return device_count() > 0


def manual_seed(seed: int) -> None:
    """Accepted for PyTorch programs: without a CUDA device there is no CUDA generator to seed."""


def manual_seed_all(seed: int) -> None:
    """Accepted for PyTorch programs (see `manual_seed`)."""


def synchronize(device: Any = None) -> None:
    """Raise the clear error of a missing CUDA device (there is nothing to synchronize on CPU)."""
    if not is_available():
        raise RuntimeError(
            "asyncgrad.cuda.synchronize(): no CUDA device is available (the CUDA device needs cupy and a GPU); "
            "CPU work is awaited with `await t.ready()`"
        )
