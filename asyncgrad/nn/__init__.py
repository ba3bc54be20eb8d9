"""Neural-network building blocks with PyTorch's names: `Module`, layers, losses, `functional`, `init`.

Example::

    import asyncgrad as ag
    from asyncgrad import nn

    async def main():
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        loss = nn.functional.cross_entropy(model(x), y)
        await loss.backward()

Modules hold tensors, so build them inside an open runtime (`asyncgrad.run` / `asyncgrad.open_runtime`).
"""

from . import functional, init
from . import utils as utils
from ._layers import (
    GELU,
    AvgPool2d,
    Conv2d,
    Dropout,
    Embedding,
    Flatten,
    Identity,
    LayerNorm,
    Linear,
    LogSoftmax,
    MaxPool2d,
    ModuleList,
    ReLU,
    Sequential,
    Sigmoid,
    Softmax,
    Tanh,
)
from ._loss import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss, NLLLoss
from ._module import Module, Parameter, load_state_dict_file, save_state_dict

__all__ = [
    "GELU",
    "AvgPool2d",
    "BCEWithLogitsLoss",
    "Conv2d",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "Flatten",
    "Identity",
    "LayerNorm",
    "Linear",
    "LogSoftmax",
    "MSELoss",
    "MaxPool2d",
    "Module",
    "ModuleList",
    "NLLLoss",
    "Parameter",
    "ReLU",
    "Sequential",
    "Sigmoid",
    "Softmax",
    "Tanh",
    "functional",
    "init",
    "load_state_dict_file",
    "save_state_dict",
    "utils",
]
