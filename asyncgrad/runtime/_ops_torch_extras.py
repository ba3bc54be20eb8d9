"""Small PyTorch ops programs use (issue 20, part 2): ``unfold`` with its backward (and double backward),
``addcmul``/``addcdiv`` and their in-place forms, ``multinomial``, and the comparison functions as
methods (``t.eq(o)``, ``t.lt(o)``, ...) with PyTorch's aliases (``greater``, ``less_equal``, ...).

One module so that the core re-organisation can move it as a unit; the Tensor methods are bound at the
end, in one marked block.
"""

from __future__ import annotations

import builtins
from typing import Any

import numpy as np

from . import _inplace
from ._dispatch import OpError, apply, defop, norm_dim
from ._factories import default_generator
from ._ops_elementwise import eq, ge, gt, le, lt, ne
from ._tensor import Tensor

__all__ = [
    "addcdiv",
    "addcmul",
    "eq",
    "ge",
    "greater",
    "greater_equal",
    "gt",
    "le",
    "less",
    "less_equal",
    "lt",
    "multinomial",
    "ne",
    "not_equal",
    "unfold",
]

greater, greater_equal, less, less_equal, not_equal = gt, ge, lt, le, ne


# ---- unfold: windows of `size` every `step` along `dim`, as a new last dimension --------------------------


def _windows(n: int, size: int, step: int) -> int:
    return (n - size) // step + 1


def _unfold_meta(a: Tensor, dim: int, size: int, step: int) -> tuple[tuple[int, ...], np.dtype[Any]]:
    shape = list(a.shape) or [1]
    shape[dim] = _windows(shape[dim], size, step)
    return (*shape, size) if a.shape else (size,), a.dtype


def _unfold_kernel(a: np.ndarray, dim: int, size: int, step: int) -> np.ndarray:
    if a.ndim == 0:
        return a.reshape(1)[:size].copy()
    v = np.lib.stride_tricks.sliding_window_view(a, size, axis=dim)
    sl = [slice(None)] * a.ndim
    sl[dim] = slice(None, None, step)
    return np.ascontiguousarray(v[tuple(sl)])


def _fold_kernel(g: np.ndarray, in_shape: tuple[int, ...], dim: int, size: int, step: int) -> np.ndarray:
    # the adjoint of unfold: overlap-add the windows back (for a fixed offset k the rows hit are distinct,
    # so a strided slice-add is exact; no np.add.at needed)
    z = np.zeros(in_shape, dtype=g.dtype)
    if not in_shape:
        return g.reshape(()).copy() if size else z
    n = g.shape[dim]
    for k in range(size):
        sl = [slice(None)] * len(in_shape)
        sl[dim] = slice(k, k + step * (n - 1) + 1, step)
        z[tuple(sl)] += g[..., k]
    return z


def _unfold_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    in_shape = tuple(args[0].shape)
    if isinstance(g, Tensor):  # create_graph: the adjoint as an op of its own, itself differentiable
        return (apply(OP_UNFOLD_BACKWARD, (g,), {"in_shape": in_shape, **kw}),)
    return (_fold_kernel(g, in_shape, **kw),)


def _fold_meta(g: Tensor, in_shape: tuple[int, ...], dim: int, size: int, step: int) -> Any:
    return in_shape, g.dtype


def _fold_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    k = {"dim": kw["dim"], "size": kw["size"], "step": kw["step"]}
    if isinstance(g, Tensor):
        return (apply(OP_UNFOLD, (g,), k),)
    return (_unfold_kernel(g, **k),)


OP_UNFOLD = defop("unfold", _unfold_kernel, _unfold_meta, _unfold_rule, saves=())
OP_UNFOLD_BACKWARD = defop("unfold_backward", _fold_kernel, _fold_meta, _fold_rule, saves=())


