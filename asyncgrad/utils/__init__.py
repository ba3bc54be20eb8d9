"""Utilities: checkpoints (`save` / `load`, safetensors without pickle) and `data` (datasets, loaders)."""

from ._serialization import load, save

__all__ = ["load", "save"]
