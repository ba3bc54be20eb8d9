"""Scaled dot-product attention as one fused op (PyTorch's ``F.scaled_dot_product_attention``).

The forward kernel computes ``softmax(q @ k^T * scale + mask) @ v`` in one go; the backward kernel
recomputes the attention weights from ``q``, ``k`` and the mask (one product and a softmax: cheaper in
memory than keeping ``(..., L, S)`` weights alive between the passes) and gives ``dq``, ``dk``, ``dv`` and the
float mask's gradient. Under ``create_graph=True`` the same backward runs as recorded ops, so second
derivatives work (a gradient penalty through attention). A row whose keys are all masked gives zeros
(PyTorch's safe softmax), not NaN. Dropout on the weights draws its mask from a seed taken at call time,
so the backward regenerates the same mask.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..kernels._softmax import above_diagonal, softmax_backward_lastdim_, softmax_lastdim_
from ..runtime._dispatch import apply
from ..runtime._factories import default_generator, full, tensor, zeros
from ..runtime._op import OpError, defop
from ..runtime._tensor import Tensor
from ._elementwise import exp, where
from ._linalg import matmul
from ._math import isfinite
from ._reduce import amax

__all__ = ["scaled_dot_product_attention"]


def _weights(q: np.ndarray, k: np.ndarray, mask: np.ndarray | None, kw: dict[str, Any]) -> tuple[Any, Any]:
    """The attention weights after softmax (and, second, after dropout).

    One (..., L, S) buffer: the scores are scaled, masked, shifted, exponentiated and normalised in place.
    """
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    scale = kw["scale"]
    if mask is not None:
        s *= scale
        scale = 1.0
        if np.broadcast_shapes(mask.shape, s.shape) == s.shape and np.can_cast(mask.dtype, s.dtype, "same_kind"):
            s += mask
        else:
            s = s + mask
    if s.dtype in _SOFTMAX_DTYPES and s.flags.c_contiguous:
        # a row whose keys are all masked gets weights 0 (PyTorch's safe softmax), not 0 / 0
        p = softmax_lastdim_(s, scale, kw["causal"], zero_dead=mask is not None)
    else:
        p = _weights_general(s, scale, mask is not None, kw["causal"])
    pd = p
    if kw["p"] > 0:
        pd = p * _keep(p.shape, kw)
    return p, pd


_SOFTMAX_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _weights_general(s: np.ndarray, scale: float, masked: bool, causal: bool) -> np.ndarray:
    """The softmax of scores of another dtype or layout (a broadcast float mask of a wider dtype)."""
    if scale != 1.0:
        s *= scale
    if causal:
        np.copyto(s, -np.inf, where=above_diagonal(*s.shape[-2:]))
    m = np.max(s, axis=-1, keepdims=True)
    if masked or not np.isfinite(m).all():
        m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    tot = np.sum(e, axis=-1, keepdims=True)
    if masked:
        tot = np.where(tot == 0, 1.0, tot)
    return e / tot  # type: ignore[no-any-return]


def _keep(shape: tuple[int, ...], kw: dict[str, Any]) -> np.ndarray:
    """The dropout mask, already scaled by 1 / (1 - p): a pure function of the call's seed."""
    drop = kw["p"]
    keep = np.random.default_rng(kw["seed"]).random(shape) >= drop
    return keep / (1.0 - drop)  # type: ignore[no-any-return]


def _sdpa_kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, **kw: Any) -> np.ndarray:
    _, pd = _weights(q, k, mask, kw)
    return np.matmul(pd, v)  # type: ignore[no-any-return]


