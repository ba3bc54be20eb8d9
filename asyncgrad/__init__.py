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

import numpy as np

from . import nn, optim
from .runtime import *  # noqa: F403
from .runtime import __all__ as _runtime_all

if TYPE_CHECKING:
    from . import distributed, hosting

# dtype names as in PyTorch (``dtype=ag.float32``); any numpy dtype works too. Not in __all__, so that
# ``from asyncgrad import *`` does not shadow the builtins ``bool`` and ``float``
float16 = half = np.dtype("float16")
float32 = float = np.dtype("float32")
float64 = double = np.dtype("float64")
int8, int16, int32, int64 = (np.dtype(f"int{n}") for n in (8, 16, 32, 64))
uint8 = np.dtype("uint8")
long = int64
bool = np.dtype("bool")

__version__ = "0.1.0"
__all__ = [*_runtime_all, "distributed", "hosting", "nn", "optim"]


def __getattr__(name: str) -> Any:
    # `hosting` pulls in asyncio (~3 MB resident), `distributed` msgpack and subprocess: load them only for
    # programs that use them
    if name in ("hosting", "distributed"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
