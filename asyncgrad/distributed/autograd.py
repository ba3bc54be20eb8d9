"""``dist.autograd``: distributed autograd helpers (the recording itself is automatic; see DESIGN)."""

from ._dist_autograd import forwards_alive

__all__ = ["forwards_alive"]
