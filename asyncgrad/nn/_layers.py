"""Layers: containers, Linear, pooling, activations, Dropout, LayerNorm, BatchNorm, Embedding, Flatten.

Default initialisation is PyTorch's: weights ``kaiming_uniform_(a=sqrt(5))`` (a bound of
``1/sqrt(fan_in)``), biases ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, embeddings ``N(0, 1)``, layer-norm
weights 1 and biases 0. Random numbers come from `asyncgrad.default_generator()` (seed with
`asyncgrad.manual_seed`). Layers must be built inside an open runtime (their parameters are tensors).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from .. import ops, runtime
from ..runtime import Tensor, get_default_dtype
from . import functional as F
from . import init
from ._module import Module, Parameter

__all__ = [
    "ELU",
    "GELU",
    "AvgPool2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "Dropout",
    "Embedding",
    "Flatten",
    "Hardtanh",
    "Identity",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "LogSoftmax",
    "MaxPool2d",
    "ModuleDict",
    "ModuleList",
    "ParameterDict",
    "ParameterList",
    "ReLU",
    "ReLU6",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Softplus",
    "Tanh",
]


def _new_param(shape: Sequence[int], dtype: Any, device: Any) -> Tensor:
    dt = get_default_dtype() if dtype is None else np.dtype(dtype)
    t = runtime.tensor(np.zeros(tuple(shape), dtype=dt), dtype=dt, device="cpu" if device is None else device)
    return Parameter(t)


def _add_weight_bias(
    m: Module, weight_shape: Sequence[int] | None, bias_shape: Sequence[int] | None, dtype: Any, device: Any
) -> None:
    """Register ``m``'s ``weight`` and ``bias`` (zeros until its ``reset_parameters``), each a None
    placeholder where its shape is None: what Linear, the convolutions and the normalisations share."""
    for name, shape in (("weight", weight_shape), ("bias", bias_shape)):
        if shape is None:
            m.register_parameter(name, None)
        else:
            setattr(m, name, _new_param(shape, dtype, device))


def _init_norm_(weight: Tensor | None, bias: Tensor | None) -> None:
    """A normalisation's affine parameters at the identity: weight 1, bias 0 (those it has)."""
    if weight is not None:
        init.ones_(weight)
    if bias is not None:
        init.zeros_(bias)


# ---- containers --------------------------------------------------------------------------------


def _abs_index(idx: Any, n: int) -> int:
    idx = operator.index(idx)
    if not -n <= idx < n:
        raise IndexError(f"index {idx} is out of range")
    return idx % n


