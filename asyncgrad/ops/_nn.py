"""Neural-network ops of the core: softmax and log_softmax (numerically stable)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..kernels import (
    JIT,
    embedding_scatter_add_,
    gelu32,
    gelu32_backward,
    layer_norm_backward,
    layer_norm_forward,
    softmax_backward_lastdim_,
    softmax_lastdim_,
)
from ..kernels._rows import row_max, row_sum
from ..runtime._dispatch import apply
from ..runtime._factories import default_generator
from ..runtime._inplace import inplace
from ..runtime._meta import _float_check, _index_arg, _value, broadcast_shapes
from ..runtime._op import OpError, defop
from ..runtime._row_support import note_rows, untouched_zeros
from ..runtime._tensor import Tensor
from ..runtime._xp import NP, register_xp
from ._index import index_add
from ._math import _erf

# the dtypes of the row kernels (`kernels.layer_norm_forward`, `kernels.softmax_lastdim_`)
_LN_BLAS = (np.dtype(np.float32), np.dtype(np.float64))


def _softmax_kernel(a: np.ndarray, axis: int) -> np.ndarray:
    last = axis in (-1, a.ndim - 1)
    if last and a.dtype in _LN_BLAS and a.ndim:
        return softmax_lastdim_(np.array(a, order="C"), zero_dead=False)  # type: ignore[no-any-return]
    z = a - (row_max(a) if last else np.max(a, axis=axis, keepdims=True))
    e = np.exp(z, out=z)
    e /= row_sum(e) if last else np.sum(e, axis=axis, keepdims=True)
    return e


def _log_softmax_kernel(a: np.ndarray, axis: int) -> np.ndarray:
    last = axis in (-1, a.ndim - 1)
    z = a - (row_max(a) if last else np.max(a, axis=axis, keepdims=True))
    e = np.exp(z)
    z -= np.log(row_sum(e) if last else np.sum(e, axis=axis, keepdims=True))
    return z


def _softmax_meta(a: Tensor, axis: int) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if a._dtype.kind not in "fc":
        raise OpError(f"softmax: input dtype {a._dtype} is not floating point")
    return a._shape, a._dtype


def _softmax_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    ax = kw["axis"]
    if (
        xp is NP and ax in (-1, out.ndim - 1) and out.ndim and out.dtype in _LN_BLAS and g.dtype == out.dtype
        and g.shape == out.shape
    ):
        return (softmax_backward_lastdim_(np.array(g, order="C"), np.ascontiguousarray(out)),)
    return (out * (g - xp.sum(g * out, ax, True)),)


def _log_softmax_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    ax = kw["axis"]
    return (g - xp.exp(out) * xp.sum(g, ax, True),)


OP_SOFTMAX = defop("softmax", _softmax_kernel, _softmax_meta, _softmax_rule, save_out=True)
OP_LOG_SOFTMAX = defop("log_softmax", _log_softmax_kernel, _softmax_meta, _log_softmax_rule, save_out=True)


def _axis(op: str, x: Tensor, dim: int) -> int:
    n = max(x.ndim, 1)
    if not -n <= dim < n:
        raise OpError(f"{op}: dim {dim} is out of range for shape {x._shape}")
    return dim % n


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """exp(x) normalised along ``dim``."""
    return apply(OP_SOFTMAX, (x,), {"axis": _axis("softmax", x, dim)})


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """log(softmax(x)) along ``dim``, computed stably."""
    return apply(OP_LOG_SOFTMAX, (x,), {"axis": _axis("log_softmax", x, dim)})


def _emb_meta(w: Tensor, idx: Any, padding_idx: Any, scale_grad_by_freq: bool) -> Any:
    if w.ndim != 2:
        raise OpError(f"embedding: weight must be 2-d (num_embeddings, embedding_dim), got shape {w.shape}")
    return (*idx.shape, w.shape[1]), w.dtype


def _emb_kernel(w: np.ndarray, idx: np.ndarray, padding_idx: Any, scale_grad_by_freq: bool) -> np.ndarray:
    n = w.shape[0]
    if idx.size and (idx.min() < 0 or idx.max() >= n):  # no negative indices either, as in PyTorch
        raise IndexError(
            f"embedding: index out of range in self: indices must be in [0, {n}), got "
            f"min {idx.min()} and max {idx.max()}"
        )
    return np.take(w, idx, axis=0)


def _emb_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    w, idx = args
    iv = xp.value(idx) % w.shape[0]
    scale = None
    if kw["scale_grad_by_freq"]:
        counts = np.bincount(iv.ravel(), minlength=w.shape[0])
        scale = 1.0 / counts[iv]
    if kw["padding_idx"] is not None:
        keep = (iv != kw["padding_idx"]).astype(np.float64)
        scale = keep if scale is None else scale * keep
    if scale is not None:
        g = g * scale.astype(g.dtype)[..., None]
    return (xp.embedding_backward(tuple(w.shape), iv, g), None)


_ONE_HOT_MAX = 1 << 16  # table rows x ids up to which the backward is a one-hot GEMM


def _emb_backward_np(shape: tuple[int, ...], iv: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The dense gradient of the table: zeros with each id's rows of ``g`` summed into its row.

    Sorting the ids and summing each run (`np.add.reduceat`) replaces `np.add.at`'s element loop; the
    zeros are untouched memory (no memset of the whole table), and the rows written are noted so an
    optimizer may step those rows only (`runtime.note_rows`).
    """
    z = untouched_zeros(shape, g.dtype)
    flat = iv.reshape(-1)
    if flat.size == 0:
        note_rows(z, flat.astype(np.intp))
        return z
    g2 = g.reshape(flat.size, shape[1])
    if JIT and z.flags.c_contiguous:
        # one pass adding each id's row in batch order (bit for bit np.add.at), noting the rows it wrote
        note_rows(z, embedding_scatter_add_(z, flat, g2))
        return z
    if shape[0] * flat.size <= _ONE_HOT_MAX and g2.dtype.kind == "f":
        # a small table (a char GPT's 65 tokens, its positions): one-hot (rows, ids) @ g as one GEMM costs
        # less than the sort and the reduceat (44 -> 18 us for 256 ids into 65 rows)
        hot = np.zeros((shape[0], flat.size), g2.dtype)
        hot[flat, np.arange(flat.size)] = 1
        z = np.matmul(hot, g2)
        note_rows(z, np.flatnonzero(np.bincount(flat, minlength=shape[0])))
        return z
    order = np.argsort(flat, kind="stable")  # stable: each row sums its ids in batch order, as add.at
    s = flat[order]
    first = np.empty(s.size, bool)
    first[0] = True
    np.not_equal(s[1:], s[:-1], out=first[1:])
    rows = s[first]
    # each row's first id written, the repeats added after it in batch order (bit for bit np.add.at);
    # `np.add.reduceat` over rows of 64 cost 2.5x this for W8's 256 ids, most of them distinct
    z[rows] = g2[order[first]]
    if rows.size < s.size:
        rest = ~first
        np.add.at(z, s[rest], g2[order[rest]])
    note_rows(z, rows)
    return z


