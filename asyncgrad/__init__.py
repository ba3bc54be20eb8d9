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

from . import _openblas_env  # noqa: F401  (first: OpenBLAS's pool spin while this import loads numpy)

# isort: split
import numpy as np

from . import _tensor_methods, autograd, cuda, nn, ops, optim, runtime, utils  # noqa: F401  (_tensor_methods binds Tensor's methods)
from .autograd import (
    BackwardError,
    CaptureFallback,
    CompiledStep,
    CompileStatistics,
    ForgottenAwaitWarning,
    Function,
    FunctionCtx,
    backward,
    checkpoint,
    grad,
    once_differentiable,
)
from .autograd import compile as compile  # not in __all__ (as bool and float): keeps the builtin for star imports
from .devices import device
from .ops import *  # noqa: F403  (every op: ag.add, ag.conv2d, ...)
from .runtime import *  # noqa: F403  (Tensor, the factories, grad modes, Runtime, ...)
from .utils import load, save

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
__all__ = [
    *ops.__all__,
    *runtime.__all__,
    "ForgottenAwaitWarning",
    "BackwardError",
    "CaptureFallback",
    "CompileStatistics",
    "CompiledStep",
    "Function",
    "FunctionCtx",
    "autograd",
    "backward",
    "checkpoint",
    "cuda",
    "device",
    "distributed",
    "grad",
    "hosting",
    "load",
    "nn",
    "once_differentiable",
    "optim",
    "save",
    "utils",
]


_LAZY = frozenset({"distributed", "hosting"})


def __getattr__(name: str) -> Any:
    # loaded on first use only: `hosting` pulls in asyncio (~3 MB resident), `distributed` the RPC, wire and
    # population machinery (a third of `import asyncgrad`'s time), which a single-process program never needs
    if name in _LAZY:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
