"""Building a ``statistics()`` record from the counters an object keeps."""

from __future__ import annotations

from typing import Any, TypeVar

import attrs

R = TypeVar("R")


def read_record(cls: type[R], source: object, /, **given: Any) -> R:
    """The attrs record ``cls`` with each field not in ``given`` read from ``source``.

    A field ``f`` is read from the attribute ``source._f`` (a private counter), else ``source.f``; ``given``
    names the fields that are computed, or kept under another name.
    """
    values = dict(given)
    for f in attrs.fields(cls):  # type: ignore[arg-type]
        if f.name not in values:
            private = "_" + f.name
            values[f.name] = getattr(source, private) if hasattr(source, private) else getattr(source, f.name)
    return cls(**values)