def _emb_backward_ag(shape: tuple[int, ...], iv: np.ndarray, g: Tensor) -> Tensor:
    return index_add(shape, (iv,), g)


register_xp("embedding_backward", _emb_backward_np, _emb_backward_ag)


OP_EMBEDDING = defop("embedding", _emb_kernel, _emb_meta, _emb_rule)


def _renorm_rows(w: np.ndarray, idx: np.ndarray, max_norm: float, norm_type: float) -> None:
    rows = np.unique(idx)
    norms = np.linalg.norm(w[rows], ord=norm_type, axis=1)
    big = norms > max_norm
    rows, norms = rows[big], norms[big]
    w[rows] *= (max_norm / (norms + 1e-7)).astype(w.dtype)[:, None]


def embedding(
    input: Any,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """Rows of ``weight`` picked by the integer ``input`` (``torch.nn.functional.embedding``).

    ``padding_idx`` rows get no gradient; ``max_norm`` renormalises the looked-up rows of ``weight`` in
    place first (outside the graph); ``scale_grad_by_freq`` divides each row's gradient by its count in
    the batch. ``sparse`` gradients are not supported (the gradient is dense).
    """
    if sparse:
        raise NotImplementedError("embedding: sparse gradients are not supported; use sparse=False")
    idx = _index_arg("embedding", input)
    n = weight.shape[0]
    if padding_idx is not None:
        if not -n <= padding_idx < n:
            raise OpError(f"embedding: padding_idx {padding_idx} must be within num_embeddings ({n})")
        padding_idx %= n
    if max_norm is not None:

        inplace(weight, _renorm_rows, _value(idx), float(max_norm), float(norm_type))
    kw = {"padding_idx": padding_idx, "scale_grad_by_freq": bool(scale_grad_by_freq)}
    return apply(OP_EMBEDDING, (weight, idx), kw)


def _ln_meta(x: Tensor, w: Any, b: Any, axes: tuple[int, ...], eps: float) -> Any:
    _float_check("layer_norm", x)
    ns = x.shape[axes[0] :]
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and tuple(t.shape) != ns:
            raise OpError(
                f"layer_norm: {name} of shape {tuple(t.shape)} does not match normalized_shape {ns}"
            )
    return x.shape, x.dtype




def _ln_kernel(x: np.ndarray, w: Any, b: Any, axes: tuple[int, ...], eps: float) -> np.ndarray:
    if x.dtype not in _LN_BLAS or (w is not None and w.dtype != x.dtype) or (b is not None and b.dtype != x.dtype):
        return _ln_kernel_general(x, w, b, axes, eps)
    n = math.prod(x.shape[axes[0] :])
    rows = np.ascontiguousarray(x.reshape(-1, n))
    # the output is a view into a buffer that also holds each row's mean and 1/std, which the rule reads
    # instead of computing them again (`_ln_saved`; as PyTorch saves mean and rstd)
    r, size = rows.shape[0], rows.size
    buf = np.empty(size + 2 * r, x.dtype)
    y = buf[:size].reshape(rows.shape)
    layer_norm_forward(rows, _flat(w), _flat(b), eps, y, buf[size : size + r], buf[size + r :])
    return y.reshape(x.shape)


def _flat(t: Any) -> Any:
    return None if t is None else np.ascontiguousarray(t.reshape(-1))


def _ln_saved(out: Any, x: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The (rows,) mean and 1/std `_ln_kernel` left beside its output ``out``, or None (another path made
    ``out``, or its array was replaced). In-place writes to the output leave them as they were."""
    b = out.base if isinstance(out, np.ndarray) else None
    n = x.size
    if b is None or b.ndim != 1 or b.size != n + 2 * r or b.dtype != x.dtype:
        return None
    return b[n : n + r], b[n + r :]


def _ln_kernel_general(x: np.ndarray, w: Any, b: Any, axes: tuple[int, ...], eps: float) -> np.ndarray:
    mu = x.mean(axes, keepdims=True)
    xc = x - mu
    var = np.mean(np.square(xc), axes, keepdims=True)
    var += eps
    np.sqrt(var, out=var)
    xc /= var
    if w is not None:
        xc *= w
    if b is not None:
        xc += b
    return xc


def _ln_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, w, _ = args
    axes, eps = kw["axes"], kw["eps"]
    if xp is NP:
        return _ln_grads_np(g, x, w, axes, eps, needs, out)
    n = math.prod(x.shape[axes[0] :])
    xc = x - xp.sum(x, axes, True) / n
    rstd = 1 / xp.sqrt(xp.sum(xc * xc, axes, True) / n + eps)
    xhat = xc * rstd
    gx = gw = gb = None
    if needs[0]:
        gy = g * w if w is not None else g
        gx = rstd * (gy - xp.sum(gy, axes, True) / n - xhat * (xp.sum(gy * xhat, axes, True) / n))
    if needs[1]:
        gw = g * xhat  # the engine sums it over the leading dims
    if needs[2]:
        gb = g
    return (gx, gw, gb)


def _ln_grads_np(
    g: np.ndarray, x: np.ndarray, w: Any, axes: tuple[int, ...], eps: float, needs: Any, out: Any = None
) -> tuple[Any, ...]:
    """`_ln_rule` on arrays: one `kernels.layer_norm_backward` over the rows (the forward's statistics read
    from beside its output when they are there), the input's dtype kept (float32 stays float32), and the
    weight and bias gradients summed over the leading dims here."""
    if x.dtype not in _LN_BLAS or g.dtype != x.dtype or (w is not None and w.dtype != x.dtype):
        return _ln_grads_general(g, x, w, axes, eps, needs)
    n = math.prod(x.shape[axes[0] :])
    rows = np.ascontiguousarray(x.reshape(-1, n))
    saved = None if out is None else _ln_saved(out, x, rows.shape[0])
    mean, rstd = saved if saved is not None else (None, None)
    gx, gw, gb = layer_norm_backward(np.ascontiguousarray(g.reshape(rows.shape)), rows, _flat(w), mean, rstd, eps,
                                     (bool(needs[0]), bool(needs[1]), bool(needs[2])))
    ns = x.shape[axes[0] :]
    return (
        None if gx is None else gx.reshape(x.shape),
        None if gw is None else gw.reshape(ns),
        None if gb is None else gb.reshape(ns),
    )


def _ln_grads_general(
    g: np.ndarray, x: np.ndarray, w: Any, axes: tuple[int, ...], eps: float, needs: Any
) -> tuple[Any, ...]:
    xc = x - x.mean(axes, keepdims=True)
    rstd = np.square(xc).mean(axes, keepdims=True)
    rstd += eps
    np.sqrt(rstd, out=rstd)
    np.reciprocal(rstd, out=rstd)
    xhat = xc
    xhat *= rstd
    lead = tuple(range(axes[0]))
    gx = gw = gb = None
    if needs[0]:
        gy = g * w if w is not None else g
        t = gy * xhat
        m2 = t.mean(axes, keepdims=True)
        gx = np.multiply(xhat, m2, out=t)
        np.subtract(gy, gx, out=gx)
        gx -= gy.mean(axes, keepdims=True)
        gx *= rstd
    if needs[1]:
        gw = np.multiply(g, xhat).sum(lead) if lead else g * xhat
    if needs[2]:
        gb = g.sum(lead) if lead else g
    return (gx, gw, gb)


# the rule reads the statistics beside the output, not the output's values (`Op.save_out_side`)
OP_LAYER_NORM = defop("layer_norm", _ln_kernel, _ln_meta, _ln_rule, save_out=True, save_out_side=True)


def layer_norm(
    input: Tensor,
    normalized_shape: Any,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Layer normalisation over the trailing ``normalized_shape`` dims (``F.layer_norm``)."""
    ns = (
        (int(normalized_shape),)
        if isinstance(normalized_shape, (int, np.integer))
        else tuple(normalized_shape)
    )
    k = len(ns)
    if k == 0 or k > input.ndim or tuple(input.shape[input.ndim - k :]) != ns:
        raise OpError(
            f"layer_norm: normalized_shape {ns} must match the trailing dims of the input, "
            f"got shape {input.shape}"
        )
    axes = tuple(range(input.ndim - k, input.ndim))
    return apply(OP_LAYER_NORM, (input, weight, bias), {"axes": axes, "eps": float(eps)})


def _dropout_mask(shape: tuple[int, ...], p: float, seed: int, dtype: Any) -> np.ndarray:
    """The kept-and-rescaled mask, a pure function of (shape, p, seed): forward and backward agree."""
    keep = np.random.default_rng(seed).random(shape, dtype=np.float32) >= p
    return keep.astype(dtype) * np.asarray(1.0 / (1.0 - p), dtype)


def _dropped(a: np.ndarray, p: float, seed: int) -> np.ndarray:
    """``a * _dropout_mask(...)`` with no float mask: ``(a * keep) * s`` rounds as ``a * (keep * s)`` does
    (keep is 0 or 1), so the values are the same, for one temporary less."""
    keep = np.random.default_rng(seed).random(a.shape, dtype=np.float32) >= p
    out = np.multiply(a, keep)
    out *= np.asarray(1.0 / (1.0 - p), a.dtype)
    return out


def _dropout_kernel(x: np.ndarray, p: float, seed: int) -> np.ndarray:
    return _dropped(x, p, seed)


def _dropout_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    if isinstance(g, np.ndarray) and g.dtype.kind == "f":
        return (_dropped(g, kw["p"], kw["seed"]),)
    return (g * _dropout_mask(tuple(g.shape), kw["p"], kw["seed"], g.dtype),)


OP_DROPOUT = defop("dropout", _dropout_kernel, lambda x, p, seed: (x.shape, x.dtype), _dropout_rule)


def dropout(
    input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, generator: Any = None
) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p) (when ``training``).

    The mask is a pure function of a seed drawn from ``generator`` (a ``numpy.random.Generator``; the
    default generator, see `manual_seed`, when None) at call time, on the calling thread: the same
    generator state gives the same mask wherever and whenever the kernel runs. ``inplace`` is accepted
    for signature compatibility; the result is always a new tensor.
    """
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training:
        return input
    _float_check("dropout", input)
    if p == 1.0:
        return input * 0.0
    if p == 0.0:
        return input * 1.0
    if generator is None:

        generator = default_generator()
    seed = int(generator.integers(0, 2**63 - 1))
    return apply(OP_DROPOUT, (input,), {"p": float(p), "seed": seed})


_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def _check(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise OpError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def _gelu_kernel(a: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "none" and isinstance(a, np.ndarray) and a.dtype == np.float32:
        return gelu32(a)
    if approximate == "tanh":
        inner = _K * (a + _C * a * a * a)
        return (0.5 * a * (1.0 + np.tanh(inner))).astype(a.dtype, copy=False)
    return (0.5 * a * (1.0 + _erf(a / _SQRT_2))).astype(a.dtype, copy=False)


def _gelu_grad_kernel(g: np.ndarray, a: np.ndarray, approximate: str) -> np.ndarray:
    """``g * gelu'(a)``."""
    if approximate == "tanh":
        inner = _K * (a + _C * a * a * a)
        t = np.tanh(inner)
        d = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * a * a)
    else:
        cdf = 0.5 * (1.0 + _erf(a / _SQRT_2))
        pdf = np.exp(-0.5 * a * a) * _INV_SQRT_2PI
        d = cdf + a * pdf
    return (g * d).astype(np.result_type(g, a), copy=False)


