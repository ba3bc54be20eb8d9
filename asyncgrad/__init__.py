"""asyncgrad: an async, actor-based autograd runtime on trio, over numpy (CPU) and cupy (CUDA).

Example::

    import asyncgrad as ag

    async def main():
        x = ag.tensor([1.0, 2.0], requires_grad=True)
        await (x * x).sum().backward()
        print(x.grad)

    ag.run(main)
"""

from . import hosting as hosting
from . import nn, optim
from .runtime import *  # noqa: F403
from .runtime import __all__ as _runtime_all

__version__ = "0.1.0"
__all__ = [*_runtime_all, "hosting", "nn", "optim"]
