"""Utilities: checkpoints (`save` / `load`, safetensors without pickle) and `data` (datasets, loaders)."""

from . import data
from ._serialization import load, save

__all__ = ["data", "load", "save"]