class Sequential(Module):
    """Modules applied one after another: ``Sequential(m1, m2, ...)`` or ``Sequential(OrderedDict)``.

    Indexing, slicing (a slice is a new ``Sequential`` sharing the modules), ``len``, iteration,
    ``append``/``insert``/``extend``/``pop``, item assignment and deletion, and ``+`` work as in PyTorch
    (deleting or inserting renumbers the keys ``"0"``, ``"1"``, ...).
    """

    def __init__(self, *args: Any) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, m in args[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(args):
                self.add_module(str(i), m)

    def forward(self, input: Any) -> Any:
        for m in self._modules.values():
            input = m(input)
        return input

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def _renumber(self) -> None:
        mods = list(self._modules.values())
        self._modules.clear()
        for i, m in enumerate(mods):
            self._modules[str(i)] = m

    @overload
    def __getitem__(self, idx: slice) -> Sequential: ...
    @overload
    def __getitem__(self, idx: int) -> Module: ...
    def __getitem__(self, idx: int | slice) -> Module:
        if isinstance(idx, slice):
            return type(self)(OrderedDict(list(self._modules.items())[idx]))
        keys = list(self._modules)
        return self._modules[keys[_abs_index(idx, len(keys))]]  # type: ignore[no-any-return]

    def __setitem__(self, idx: int, module: Module) -> None:
        keys = list(self._modules)
        setattr(self, keys[_abs_index(idx, len(keys))], module)

    def __delitem__(self, idx: int | slice) -> None:
        keys = list(self._modules)
        if isinstance(idx, slice):
            for key in keys[idx]:
                delattr(self, key)
        else:
            delattr(self, keys[_abs_index(idx, len(keys))])
        self._renumber()

    def __add__(self, other: Sequential) -> Sequential:
        if not isinstance(other, Sequential):
            raise ValueError(
                "add operator supports only objects of Sequential class, but "
                f"{type(other).__name__} is given."
            )
        ret = Sequential()
        for m in self:
            ret.append(m)
        for m in other:
            ret.append(m)
        return ret

    def __iadd__(self, other: Sequential) -> Sequential:
        if not isinstance(other, Sequential):
            raise ValueError(
                "add operator supports only objects of Sequential class, but "
                f"{type(other).__name__} is given."
            )
        return self.extend(other)

    def append(self, module: Module) -> Sequential:
        """Add ``module`` at the end."""
        self.add_module(str(len(self)), module)
        return self

    def insert(self, index: int, module: Module) -> Sequential:
        """Insert ``module`` before position ``index`` (keys are renumbered)."""
        if not isinstance(module, Module):
            raise AssertionError(f"module should be of type: {Module}")
        n = len(self._modules)
        if not -n <= index <= n:
            raise IndexError(f"Index out of range: {index}")
        if index < 0:
            index += n
        mods = list(self._modules.values())
        mods.insert(index, module)
        self._modules.clear()
        for i, m in enumerate(mods):
            self._modules[str(i)] = m
        return self

    def extend(self, sequential: Iterable[Module]) -> Sequential:
        """Append every module of ``sequential``."""
        for m in sequential:
            self.append(m)
        return self

    def pop(self, key: int | slice) -> Any:
        """Remove and return the module (or the ``Sequential`` of modules) at ``key``."""
        v = self[key]
        del self[key]
        return v


class ModuleList(Module):
    """A list of modules whose parameters belong to the owner (PyTorch's ``ModuleList``).

    Supports indexing, slicing (a slice is a new ``ModuleList``), item assignment and deletion,
    ``append``/``insert``/``extend``/``pop``, ``+``/``+=``, ``len`` and iteration; keys are the
    positions ``"0"``, ``"1"``, ... and are renumbered after a deletion or insertion.
    """

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self += modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    @overload
    def __getitem__(self, idx: slice) -> ModuleList: ...
    @overload
    def __getitem__(self, idx: int) -> Module: ...
    def __getitem__(self, idx: int | slice) -> Module:
        if isinstance(idx, slice):
            return type(self)(list(self._modules.values())[idx])
        return self._modules[str(_abs_index(idx, len(self)))]  # type: ignore[no-any-return]

    def __setitem__(self, idx: int, module: Module) -> None:
        setattr(self, str(_abs_index(idx, len(self))), module)

    def __delitem__(self, idx: int | slice) -> None:
        if isinstance(idx, slice):
            for k in range(len(self._modules))[idx]:
                delattr(self, str(k))
        else:
            delattr(self, str(_abs_index(idx, len(self))))
        mods = list(self._modules.values())
        self._modules.clear()
        for i, m in enumerate(mods):
            self._modules[str(i)] = m

    def __iadd__(self, modules: Iterable[Module]) -> ModuleList:
        return self.extend(modules)

    def __add__(self, other: Iterable[Module]) -> ModuleList:
        combined = ModuleList()
        for i, m in enumerate(itertools.chain(self, other)):
            combined.add_module(str(i), m)
        return combined

    def insert(self, index: int, module: Module) -> None:
        """Insert ``module`` before position ``index``."""
        if not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        mods = list(self._modules.values())
        mods.insert(index, module)
        self._modules.clear()
        for i, m in enumerate(mods):
            self._modules[str(i)] = m

    def append(self, module: Module) -> ModuleList:
        """Add ``module`` at the end."""
        self.add_module(str(len(self)), module)
        return self

    def pop(self, key: int | slice) -> Any:
        """Remove and return the module (or the ``ModuleList`` of modules) at ``key``."""
        v = self[key]
        del self[key]
        return v

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        """Append every module of the iterable ``modules``."""
        if not isinstance(modules, Iterable):
            raise TypeError(
                "ModuleList.extend should be called with an iterable, but got " + type(modules).__name__
            )
        offset = len(self)
        for i, m in enumerate(modules):
            self.add_module(str(offset + i), m)
        return self


class ModuleDict(Module):
    """An ordered dict of modules whose parameters belong to the owner (PyTorch's ``ModuleDict``).

    Keys are the submodule names (so the state dict keys are ``"<key>.<param>"``); insertion order is kept.
    """

    def __init__(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]  # type: ignore[no-any-return]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __contains__(self, key: object) -> bool:
        return key in self._modules

    def clear(self) -> None:
        """Remove every module."""
        self._modules.clear()

    def pop(self, key: str) -> Module:
        """Remove ``key`` and return its module."""
        v = self[key]
        del self[key]
        return v

    def keys(self) -> Any:
        return self._modules.keys()

    def items(self) -> Any:
        return self._modules.items()

    def values(self) -> Any:
        return self._modules.values()

    def update(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]]) -> None:
        """Add (or replace) modules from a mapping or an iterable of ``(key, module)`` pairs."""
        if isinstance(modules, (OrderedDict, ModuleDict, Mapping)):
            for key, module in modules.items():
                self[key] = module
            return
        if not isinstance(modules, Iterable):
            raise TypeError(
                "ModuleDict.update should be called with an iterable of key/value pairs, but got "
                + type(modules).__name__
            )
        for j, m in enumerate(modules):
            if not isinstance(m, (tuple, list)):
                raise TypeError(
                    f"ModuleDict update sequence element #{j} should be Iterable; is {type(m).__name__}"
                )
            if len(m) != 2:
                raise ValueError(
                    f"ModuleDict update sequence element #{j} has length {len(m)}; 2 is required"
                )
            self[m[0]] = m[1]


