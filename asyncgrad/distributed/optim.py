"""``dist.optim``: optimizers over remote parameters."""

from ._dist_optim import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
