"""Parameter initialisation, with PyTorch's names and formulas (``torch.nn.init``).

Every function fills its tensor in place (in stream order, keeping the tensor's memory layout) and
returns it. Random values come from ``generator`` or, by default, `asyncgrad.default_generator()`
(seed it with `asyncgrad.manual_seed`); samples are drawn in float64 and cast to the tensor's dtype.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime import Tensor, default_generator, no_grad

__all__ = [
    "calculate_gain",
    "constant_",
    "dirac_",
    "eye_",
    "kaiming_normal_",
    "kaiming_uniform_",
    "normal_",
    "ones_",
    "orthogonal_",
    "trunc_normal_",
    "uniform_",
    "xavier_normal_",
    "xavier_uniform_",
    "zeros_",
]


def _gen(generator: np.random.Generator | None) -> np.random.Generator:
    return generator if generator is not None else default_generator()


def _fill(tensor: Tensor, values: np.ndarray) -> Tensor:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"expected a Tensor, got {type(tensor).__name__}")
    with no_grad():  # initialising a parameter is not part of any graph (as in torch.nn.init)
        tensor.copy_(np.asarray(values, dtype=tensor.dtype))
    return tensor


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _erfinv(x: np.ndarray) -> np.ndarray:
    try:
        from scipy.special import erfinv

        return np.asarray(erfinv(x), dtype=np.float64)
    except ImportError:  # pragma: no cover - Newton's method on math.erf without scipy
        x = np.clip(x, -1 + 1e-12, 1 - 1e-12)
        y = np.sqrt(np.pi) / 2 * x
        for _ in range(60):
            y = y - (_erf(y) - x) / (2 / np.sqrt(np.pi) * np.exp(-y * y))
        return y


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for a nonlinearity (PyTorch's table).

    Args:
        nonlinearity: ``"linear"``, ``"conv2d"``, ``"sigmoid"``, ``"tanh"``, ``"relu"``, ``"leaky_relu"``,
            ``"selu"`` (and the other conv/transpose names, all gain 1).
        param: The negative slope for ``"leaky_relu"`` (default 0.01).
    """
    linear_fns = [
        "linear",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
    ]
    if nonlinearity in linear_fns or nonlinearity == "sigmoid":
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        elif not isinstance(param, bool) and isinstance(param, (int, float)):
            slope = float(param)
        else:
            raise ValueError(f"negative_slope {param} not a valid number")
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"Unsupported nonlinearity {nonlinearity}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    if tensor.ndim < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than 2 dimensions")
    num_input_fmaps = tensor.shape[1]
    num_output_fmaps = tensor.shape[0]
    receptive = 1
    for s in tensor.shape[2:]:
        receptive *= s
    return num_input_fmaps * receptive, num_output_fmaps * receptive


def _calculate_correct_fan(tensor: Tensor, mode: str) -> int:
    mode = mode.lower()
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def uniform_(
    tensor: Tensor, a: float = 0.0, b: float = 1.0, generator: np.random.Generator | None = None
) -> Tensor:
    """Fill with samples from U(a, b)."""
    return _fill(tensor, _gen(generator).uniform(a, b, size=tensor.shape))


def normal_(
    tensor: Tensor, mean: float = 0.0, std: float = 1.0, generator: np.random.Generator | None = None
) -> Tensor:
    """Fill with samples from N(mean, std^2)."""
    return _fill(tensor, _gen(generator).normal(mean, std, size=tensor.shape))


def trunc_normal_(
    tensor: Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    generator: np.random.Generator | None = None,
) -> Tensor:
    """Fill with N(mean, std^2) samples truncated to [a, b] (inverse-CDF method, like PyTorch)."""

    def norm_cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    lo, hi = norm_cdf((a - mean) / std), norm_cdf((b - mean) / std)
    u = _gen(generator).uniform(2 * lo - 1, 2 * hi - 1, size=tensor.shape)
    y = _erfinv(u)
    vals = np.clip(y * std * math.sqrt(2.0) + mean, a, b)
    return _fill(tensor, vals)