def _as_param(value: Any) -> Any:
    # torch wraps a plain Tensor put into a ParameterList/ParameterDict into a Parameter
    if isinstance(value, Tensor) and not isinstance(value, Parameter):
        return Parameter(value)
    return value


def _param_repr(p: Any) -> str:
    if isinstance(p, Tensor):
        size = "x".join(str(d) for d in p.shape)
        kind = "Parameter containing" if isinstance(p, Parameter) else "Tensor containing"
        return f"{kind}: [{p.dtype} of size {size}{'' if str(p.device) == 'cpu' else f' ({p.device})'}]"
    return f"Object of type: {type(p).__name__}"


class ParameterList(Module):
    """A list of parameters registered on the owner (PyTorch's ``ParameterList``); keys ``"0"``, ``"1"``, ...

    A plain Tensor added to it is wrapped in a `Parameter` (requiring grad), as in PyTorch.
    """

    def __init__(self, values: Iterable[Any] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "_size", 0)
        if values is not None:
            self += values

    def __len__(self) -> int:
        return self._size  # type: ignore[no-any-return]

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            out = ParameterList()
            for i in range(self._size)[idx]:
                out.append(self[i])
            return out
        return getattr(self, str(_abs_index(idx, self._size)))

    def __setitem__(self, idx: int, param: Any) -> None:
        setattr(self, str(_abs_index(idx, self._size)), _as_param(param))

    def __iter__(self) -> Iterator[Any]:
        return iter(self[i] for i in range(self._size))

    def __iadd__(self, parameters: Iterable[Any]) -> ParameterList:
        return self.extend(parameters)

    def append(self, value: Any) -> ParameterList:
        """Add ``value`` (a Parameter, a Tensor to wrap, or any object) at the end."""
        new_idx = self._size
        object.__setattr__(self, "_size", new_idx + 1)
        self[new_idx] = value
        return self

    def extend(self, values: Iterable[Any]) -> ParameterList:
        """Append every element of ``values``."""
        if not isinstance(values, Iterable) or isinstance(values, Tensor):
            raise TypeError("ParameterList.extend should be called with an iterable, but got " + type(values).__name__)
        for v in values:
            self.append(v)
        return self

    def extra_repr(self) -> str:
        return "\n".join(f"({i}): {_param_repr(p)}" for i, p in enumerate(self))


