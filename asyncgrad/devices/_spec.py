"""`device`: a plain description of a device (``device("cpu")``, ``device("cuda", 1)``), as ``torch.device``.

A `Device` is a live actor owned by one runtime; a `device` is only a name for one, so it can be made
anywhere (module level, before a runtime is open), hashed, compared and passed wherever a device is
taken: ``Runtime.device(spec)`` resolves it (by its string form) to that runtime's actor.
"""

from __future__ import annotations

from typing import Any

from ._device import Device

# the kinds a name may start with; only "cpu" has a device today (see `Runtime.device` for "cuda")
DEVICE_TYPES = ("cpu", "cuda")


class device:  # lower case: PyTorch's name
    """The name of a device: a type (``"cpu"``, ``"cuda"``) and an optional index.

    Args:
        type: ``"cpu"``, ``"cuda"``, ``"cpu:1"``, ``"cuda:0"``, another `device`, or a runtime `Device`.
        index: The device index; only when ``type`` has none.

    Raises:
        RuntimeError: For an unknown device type, a bad index, or an index given twice.
    """

    __slots__ = ("_index", "_type")

    def __init__(self, type: Any, index: int | None = None) -> None:
        if isinstance(type, (device, Device)):
            if index is not None:
                raise RuntimeError(f"device({type!r}, {index}): the device already has an index")
            self._type, self._index = type.type, type.index
            return
        if not isinstance(type, str):
            raise TypeError(f"device() expects a string such as 'cpu' or 'cuda:0', got {type.__class__.__name__}")
        kind, sep, idx = type.partition(":")
        if kind not in DEVICE_TYPES:
            raise RuntimeError(
                f"Expected one of {', '.join(DEVICE_TYPES)} device type at start of device string: {type}"
            )
        if sep:
            if index is not None:
                raise RuntimeError(f"device({type!r}, {index}): type (string) must not include an index")
            if not idx.isdigit():
                raise RuntimeError(f"Invalid device string: {type!r} (the index must be a non-negative integer)")
            index = int(idx)
        if index is not None:
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise RuntimeError(f"Device index must not be negative or a non-integer, got {index!r}")
        self._type, self._index = kind, index

    @property
    def type(self) -> str:
        """The device type: ``"cpu"`` or ``"cuda"``."""
        return self._type

    @property
    def index(self) -> int | None:
        """The device index, or None when not given."""
        return self._index

    def __str__(self) -> str:
        return self._type if self._index is None else f"{self._type}:{self._index}"

    def __repr__(self) -> str:
        if self._index is None:
            return f"device(type={self._type!r})"
        return f"device(type={self._type!r}, index={self._index})"

    def _key(self) -> tuple[str, int]:
        # no index means the current (first) device of the type, which is what a runtime resolves it to
        return self._type, 0 if self._index is None else self._index

    def __eq__(self, other: object) -> bool:
        if isinstance(other, device):
            return (self._type, self._index) == (other._type, other._index)
        if isinstance(other, Device):
            # a tensor's device is a runtime Device (always indexed): ``t.device == device("cpu")`` holds
            return self._key() == (other.type, other.index)
        if isinstance(other, str):
            try:
                return self == device(other)
            except (RuntimeError, TypeError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._type, self._index))

    # immutable: a copy is the same name
    def __copy__(self) -> device:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> device:
        return self