def constant_(tensor: Tensor, val: float) -> Tensor:
    """Fill with ``val``."""
    with no_grad():
        return tensor.fill_(val)


def ones_(tensor: Tensor) -> Tensor:
    """Fill with ones."""
    with no_grad():
        return tensor.fill_(1.0)


def zeros_(tensor: Tensor) -> Tensor:
    """Fill with zeros."""
    with no_grad():
        return tensor.zero_()


def eye_(tensor: Tensor) -> Tensor:
    """Fill a 2-D tensor with the identity matrix."""
    if tensor.ndim != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    return _fill(tensor, np.eye(tensor.shape[0], tensor.shape[1]))


def dirac_(tensor: Tensor, groups: int = 1) -> Tensor:
    """Fill a {3,4,5}-D tensor with the Dirac delta (identity convolution), per group."""
    if tensor.ndim not in (3, 4, 5):
        raise ValueError("Only tensors with 3, 4, or 5 dimensions are supported")
    sizes = tensor.shape
    if sizes[0] % groups != 0:
        raise ValueError("dim 0 must be divisible by groups")
    out_per = sizes[0] // groups
    min_dim = min(out_per, sizes[1])
    vals = np.zeros(sizes)
    for g in range(groups):
        for d in range(min_dim):
            idx = (g * out_per + d, d, *(s // 2 for s in sizes[2:]))
            vals[idx] = 1
    return _fill(tensor, vals)


def xavier_uniform_(
    tensor: Tensor, gain: float = 1.0, generator: np.random.Generator | None = None
) -> Tensor:
    """Glorot uniform: U(-a, a) with ``a = gain * sqrt(6 / (fan_in + fan_out))``."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
    a = math.sqrt(3.0) * std
    return uniform_(tensor, -a, a, generator)


def xavier_normal_(tensor: Tensor, gain: float = 1.0, generator: np.random.Generator | None = None) -> Tensor:
    """Glorot normal: N(0, std^2) with ``std = gain * sqrt(2 / (fan_in + fan_out))``."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return normal_(tensor, 0.0, std, generator)


def _kaiming_std(tensor: Tensor, a: float, mode: str, nonlinearity: str) -> float:
    """He's ``std = gain / sqrt(fan)``."""
    fan = _calculate_correct_fan(tensor, mode)
    return calculate_gain(nonlinearity, a) / math.sqrt(fan)


def kaiming_uniform_(
    tensor: Tensor,
    a: float = 0.0,
    mode: str = "fan_in",
    nonlinearity: str = "leaky_relu",
    generator: np.random.Generator | None = None,
) -> Tensor:
    """He uniform: U(-bound, bound) with ``bound = gain * sqrt(3 / fan)``.

    With ``a=sqrt(5)`` (what `Linear` and `Conv2d` use) the bound is ``1 / sqrt(fan_in)``.
    """
    if 0 in tensor.shape:
        return tensor
    bound = math.sqrt(3.0) * _kaiming_std(tensor, a, mode, nonlinearity)
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(
    tensor: Tensor,
    a: float = 0.0,
    mode: str = "fan_in",
    nonlinearity: str = "leaky_relu",
    generator: np.random.Generator | None = None,
) -> Tensor:
    """He normal: N(0, std^2) with ``std = gain / sqrt(fan)``."""
    if 0 in tensor.shape:
        return tensor
    return normal_(tensor, 0.0, _kaiming_std(tensor, a, mode, nonlinearity), generator)


def orthogonal_(tensor: Tensor, gain: float = 1.0, generator: np.random.Generator | None = None) -> Tensor:
    """A (semi-)orthogonal matrix from the QR decomposition of a normal matrix, times ``gain``."""
    if tensor.ndim < 2:
        raise ValueError("Only tensors with 2 or more dimensions are supported")
    rows = tensor.shape[0]
    cols = tensor.numel() // rows
    flat = _gen(generator).normal(0.0, 1.0, size=(rows, cols))
    if rows < cols:
        flat = flat.T
    q, r = np.linalg.qr(flat)
    q = q * np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    return _fill(tensor, gain * q.reshape(tensor.shape))