class ParameterDict(Module):
    """An ordered dict of parameters registered on the owner under their keys (PyTorch's ``ParameterDict``).

    A plain Tensor put into it is wrapped in a `Parameter` (requiring grad), as in PyTorch.
    """

    def __init__(self, parameters: Any = None) -> None:
        super().__init__()
        object.__setattr__(self, "_keys", {})
        if parameters is not None:
            self.update(parameters)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(f"ParameterDict keys must be strings, got {type(key).__name__}")
        self._keys[key] = None
        setattr(self, key, _as_param(value))

    def __delitem__(self, key: str) -> None:
        del self._keys[key]
        delattr(self, key)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self) -> Any:
        return self._keys.keys()

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((k, self[k]) for k in self._keys)

    def values(self) -> Iterator[Any]:
        return (self[k] for k in self._keys)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def pop(self, key: str) -> Any:
        """Remove ``key`` and return its value."""
        v = self[key]
        del self[key]
        return v

    def clear(self) -> None:
        """Remove every entry."""
        for k in list(self._keys):
            del self[k]

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, parameters: Any) -> None:
        """Add (or replace) entries from a mapping or an iterable of ``(key, value)`` pairs."""
        if isinstance(parameters, (Mapping, ParameterDict)):
            items = list(parameters.items())
            if not isinstance(parameters, (OrderedDict, ParameterDict)) and isinstance(parameters, dict):
                items = sorted(items)  # torch sorts a plain dict's keys
            for k, v in items:
                self[k] = v
            return
        if not isinstance(parameters, Iterable):
            raise TypeError(
                "ParametersDict.update should be called with an iterable of key/value pairs, but got "
                + type(parameters).__name__
            )
        for j, p in enumerate(parameters):
            if not isinstance(p, (tuple, list)) or len(p) != 2:
                raise ValueError(f"ParameterDict update sequence element #{j} should be a (key, value) pair")
            self[p[0]] = p[1]

    def extra_repr(self) -> str:
        return "\n".join(f"({k}): {_param_repr(v)}" for k, v in self.items())


class Identity(Module):
    """Returns its input."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, input: Any) -> Any:
        return input


# ---- linear --------------------------------------------------------------------------------


class Linear(Module):
    """``y = x @ weight.T + bias``.

    Args:
        in_features: Size of each input sample.
        out_features: Size of each output sample.
        bias: Learn an additive bias (default True).
        device: Device of the parameters (default ``"cpu"``).
        dtype: Parameter dtype (default: `asyncgrad.get_default_dtype()`, float32).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, device: Any = None, dtype: Any = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        _add_weight_bias(self, (out_features, in_features), (out_features,) if bias else None, dtype, device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's default initialisation."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class _Pool2d(Module):
    """What the 2-d pooling layers share: the window (``stride`` defaults to ``kernel_size``) and its repr."""

    def __init__(self, kernel_size: Any, stride: Any, padding: Any, ceil_mode: bool) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding = padding
        self.ceil_mode = ceil_mode

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxPool2d(_Pool2d):
    """2-D max pooling (``stride`` defaults to ``kernel_size``)."""

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
    ) -> None:
        super().__init__(kernel_size, stride, padding, ceil_mode)
        self.dilation = dilation
        self.return_indices = return_indices

    def forward(self, input: Tensor) -> Any:
        kw: dict[str, Any] = {}
        if self.dilation != 1:
            kw["dilation"] = self.dilation
        if self.ceil_mode:
            kw["ceil_mode"] = True
        if self.return_indices:
            kw["return_indices"] = True
        return F.max_pool2d(input, self.kernel_size, self.stride, self.padding, **kw)


class AvgPool2d(_Pool2d):
    """2-D average pooling (``stride`` defaults to ``kernel_size``)."""

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
    ) -> None:
        super().__init__(kernel_size, stride, padding, ceil_mode)
        self.count_include_pad = count_include_pad

    def forward(self, input: Tensor) -> Tensor:
        kw: dict[str, Any] = {}
        if self.ceil_mode:
            kw["ceil_mode"] = True
        if not self.count_include_pad:
            kw["count_include_pad"] = False
        return F.avg_pool2d(input, self.kernel_size, self.stride, self.padding, **kw)


# ---- activations -------------------------------------------------------------------------------