def unfold(input: Tensor, dimension: int, size: int, step: int) -> Tensor:
    """All windows of ``size`` elements, every ``step``, along ``dimension``, in a new last dimension
    (PyTorch's ``Tensor.unfold``; a copy here, not a view). Differentiable (twice).

    Raises:
        OpError: If ``size`` exceeds the dimension, or ``step`` is not positive.
    """
    d = norm_dim("unfold", input, dimension)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise OpError(f"unfold: size must be a non-negative int, got {size!r}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step <= 0:
        raise OpError(f"unfold: step is {step} but must be > 0")
    n = input.shape[d] if input.shape else 1
    if size > n:
        raise OpError(
            f"unfold: maximum size for tensor at dimension {d} is {n} but size is {size} (shape {tuple(input.shape)})"
        )
    return apply(OP_UNFOLD, (input,), {"dim": d, "size": int(size), "step": int(step)})  # type: ignore[no-any-return]


# ---- addcmul / addcdiv --------------------------------------------------------------------------------------


def _check_int_div(op: str, *xs: Any) -> None:
    kinds = [(x.dtype.kind if isinstance(x, (Tensor, np.ndarray)) else np.asarray(x).dtype.kind) for x in xs]
    if builtins.all(k in "biu" for k in kinds):
        raise RuntimeError(
            f"{op}: integer division with addcdiv is no longer supported, and in a future release addcdiv will "
            "perform a true division of tensor1 and tensor2. Use a floating point tensor1 or tensor2"
        )


def addcmul(input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Tensor:
    """``input + value * tensor1 * tensor2`` (broadcasting; differentiable in all three)."""
    return input + value * (tensor1 * tensor2)  # type: ignore[no-any-return]


def addcdiv(input: Any, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Tensor:
    """``input + value * tensor1 / tensor2`` (broadcasting; differentiable in all three)."""
    _check_int_div("addcdiv", tensor1, tensor2)
    return input + value * (tensor1 / tensor2)  # type: ignore[no-any-return]


def _addcmul_(self: Tensor, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Tensor:
    self._check_inplace("addcmul_", tensor1, tensor2)
    return _inplace.inplace(
        self, lambda a, t1, t2: np.add(a, value * (t1 * t2), out=a, casting="unsafe"), tensor1, tensor2
    )


def _addcdiv_(self: Tensor, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Tensor:
    self._check_inplace("addcdiv_", tensor1, tensor2)
    _check_int_div("addcdiv_", tensor1, tensor2)
    return _inplace.inplace(
        self, lambda a, t1, t2: np.add(a, value * (t1 / t2), out=a, casting="unsafe"), tensor1, tensor2
    )


# ---- multinomial --------------------------------------------------------------------------------------------


def multinomial(
    input: Tensor, num_samples: int, replacement: bool = False, *, generator: np.random.Generator | None = None
) -> Tensor:
    """Indices drawn from the categories of each row of ``input`` (non-negative weights, not necessarily
    normalised), as PyTorch's: int64, shape ``(num_samples,)`` or ``(rows, num_samples)``; without
    replacement every index appears at most once per row. Drawn now from ``generator`` (default: the
    thread's generator), after ``input``'s value is computed.

    Raises:
        RuntimeError: For a bad shape, negative / inf / nan weights, a row summing to 0, or more samples
            than categories with non-zero weight without replacement.
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"multinomial() expects a Tensor, got {type(input).__name__}")
    if input.ndim not in (1, 2):
        raise RuntimeError(f"multinomial: prob_dist must be 1 or 2 dim, got shape {tuple(input.shape)}")
    if input.dtype.kind != "f":
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: {input.dtype}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples <= 0:
        raise RuntimeError(f"multinomial: cannot sample n_sample <= 0 samples (got {num_samples!r})")
    n = input.shape[-1]
    if not replacement and num_samples > n:
        raise RuntimeError(
            f"multinomial: cannot sample n_sample > prob_dist.size(-1) samples without replacement "
            f"({num_samples} > {n})"
        )
    if n > 1 << 24:
        raise RuntimeError("multinomial: number of categories cannot exceed 2^24")
    p = np.asarray(input, dtype=np.float64)
    rows = p.reshape(-1, n)
    if not np.isfinite(rows).all() or (rows < 0).any():
        raise RuntimeError("multinomial: probability tensor contains either `inf`, `nan` or element < 0")
    sums = rows.sum(axis=1)
    if (sums <= 0).any():
        raise RuntimeError("multinomial: invalid multinomial distribution (sum of probabilities <= 0)")
    if not replacement and ((rows > 0).sum(axis=1) < num_samples).any():
        raise RuntimeError(
            "multinomial: invalid multinomial distribution (with replacement=False, not enough non-negative "
            "category to sample)"
        )
    g = generator or default_generator()
    out = np.empty((rows.shape[0], int(num_samples)), dtype=np.int64)
    for i, (r, s) in enumerate(zip(rows, sums)):
        out[i] = g.choice(n, size=int(num_samples), replace=bool(replacement), p=r / s)
    res: np.ndarray = out.reshape(int(num_samples)) if input.ndim == 1 else out
    return Tensor._wrap(res, input._dev)


# ==== Tensor methods of this module (one block: moves to _tensor_methods.py as a unit) ======================
Tensor.unfold = unfold  # type: ignore[attr-defined]
Tensor.addcmul = addcmul  # type: ignore[attr-defined]
Tensor.addcdiv = addcdiv  # type: ignore[attr-defined]
Tensor.addcmul_ = _addcmul_  # type: ignore[attr-defined]
Tensor.addcdiv_ = _addcdiv_  # type: ignore[attr-defined]
Tensor.multinomial = multinomial  # type: ignore[attr-defined]
for _name, _f in (("eq", eq), ("ne", ne), ("lt", lt), ("le", le), ("gt", gt), ("ge", ge), ("greater", gt),
                  ("greater_equal", ge), ("less", lt), ("less_equal", le), ("not_equal", ne)):
    setattr(Tensor, _name, _f)
del _name, _f
