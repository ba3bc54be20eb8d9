"""Random sampling: multinomial (PyTorch's semantics, drawn from a numpy generator)."""

from __future__ import annotations

import numpy as np

from ..runtime._factories import default_generator
from ..runtime._tensor import Tensor


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
