"""Flatten parameters into one vector and back (``torch.nn.utils.parameters_to_vector`` and
``vector_to_parameters``)."""

from __future__ import annotations

from collections.abc import Iterable

from ...ops import concat
from ...runtime import Tensor, no_grad

__all__ = ["parameters_to_vector", "vector_to_parameters"]


def _check_device(param: Tensor, device: object) -> object:
    if device is not None and param.device is not device:
        raise TypeError("Found two parameters on different devices, this is currently not supported.")
    return param.device


def parameters_to_vector(parameters: Iterable[Tensor]) -> Tensor:
    """One 1-D tensor of all ``parameters`` (each flattened in row-major index order), concatenated.

    Differentiable with respect to the parameters, as in PyTorch. (PyTorch's ``view(-1)`` fails on a
    non-contiguous parameter; here any layout works.)
    """
    device: object = None
    parts = []
    for p in parameters:
        device = _check_device(p, device)
        parts.append(p.reshape(-1))
    return concat(parts)


def vector_to_parameters(vec: Tensor, parameters: Iterable[Tensor]) -> None:
    """Copy consecutive slices of the 1-D ``vec`` into ``parameters``, in stream order.

    Unlike PyTorch (which makes each ``param.data`` a view of ``vec``), the values are copied into each
    parameter's own memory: parameters keep their layout and do not alias ``vec`` afterwards.
    """
    if not isinstance(vec, Tensor):
        raise TypeError(f"expected Tensor, but got: {type(vec).__name__}")
    device: object = None
    pointer = 0
    params = list(parameters)
    total = sum(p.numel() for p in params)
    if vec.ndim != 1 or vec.shape[0] < total:
        raise RuntimeError(f"vector_to_parameters: vec has shape {vec.shape}, the parameters need {total} elements")
    with no_grad():
        for p in params:
            device = _check_device(p, device)
            n = p.numel()
            p.copy_(vec.detach()[pointer : pointer + n].reshape(p.shape).to(p.dtype))
            pointer += n
