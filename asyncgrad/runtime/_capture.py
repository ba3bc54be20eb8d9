"""The recording seam of `asyncgrad.compile`: one module attribute the hot paths check.

While a compiled step records, `active` holds its recorder (`autograd._compile`); the recording hooks in
dispatch (`apply`, `apply1`, `apply2`), in-place updates, the backward node runner, `.grad` accumulation
and the host reads of `Tensor` hand their work to it. When nothing records, each hook costs one module
attribute load and a compare with None.
"""

from __future__ import annotations

from typing import Any

# the recorder of the step recording now (in this process), or None; set only by `autograd._compile`
active: Any = None


class CaptureFallback(UserWarning):
    """A compiled step could not be captured (or replayed) and runs eagerly; the message says why."""


def capture_active() -> Any:
    """The recorder of the step recording on this thread right now, or None (for the layers above:
    optimizers announce their step, modules their hooks)."""
    rec = active
    if rec is not None and rec.wants():
        return rec
    return None
