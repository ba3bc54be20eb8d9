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

from typing import TYPE_CHECKING, Any

from . import functional, init
from . import utils as utils

if TYPE_CHECKING:
    from . import parallel
from ._conv_layers import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    Conv1d,
    Conv2d,
    ConvTranspose1d,
    ConvTranspose2d,
    GroupNorm,
    Upsample,
    UpsamplingBilinear2d,
    UpsamplingNearest2d,
)
from ._layers import (
    ELU,
    GELU,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Dropout,
    Embedding,
    Flatten,
    Hardtanh,
    Identity,
    LayerNorm,
    LeakyReLU,
    Linear,
    LogSoftmax,
    MaxPool2d,
    ModuleDict,
    ModuleList,
    ParameterDict,
    ParameterList,
    ReLU,
    ReLU6,
    Sequential,
    Sigmoid,
    SiLU,
    Softmax,
    Softplus,
    Tanh,
)
from ._loss import (
    BCELoss,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    HuberLoss,
    KLDivLoss,
    L1Loss,
    MSELoss,
    NLLLoss,
    SmoothL1Loss,
)
from ._module import Module, Parameter, load_state_dict_file, save_state_dict
from ._rnn import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNBase, RNNCell, RNNCellBase
from ._transformer import (
    MultiheadAttention,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "ELU",
    "GELU",
    "GRU",
    "LSTM",
    "RNN",
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AvgPool2d",
    "BCELoss",
    "BCEWithLogitsLoss",
    "BatchNorm1d",
    "BatchNorm2d",
    "Conv1d",
    "Conv2d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "Flatten",
    "GRUCell",
    "GroupNorm",
    "Hardtanh",
    "HuberLoss",
    "Identity",
    "KLDivLoss",
    "L1Loss",
    "LSTMCell",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "LogSoftmax",
    "MSELoss",
    "MaxPool2d",
    "Module",
    "ModuleDict",
    "ModuleList",
    "MultiheadAttention",
    "NLLLoss",
    "Parameter",
    "ParameterDict",
    "ParameterList",
    "RNNBase",
    "RNNCell",
    "RNNCellBase",
    "ReLU",
    "ReLU6",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "SmoothL1Loss",
    "Softmax",
    "Softplus",
    "Tanh",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "Upsample",
    "UpsamplingBilinear2d",
    "UpsamplingNearest2d",
    "functional",
    "init",
    "load_state_dict_file",
    "parallel",
    "save_state_dict",
    "utils",
]


def __getattr__(name: str) -> Any:
    # `parallel` (DistributedDataParallel) builds on `asyncgrad.distributed`: loaded on first use, so that
    # `import asyncgrad` does not load the distributed layer
    if name == "parallel":
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
