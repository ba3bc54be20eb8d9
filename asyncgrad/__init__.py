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

from . import autograd, cuda, nn, optim, utils
from .devices import device
from .runtime import *  # noqa: F403
from .runtime import __all__ as _runtime_all
from .utils import load, save

if TYPE_CHECKING:
    from . import hosting

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
__all__ = [*_runtime_all, "autograd", "cuda", "device", "hosting", "load", "nn", "optim", "save", "utils"]


def __getattr__(name: str) -> Any:
    # `hosting` pulls in asyncio (~3 MB resident); load it only for programs that use it
    if name == "hosting":
        import importlib

        return importlib.import_module(".hosting", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
