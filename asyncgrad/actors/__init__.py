"""A small, general actor toolkit on trio.

An actor owns a mailbox and its state, and handles one message at a time in its own task, so its
state needs no locks. This package knows nothing of autograd; higher layers build on it.
"""

from ._actor import Actor, ActorClosedError, ActorStatistics
from ._record import read_record

__all__ = ["Actor", "ActorClosedError", "ActorStatistics", "read_record"]