class _Activation(Module):
    """An elementwise activation ``fn(input, *hyper-parameters)``: each subclass names its function and the
    attributes passed to it (in order) and shown by ``repr`` (PyTorch's spelling, then ``inplace=True``)."""

    _fn: Callable[..., Tensor]
    _args: tuple[str, ...] = ()
    inplace = False  # accepted for compatibility: the result is always a new tensor

    def forward(self, input: Tensor) -> Tensor:
        return type(self)._fn(input, *(getattr(self, a) for a in self._args))

    def extra_repr(self) -> str:
        parts = [f"{a}={getattr(self, a)!r}" if isinstance(getattr(self, a), str) else f"{a}={getattr(self, a)}"
                 for a in self._args]
        if self.inplace:
            parts.append("inplace=True")
        return ", ".join(parts)


class ReLU(_Activation):
    """``max(x, 0)``."""

    _fn = staticmethod(F.relu)

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace


class Tanh(_Activation):
    """Hyperbolic tangent."""

    _fn = staticmethod(F.tanh)


class Sigmoid(_Activation):
    """Logistic sigmoid."""

    _fn = staticmethod(F.sigmoid)


class LeakyReLU(_Activation):
    """``x`` where ``x > 0``, else ``negative_slope * x``."""

    _fn = staticmethod(F.leaky_relu)
    _args = ("negative_slope",)

    def __init__(self, negative_slope: float = 1e-2, inplace: bool = False) -> None:
        super().__init__()
        self.negative_slope = negative_slope
        self.inplace = inplace


class SiLU(_Activation):
    """``x * sigmoid(x)``."""

    _fn = staticmethod(F.silu)

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace


class ELU(_Activation):
    """``x`` where ``x > 0``, else ``alpha * (exp(x) - 1)``."""

    _fn = staticmethod(F.elu)
    _args = ("alpha",)

    def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None:
        super().__init__()
        self.alpha = alpha
        self.inplace = inplace


class Softplus(_Activation):
    """``log(1 + exp(beta * x)) / beta`` (linear where ``beta * x > threshold``)."""

    _fn = staticmethod(F.softplus)
    _args = ("beta", "threshold")

    def __init__(self, beta: float = 1.0, threshold: float = 20.0) -> None:
        super().__init__()
        self.beta = beta
        self.threshold = threshold


class Hardtanh(_Activation):
    """``input`` clamped to ``[min_val, max_val]`` (gradient 1 strictly inside, 0 elsewhere)."""

    _fn = staticmethod(F.hardtanh)
    _args = ("min_val", "max_val")

    def __init__(
        self,
        min_val: float = -1.0,
        max_val: float = 1.0,
        inplace: bool = False,
        min_value: float | None = None,
        max_value: float | None = None,
    ) -> None:
        super().__init__()
        if min_value is not None:
            min_val = min_value  # torch's deprecated spelling
        if max_value is not None:
            max_val = max_value
        if max_val <= min_val:
            raise AssertionError("max_val must be larger than min_val")
        self.min_val = min_val
        self.max_val = max_val
        self.inplace = inplace


