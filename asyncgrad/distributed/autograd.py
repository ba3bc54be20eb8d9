"""``dist.autograd``: distributed autograd helpers (the recording itself is automatic; see DESIGN)."""

from ._dist_autograd import forwards_alive, stages_pending

__all__ = ["forwards_alive", "stages_pending"]