def _sum_like(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reduce a broadcast batch gradient to ``shape`` (the leading batch dims of an operand)."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and g.shape[i + lead] != 1)
    return np.sum(g, axis=axes, keepdims=True).reshape(shape)


def _sdpa_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    if not isinstance(g, np.ndarray):
        return _sdpa_rule_recorded(g, args, kw, needs)
    q, k, v, mask = args
    p, pd = _weights(q, k, mask, kw)
    dv = np.matmul(np.swapaxes(pd, -1, -2), g) if needs[2] else None
    dp = np.matmul(g, np.swapaxes(v, -1, -2))
    if kw["p"] > 0:
        dp *= _keep(p.shape, kw)
    # softmax backward, in place in dp: ds = p * (dp - sum(dp * p)); masked entries stay 0
    if dp.dtype == p.dtype and dp.dtype in _SOFTMAX_DTYPES and p.flags.c_contiguous and dp.flags.c_contiguous:
        softmax_backward_lastdim_(dp, p)
    else:
        dp -= np.sum(dp * p, axis=-1, keepdims=True)
        dp *= p
    ds = dp
    scale = kw["scale"]
    dq = dk = None
    if needs[0]:
        dq = np.matmul(ds, k)
        dq *= scale
    if needs[1]:
        dk = np.matmul(np.swapaxes(ds, -1, -2), q)
        dk *= scale
    dmask = ds if needs[3] else None
    # operands broadcast over batch dims: each gradient back to its own operand's shape
    return (
        None if dq is None else _sum_like(dq, q.shape),
        None if dk is None else _sum_like(dk, k.shape),
        None if dv is None else _sum_like(dv, v.shape),
        dmask,
    )


def _sdpa_rule_recorded(g: Tensor, args: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    """The same backward written with recorded ops (``create_graph=True``), so it can be differentiated again."""
    q, k, v, mask = args
    scale = kw["scale"]
    s = matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    ll, ss = s.shape[-2:]
    neg = full((), -np.inf, dtype=s.dtype, device=s.device)
    if kw["causal"]:
        s = where(tensor(np.tril(np.ones((ll, ss), bool)), device=s.device), s, neg)
    # a safe softmax without reading values (no wait on the loop): the shift is a constant (detached), and a
    # row whose keys are all masked sums to 0, so it is divided by 1 and stays zeros
    m = amax(s, -1, True).detach()
    zero = full((), 0.0, dtype=s.dtype, device=s.device)
    e = exp(s - where(isfinite(m), m, zero))
    tot = e.sum(-1, keepdim=True)
    p = e / where(tot == 0, zero + 1.0, tot)
    pd = p
    if kw["p"] > 0:
        keep = tensor(_keep(tuple(p.shape), kw).astype(p.dtype), device=p.device)
        pd = p * keep
    dv = matmul(pd.transpose(-1, -2), g) if needs[2] else None
    dp = matmul(g, v.transpose(-1, -2))
    if kw["p"] > 0:
        dp = dp * keep
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = matmul(ds, k) * scale if needs[0] else None
    dk = matmul(ds.transpose(-1, -2), q) * scale if needs[1] else None
    return dq, dk, dv, ds if needs[3] else None


def _sdpa_meta(q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    name = "scaled_dot_product_attention"
    shapes = f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}"
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise OpError(f"{name}: expected query, key and value of at least 2 dims (..., L, E), got {shapes}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise OpError(
            f"{name}: expected query (..., L, E), key (..., S, E) and value (..., S, Ev), got {shapes}"
        )
    try:
        batch = np.broadcast_shapes(tuple(q.shape[:-2]), tuple(k.shape[:-2]), tuple(v.shape[:-2]))
    except ValueError:
        raise OpError(f"{name}: the batch dims of {shapes} do not broadcast") from None
    scores = (*batch, q.shape[-2], k.shape[-2])
    if mask is not None:
        try:
            full = np.broadcast_shapes(tuple(mask.shape), scores)
        except ValueError:
            full = None
        if full != scores:
            raise OpError(
                f"{name}: attn_mask of shape {tuple(mask.shape)} does not broadcast to the attention weights' "
                f"shape {scores} ({shapes})"
            )
    dts = {str(t.dtype) for t in (q, k, v, mask) if t is not None}
    if len(dts) != 1 or q.dtype.kind != "f":
        raise OpError(
            f"{name}: expected query, key, value (and a float attn_mask) of one floating point dtype, got "
            f"{sorted(dts)}; convert them with .to(dtype)"
        )
    return (*batch, q.shape[-2], v.shape[-1]), q.dtype


OP_SDPA = defop("scaled_dot_product_attention", _sdpa_kernel, _sdpa_meta, _sdpa_rule)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``softmax(query @ key^T * scale + mask) @ value``, as ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.
        value: ``(..., S, Ev)``.
        attn_mask: Broadcastable to ``(..., L, S)``: a bool mask (True: the key takes part) or a float mask
            added to the scores.
        dropout_p: Dropout probability on the attention weights (applied whenever > 0, as in PyTorch).
        is_causal: Mask out keys after each query (a lower-triangular ``(L, S)`` mask); not with ``attn_mask``.
        scale: Score scale (default ``1 / sqrt(E)``).
        enable_gqa: Grouped-query attention: the heads (dim -3) of key and value are repeated to query's.

    Returns:
        ``(..., L, Ev)``.
    """
    name = "scaled_dot_product_attention"
    for what, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {what} must be a Tensor, got {type(t).__name__}")
    if is_causal and attn_mask is not None:
        raise OpError(f"{name}: explicit attn_mask should not be set when is_causal=True")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{name}: dropout_p must be in [0, 1], got {dropout_p}")
    if enable_gqa and query.ndim >= 3 and key.ndim >= 3:
        hq, hk = query.shape[-3], key.shape[-3]
        if hq % hk:
            raise OpError(f"{name}: enable_gqa needs query heads ({hq}) to be a multiple of key heads ({hk})")
        if hq != hk:
            key = key.repeat_interleave(hq // hk, dim=-3)
            value = value.repeat_interleave(hq // hk, dim=-3)
    mask: Any = attn_mask
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"{name}: attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype == np.bool_:
            # True takes part: 0 there, -inf elsewhere (a constant: bool masks have no gradient)
            mask = _bool_mask(attn_mask, query.dtype)
    sc = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    seed = int(default_generator().integers(0, 2**63 - 1)) if dropout_p > 0 else 0
    kw = {"scale": sc, "causal": bool(is_causal), "p": float(dropout_p), "seed": seed}
    return apply(OP_SDPA, (query, key, value, mask), kw)  # type: ignore[no-any-return]


def _bool_mask(mask: Tensor, dtype: Any) -> Tensor:
    """A bool mask (True: attend) as the float mask added to the scores: 0 where True, -inf where False."""
    z = zeros((), dtype=dtype, device=mask.device)
    return where(mask, z, z - np.inf)  # type: ignore[no-any-return]