def _gelu_second(xp: Any, a: Any, approximate: str) -> Any:
    """``gelu''(a)``, written with rule-namespace functions only (works for numpy and asyncgrad)."""
    if approximate == "tanh":
        inner = (a + a * a * a * _C) * _K
        t = xp.tanh(inner)
        dinner = (a * a * (3.0 * _C) + 1.0) * _K
        sech2 = 1.0 - t * t
        # d/da [0.5 (1 + t) + 0.5 a sech2 dinner]
        return sech2 * dinner + a * sech2 * (t * dinner * dinner * -1.0 + a * (3.0 * _C * _K))
    pdf = xp.exp(a * a * -0.5) * _INV_SQRT_2PI
    return pdf * (2.0 - a * a)


def _gelu_meta(a: Tensor, approximate: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if a._dtype.kind not in "fc":
        raise OpError(f"gelu: input dtype {a._dtype} is not floating point")
    return a._shape, a._dtype


def _gelu_grad_from_out(g: np.ndarray, a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``g * gelu'(a)`` for float32, exact GELU, reading the saved output (`kernels.gelu32_backward`; ~13 ufunc
    passes in its numpy twin instead of ~40 through a second erf)."""
    if g.dtype == np.float32 and g.shape == a.shape:
        return gelu32_backward(g, a, out)  # type: ignore[no-any-return]
    return g * gelu32_backward(np.ones_like(a), a, out)


def _gelu_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    (a,) = args
    if xp is NP:
        if (
            kw["approximate"] == "none" and a.dtype == np.float32 and isinstance(out, np.ndarray)
            and out.dtype == np.float32 and out.shape == a.shape
        ):
            return (_gelu_grad_from_out(g, a, out),)
        return (_gelu_grad_kernel(g, a, kw["approximate"]),)
    return (apply(OP_GELU_BACKWARD, (g, a), kw),)


def _bwd_meta(g: Any, a: Any, approximate: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    return broadcast_shapes("gelu_backward", tuple(g.shape), tuple(a.shape)), np.result_type(g.dtype, a.dtype)


def _gelu_backward_rule(xp: Any, gg: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    g, a = args
    approx = kw["approximate"]
    dg = da = None
    if needs[0]:
        dg = _gelu_grad_kernel(gg, a, approx) if xp is NP else apply(OP_GELU_BACKWARD, (gg, a), kw)
    if needs[1]:
        da = gg * g * _gelu_second(xp, a, approx)
    return (dg, da)


# the output is saved: the float32 backward reads the forward's erf off it (`_gelu_grad_from_out`)
OP_GELU = defop("gelu", _gelu_kernel, _gelu_meta, _gelu_rule, save_out=True)
OP_GELU_BACKWARD = defop("gelu_backward", _gelu_grad_kernel, _bwd_meta, _gelu_backward_rule)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian Error Linear Unit, ``x * Phi(x)``.

    Args:
        x: Input tensor (floating point).
        approximate: ``"none"`` (exact, erf-based; PyTorch's default) or ``"tanh"``.

    Returns:
        A tensor of ``x``'s shape and dtype.
    """
    _check(approximate)
    return apply(OP_GELU, (x,), {"approximate": approximate})
