"""The two array namespaces a backward rule runs against, filled by the op families.

`NP` maps each name to a numpy function (plain backward: the rule runs as one kernel on a lane). `AG`
maps the same names onto differentiable asyncgrad ops (``create_graph=True``: the rule's own ops are
recorded). Rules may use operators (+ - * / ** @, comparisons, indexing) and only the names registered
here by each op family, next to its ops, with
`register_xp` (as jax's ``lax`` registers into ``ad``'s tables): this module knows no op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._tensor import Tensor


class NP:
    """numpy namespace for rules."""

    @staticmethod
    def value(x: Any) -> Any:
        """A side input's numpy value (integer targets, indices)."""
        return x

    @staticmethod
    def const(arr: Any, like: Any) -> Any:
        """A constant array, as an operand of ``like``'s kind."""
        return arr


class AG:
    """asyncgrad namespace for rules (filled by the op families, see `register_xp`)."""

    @staticmethod
    def value(x: Any) -> Any:
        return x.numpy() if isinstance(x, Tensor) else x

    @staticmethod
    def const(arr: Any, like: Any) -> Any:
        return Tensor._wrap(np.asarray(arr), like._dev) if isinstance(like, Tensor) else arr


def register_xp(name: str, np_fn: Callable[..., Any], ag_fn: Callable[..., Any]) -> None:
    """Make ``xp.name`` available to backward rules: ``np_fn`` on arrays, ``ag_fn`` on Tensors."""
    if hasattr(NP, name) or hasattr(AG, name):
        raise ValueError(f"rule namespace name {name!r} is already registered")
    setattr(NP, name, staticmethod(np_fn))
    setattr(AG, name, staticmethod(ag_fn))


def sum_to(xp: Any, g: Any, shape: tuple[int, ...]) -> Any:

    """Reduce a broadcast gradient back to ``shape`` (the engine applies this to every rule output)."""
    gshape = g.shape
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    if lead < 0:
        raise ValueError(f"gradient of shape {tuple(gshape)} cannot be reduced to shape {shape}")
    inner = tuple(i + lead for i, s in enumerate(shape) if s == 1 and gshape[i + lead] != 1)
    if not inner:
        # only leading dims to drop (a bias's gradient): one reduction, no reshape
        g = xp.sum(g, tuple(range(lead)), False)
    else:
        g = xp.sum(g, tuple(range(lead)) + inner, True)
        if lead:
            g = xp.reshape(g, shape)
    if tuple(g.shape) != tuple(shape):
        raise ValueError(f"gradient of shape {tuple(gshape)} cannot be reduced to shape {shape}")
    return g
