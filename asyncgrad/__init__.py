"""asyncgrad: an async, actor-based autograd runtime on trio, over numpy (CPU) and cupy (CUDA).

Example::

    import asyncgrad as ag

    async def main():
        x = ag.tensor([1.0, 2.0], requires_grad=True)
        await (x * x).sum().backward()
        print(x.grad)

    ag.run(main)
"""

from typing import TYPE_CHECKING, Any

from . import nn, optim
from .runtime import *  # noqa: F403
from .runtime import __all__ as _runtime_all

if TYPE_CHECKING:
    from . import hosting

__version__ = "0.1.0"
__all__ = [*_runtime_all, "hosting", "nn", "optim"]


def __getattr__(name: str) -> Any:
    # `hosting` pulls in asyncio (~3 MB resident); load it only for programs that use it
    if name == "hosting":
        import importlib

        return importlib.import_module(".hosting", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