class ReLU6(Hardtanh):
    """``min(max(x, 0), 6)``."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__(0.0, 6.0, inplace)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class GELU(_Activation):
    """Gaussian Error Linear Unit: exact (``approximate="none"``, the default) or ``"tanh"``."""

    _fn = staticmethod(F.gelu)
    _args = ("approximate",)

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate


class _DimActivation(_Activation):
    _args = ("dim",)

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim


class Softmax(_DimActivation):
    """Softmax along ``dim``."""

    _fn = staticmethod(F.softmax)


class LogSoftmax(_DimActivation):
    """Log-softmax along ``dim``."""

    _fn = staticmethod(F.log_softmax)


# ---- regularisation, normalisation, lookup, reshaping ------------------------------------------


class Dropout(Module):
    """Zero elements with probability ``p`` in training and scale the rest by ``1/(1-p)``; identity in eval.

    Args:
        p: Probability of an element being zeroed.
        inplace: Accepted for compatibility (the result is always a new tensor).
        generator: A ``numpy.random.Generator`` this module draws its masks from (an asyncgrad extension;
            PyTorch has none). Default: the thread's default generator (see `asyncgrad.manual_seed`),
            which every training in the thread shares, so concurrent trainings draw from it in whatever
            order the scheduler runs them; give each training its own generator to make it reproducible.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, generator: Any = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.inplace = inplace
        self.generator = generator

    def forward(self, input: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return input
        return F.dropout(input, self.p, self.training, generator=self.generator)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class LayerNorm(Module):
    """Normalise over the trailing ``normalized_shape`` dims, then scale and shift.

    Args:
        normalized_shape: Int or shape of the trailing dims.
        eps: Added to the variance.
        elementwise_affine: Learn a per-element weight (init 1) and bias (init 0).
        bias: Learn the bias (when ``elementwise_affine``).
        device: Device of the parameters.
        dtype: Parameter dtype.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = (
            (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        )
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        shape = self.normalized_shape if elementwise_affine else None
        _add_weight_bias(self, shape, shape if bias else None, dtype, device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_norm_(self.weight, self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class _BatchNorm(Module):
    """Shared code of `BatchNorm1d` and `BatchNorm2d` (PyTorch's ``_BatchNorm``)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        shape = (num_features,) if affine else None
        _add_weight_bias(self, shape, shape if bias else None, dtype, device)
        dev = "cpu" if device is None else device
        if track_running_stats:
            dt = get_default_dtype() if dtype is None else np.dtype(dtype)
            self.register_buffer("running_mean", runtime.zeros(num_features, dtype=dt, device=dev))
            self.register_buffer("running_var", runtime.ones(num_features, dtype=dt, device=dev))
            self.register_buffer("num_batches_tracked", runtime.tensor(0, dtype=np.int64, device=dev))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        """Running mean 0, running variance 1, ``num_batches_tracked`` 0 (in stream order)."""
        if self.track_running_stats:
            with runtime.no_grad():
                self.running_mean.zero_()
                self.running_var.fill_(1)
                self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        _init_norm_(self.weight, self.bias)

    def _check_input_dim(self, input: Tensor) -> None:
        raise NotImplementedError

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor: Any = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            with runtime.no_grad():
                self.num_batches_tracked.add_(1)
                if self.momentum is None:  # cumulative moving average: 1 / batches seen (a lazy tensor)
                    factor = 1.0 / self.num_batches_tracked.to(dtype=np.float64)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        return F.batch_norm(
            input,
            self.running_mean if use_running else None,
            self.running_var if use_running else None,
            self.weight,
            self.bias,
            bn_training,
            factor,
            self.eps,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"bias={self.bias is not None}, track_running_stats={self.track_running_stats}"
        )


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of ``(N, C)`` or ``(N, C, L)`` inputs over the batch (and length) dims.

    Args:
        num_features: ``C``.
        eps: Added to the variance.
        momentum: Weight of the new batch statistic in the running estimates (``None``: a cumulative
            average, ``1 / num_batches_tracked``).
        affine: Learn a per-channel weight (init 1) and bias (init 0).
        track_running_stats: Keep ``running_mean`` / ``running_var`` / ``num_batches_tracked`` buffers
            (updated in training, used in eval); without them the batch statistics are always used.
        device: Device of the parameters and buffers.
        dtype: Their dtype.
        bias: Learn the bias (when ``affine``).
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.ndim not in (2, 3):
            raise ValueError(f"expected 2D or 3D input (got {input.ndim}D input)")


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of ``(N, C, H, W)`` inputs over the batch and spatial dims (see `BatchNorm1d`)."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.ndim != 4:
            raise ValueError(f"expected 4D input (got {input.ndim}D input)")


class Embedding(Module):
    """A lookup table of ``num_embeddings`` vectors of size ``embedding_dim`` (init N(0, 1)).

    Args:
        num_embeddings: Size of the table.
        embedding_dim: Size of each vector.
        padding_idx: Row that is initialised to zeros and receives no gradient.
        device: Device of the parameter.
        dtype: Parameter dtype.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError("padding_idx must be within num_embeddings")
            padding_idx %= num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.weight = _new_param((num_embeddings, embedding_dim), dtype, device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        vals = runtime.default_generator().normal(0.0, 1.0, size=self.weight.shape)
        if self.padding_idx is not None:
            vals[self.padding_idx] = 0
        with runtime.no_grad():
            self.weight.copy_(vals.astype(self.weight.dtype))

    def forward(self, input: Any) -> Tensor:
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s


class Flatten(Module):
    """Flatten dims ``start_dim`` .. ``end_dim`` into one (default: all but the batch dim)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim = start_dim
        self.end_dim = end_dim

    def forward(self, input: Tensor) -> Tensor:
        return ops.flatten(input, self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"
