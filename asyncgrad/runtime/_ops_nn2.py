"""More neural-network ops, with PyTorch's names, arguments and semantics.

embedding, layer_norm, dropout, logsumexp, clamp, gather, index_select, cumsum, einsum, var/std, and the
losses cross_entropy, nll_loss, mse_loss, binary_cross_entropy_with_logits.

Speed-critical ones are single ops with fused numpy kernels (cross_entropy, layer_norm); the rest are
small ops or compositions of existing ones. Every backward rule is written against ``xp`` (numpy for a
plain backward, asyncgrad ops under ``create_graph=True``), so all of them have second derivatives.
Integer side inputs (targets, indices) reach rules as numpy arrays through ``xp.value``.
"""

from __future__ import annotations

import math
import string
from typing import Any

import numpy as np

from ._dispatch import OpError, apply, broadcast_shapes, defop
from ._ops_reduce import _expand_back, _norm_axes, _reduced_shape
from ._promote import result_type, to_float
from ._tensor import Tensor
from ._xp import NP


def _value(x: Any) -> Any:
    """numpy value of a side input (a Tensor, array, list or number)."""
    return x.numpy() if isinstance(x, Tensor) else np.asarray(x)


def _index_arg(op: str, idx: Any) -> Any:
    """An integer index input as a Tensor (kept, so pending values are waited for in order) or array."""
    if isinstance(idx, Tensor):
        if idx.dtype.kind not in "iu":
            raise OpError(f"{op}: index must be an integer tensor, got dtype {idx.dtype}")
        return idx
    a = np.asarray(idx)
    if a.dtype.kind not in "iu":
        raise OpError(f"{op}: index must be integers, got dtype {a.dtype}")
    return a


def _dim(op: str, x: Any, dim: int) -> int:
    n = max(x.ndim, 1)
    if not -n <= dim < n:
        raise OpError(f"{op}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % n


def _float_check(op: str, x: Tensor) -> None:
    if x.dtype.kind not in "fc":
        raise OpError(f"{op}: expected a floating point tensor, got dtype {x.dtype}")


# ---- embedding --------------------------------------------------------------------------------------


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
    return (xp.index_add(tuple(w.shape), (iv,), g), None)


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
        from ._inplace import inplace

        inplace(weight, _renorm_rows, _value(idx), float(max_norm), float(norm_type))
    kw = {"padding_idx": padding_idx, "scale_grad_by_freq": bool(scale_grad_by_freq)}
    return apply(OP_EMBEDDING, (weight, idx), kw)


# ---- layer_norm ---------------------------------------------------------------------------------------


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


OP_LAYER_NORM = defop("layer_norm", _ln_kernel, _ln_meta, _ln_rule)


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


# ---- dropout -----------------------------------------------------------------------------------------


def _dropout_mask(shape: tuple[int, ...], p: float, seed: int, dtype: Any) -> np.ndarray:
    """The kept-and-rescaled mask, a pure function of (shape, p, seed): forward and backward agree."""
    keep = np.random.default_rng(seed).random(shape, dtype=np.float32) >= p
    return keep.astype(dtype) * np.asarray(1.0 / (1.0 - p), dtype)


def _dropout_kernel(x: np.ndarray, p: float, seed: int) -> np.ndarray:
    return x * _dropout_mask(x.shape, p, seed, x.dtype)


def _dropout_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
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
        from ._factories import default_generator

        generator = default_generator()
    seed = int(generator.integers(0, 2**63 - 1))
    return apply(OP_DROPOUT, (input,), {"p": float(p), "seed": seed})


# ---- logsumexp ---------------------------------------------------------------------------------------


def _lse_kernel(x: np.ndarray, axis: Any, keepdims: bool) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    s = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return np.asarray(s if keepdims else np.squeeze(s, axis=axis))


def _lse_meta(x: Tensor, axis: Any, keepdims: bool) -> Any:
    # bool and integer inputs compute in the default float dtype, like PyTorch's
    return _reduced_shape(x.shape, axis, keepdims), to_float(x.dtype)


def _lse_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x = args[0]
    axis, keepdims = kw["axis"], kw["keepdims"]
    ob = _expand_back(xp, out, tuple(x.shape), axis, keepdims)
    gb = _expand_back(xp, g, tuple(x.shape), axis, keepdims)
    return (gb * xp.exp(x - ob),)


OP_LOGSUMEXP = defop("logsumexp", _lse_kernel, _lse_meta, _lse_rule, save_out=True, cast_in=True)


def logsumexp(input: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """log(sum(exp(input))) over ``dim`` (int or tuple; None for all), computed stably."""
    axes = _norm_axes("logsumexp", input.shape, dim)
    if axes is None:
        axes = tuple(range(input.ndim))
    return apply(OP_LOGSUMEXP, (input,), {"axis": axes, "keepdims": bool(keepdim)})


# ---- clamp ---------------------------------------------------------------------------------------------


def _clamp_meta(x: Tensor, lo: Any, hi: Any) -> Any:
    shape = x.shape
    for v in (lo, hi):
        if v is not None:
            shape = broadcast_shapes(
                "clamp", shape, tuple(np.shape(v) if not isinstance(v, Tensor) else v.shape)
            )
    # PyTorch's result_type of input, min and max (an int tensor clamped to 0.5 is float32); the kernel
    # picks with numpy and the dispatcher casts the pick, which equals picking from cast operands
    return shape, result_type(x, lo, hi)


def _clamp_kernel(x: np.ndarray, lo: Any, hi: Any) -> np.ndarray:
    out = x
    if lo is not None:
        out = np.maximum(out, lo)
    if hi is not None:
        out = np.minimum(out, hi)
    return np.asarray(out)


def _clamp_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # PyTorch's clamp_backward_min_max: x gets g inside [min, max]; min gets g where x < min (and
    # min < max); max gets g where x > max (or max < min, where the result is max everywhere).
    # The masks are constants (numpy), also under create_graph.
    x, lo, hi = (None if a is None else xp.value(a) for a in args)
    inside = True
    if lo is not None:
        inside = x >= lo
    if hi is not None:
        inside = inside & (x <= hi)
    gx = xp.where(inside, g, 0) if needs[0] else None
    glo = ghi = None
    if needs[1]:
        assert lo is not None  # needs[1] means a tensor bound was given
        m = x < lo
        glo = xp.where(m & (lo < hi) if hi is not None else m, g, 0)
    if needs[2]:
        assert hi is not None
        m = x > hi
        ghi = xp.where(m | (hi < lo) if lo is not None else m, g, 0)
    return (gx, glo, ghi)


OP_CLAMP = defop("clamp", _clamp_kernel, _clamp_meta, _clamp_rule)


def clamp(input: Tensor, min: Any = None, max: Any = None) -> Tensor:
    """Limit ``input`` to [min, max] (numbers or tensors; either may be None, not both)."""
    if min is None and max is None:
        raise OpError("clamp: at least one of 'min' or 'max' must not be None")
    return apply(OP_CLAMP, (input, min, max))


clip = clamp


def clamp_min(input: Tensor, min: Any) -> Tensor:
    return clamp(input, min=min)


def clamp_max(input: Tensor, max: Any) -> Tensor:
    return clamp(input, max=max)


# ---- gather, index_select ----------------------------------------------------------------------------


def _gather_meta(x: Tensor, idx: Any, dim: int) -> Any:
    if idx.ndim != x.ndim:
        raise OpError(f"gather: index of shape {tuple(idx.shape)} must have as many dims as input {x.shape}")
    for d, (a, b) in enumerate(zip(idx.shape, x.shape)):
        if d != dim and a > b:
            raise OpError(
                f"gather: index {tuple(idx.shape)} is larger than input {x.shape} in dim {d} "
                f"(only dim {dim} may be)"
            )
    return tuple(idx.shape), x.dtype


def _gather_kernel(x: np.ndarray, idx: np.ndarray, dim: int) -> np.ndarray:
    if idx.size and (idx.min() < 0 or idx.max() >= x.shape[dim]):
        raise IndexError(f"gather: index out of bounds for dim {dim} with size {x.shape[dim]}")
    sl = tuple(slice(0, n) if d != dim else slice(None) for d, n in enumerate(idx.shape))
    return np.take_along_axis(x[sl], idx.astype(np.intp, copy=False), axis=dim)


def _gather_index(idx: np.ndarray, dim: int) -> tuple[Any, ...]:
    """The full integer index tuple picking what gather(x, dim, idx) picks (for the scatter-add adjoint)."""
    nd = idx.ndim
    return tuple(
        idx if d == dim else np.arange(n).reshape([n if e == d else 1 for e in range(nd)])
        for d, n in enumerate(idx.shape)
    )


def _gather_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, idx = args
    return (xp.index_add(tuple(x.shape), _gather_index(xp.value(idx), kw["dim"]), g), None)


OP_GATHER = defop("gather", _gather_kernel, _gather_meta, _gather_rule)


def gather(input: Tensor, dim: int, index: Any) -> Tensor:
    """``out[i][j] = input[index[i][j]][j]`` (dim 0), like ``torch.gather``."""
    idx = _index_arg("gather", index)
    return apply(OP_GATHER, (input, idx), {"dim": _dim("gather", input, dim)})


def _isel_meta(x: Tensor, idx: Any, dim: int) -> Any:
    if idx.ndim > 1:
        raise OpError(f"index_select: index must be 0-d or 1-d, got shape {tuple(idx.shape)}")
    n = math.prod(idx.shape)
    return (*x.shape[:dim], n, *x.shape[dim + 1 :]), x.dtype


def _isel_kernel(x: np.ndarray, idx: np.ndarray, dim: int) -> np.ndarray:
    n = x.shape[dim]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"index_select: index out of range for dim {dim} with size {n}")
    return np.take(x, idx.reshape(-1), axis=dim)


def _isel_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, idx = args
    dim = kw["dim"]
    iv = xp.value(idx).reshape(-1) % x.shape[dim]
    return (xp.index_add(tuple(x.shape), (slice(None),) * dim + (iv,), g), None)


OP_INDEX_SELECT = defop("index_select", _isel_kernel, _isel_meta, _isel_rule)


def index_select(input: Tensor, dim: int, index: Any) -> Tensor:
    """The entries of ``input`` along ``dim`` at the 1-d ``index`` positions, like ``torch.index_select``."""
    idx = _index_arg("index_select", index)
    return apply(OP_INDEX_SELECT, (input, idx), {"dim": _dim("index_select", input, dim)})


# ---- cumsum ------------------------------------------------------------------------------------------


def _cumsum_meta(x: Tensor, axis: int, dtype: Any) -> Any:
    if dtype is not None:
        return x.shape, dtype
    dt = x.dtype
    return x.shape, (np.dtype(np.int64) if dt.kind in "biu" else dt)


def _cumsum_kernel(x: np.ndarray, axis: int, dtype: Any) -> np.ndarray:
    if dtype is None and x.dtype.kind in "biu":
        dtype = np.int64
    return np.cumsum(x, axis=axis, dtype=dtype)


def _cumsum_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    rev = (slice(None),) * kw["axis"] + (slice(None, None, -1),)
    return (xp.cumsum(g[rev], kw["axis"])[rev],)


OP_CUMSUM = defop("cumsum", _cumsum_kernel, _cumsum_meta, _cumsum_rule)


def cumsum(input: Tensor, dim: int, *, dtype: Any = None) -> Tensor:
    """Cumulative sum along ``dim`` (integers accumulate in int64, like PyTorch)."""
    if input.ndim == 0:
        from ._ops_shape import reshape

        return reshape(cumsum(reshape(input, (1,)), 0, dtype=dtype), ())
    return apply(
        OP_CUMSUM,
        (input,),
        {"axis": _dim("cumsum", input, dim), "dtype": None if dtype is None else np.dtype(dtype)},
    )


def np_cumsum(x: np.ndarray, axis: int) -> np.ndarray:
    return np.cumsum(x, axis=axis)


def ag_cumsum(x: Tensor, axis: int) -> Tensor:
    return apply(OP_CUMSUM, (x,), {"axis": axis, "dtype": None})


# ---- einsum ------------------------------------------------------------------------------------------


def _parse_einsum(equation: str, shapes: list[tuple[int, ...]]) -> tuple[list[str], str]:
    """Explicit subscripts (no ellipsis, explicit output) for ``equation`` on operands of ``shapes``."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise OpError(
            f"einsum: equation {equation!r} names {len(terms)} operands but {len(shapes)} were given"
        )
    used = set(eq) - set(".,->")
    for c in used:
        if c not in string.ascii_letters:
            raise OpError(f"einsum: subscripts must be letters, got {c!r} in {equation!r}")
    free = [c for c in string.ascii_letters if c not in used]
    n_ell = 0
    for t, s in zip(terms, shapes):
        if "..." in t:
            n_ell = max(n_ell, len(s) - (len(t) - 3))
    ell = "".join(free[:n_ell])
    out_terms = []
    for t, s in zip(terms, shapes):
        if "..." in t:
            k = len(s) - (len(t) - 3)
            if k < 0:
                raise OpError(f"einsum: operand of shape {s} has fewer dims than subscripts {t!r}")
            t = t.replace("...", ell[n_ell - k :])
        if len(t) != len(s):
            raise OpError(f"einsum: subscripts {t!r} do not match an operand with {len(s)} dims (shape {s})")
        out_terms.append(t)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(out_terms)
        out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
    return out_terms, out


def _einsum_meta(*ops: Any, terms: list[str], out: str) -> Any:
    sizes: dict[str, int] = {}
    for t, o in zip(terms, ops):
        for c, n in zip(t, o.shape):
            m = sizes.get(c, 1)
            if m != n and m != 1 and n != 1:
                raise OpError(f"einsum: subscript {c!r} has sizes {m} and {n} in different operands")
            sizes[c] = max(m, n) if n != 1 else m
    for c in out:
        if c not in sizes:
            raise OpError(f"einsum: output subscript {c!r} appears in no operand")
    if len(set(out)) != len(out):
        raise OpError(f"einsum: output subscripts {out!r} repeat a letter")
    dt = np.result_type(*[o.dtype for o in ops])
    return tuple(sizes[c] for c in out), dt


def _einsum_kernel(*ops: np.ndarray, terms: list[str], out: str) -> np.ndarray:
    eq = ",".join(terms) + "->" + out
    big = len(ops) > 2 or sum(o.size for o in ops) > 4096
    return np.asarray(np.einsum(eq, *ops, optimize="greedy" if big and len(ops) > 1 else False))


def _einsum_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    terms, o = kw["terms"], kw["out"]
    grads: list[Any] = []
    for k, (t, need) in enumerate(zip(terms, needs)):
        if not need:
            grads.append(None)
            continue
        others = [(terms[j], args[j]) for j in range(len(terms)) if j != k]
        avail = set(o).union(*[set(tj) for tj, _ in others])
        uniq = "".join(dict.fromkeys(t))
        have = "".join(c for c in uniq if c in avail)
        eq = ",".join([o, *[tj for tj, _ in others]]) + "->" + have
        gk = xp.einsum(eq, g, *[a for _, a in others])
        shape = tuple(args[k].shape)
        size = {c: n for c, n in zip(t, shape)}
        if len(have) < len(uniq):  # letters summed away in this operand alone: broadcast back
            pos = [i for i, c in enumerate(uniq) if c not in avail]
            gk = xp.expand_dims(gk, tuple(pos))
            gk = xp.broadcast_to(
                gk, tuple(size[c] if c not in avail else gk.shape[i] for i, c in enumerate(uniq))
            )
        if len(uniq) < len(t):  # repeated letters (a diagonal): scatter onto it
            u = len(uniq)
            idx = tuple(
                np.arange(size[c]).reshape([-1 if uniq.index(c) == q else 1 for q in range(u)]) for c in t
            )
            gk = xp.index_add(shape, idx, gk)
        grads.append(gk)
    return tuple(grads)


OP_EINSUM = defop("einsum", _einsum_kernel, _einsum_meta, _einsum_rule)


def einsum(equation: str, *operands: Any) -> Tensor:
    """Einstein summation like ``torch.einsum`` (ellipsis, implicit output, broadcasting of size-1 dims)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    for o in operands:
        if not isinstance(o, Tensor):
            raise TypeError(f"einsum: operands must be Tensors, got {type(o).__name__}")
    terms, out = _parse_einsum(equation, [tuple(o.shape) for o in operands])
    return apply(OP_EINSUM, tuple(operands), {"terms": terms, "out": out})


def np_einsum(eq: str, *ops: np.ndarray) -> np.ndarray:
    terms, out = eq.split("->")
    return _einsum_kernel(*ops, terms=terms.split(","), out=out)


def ag_einsum(eq: str, *ops: Tensor) -> Tensor:
    terms, out = eq.split("->")
    return apply(OP_EINSUM, tuple(ops), {"terms": terms.split(","), "out": out})


# ---- var / std -----------------------------------------------------------------------------------------


def _var_meta(x: Tensor, axis: Any, keepdims: bool, correction: float) -> Any:
    _float_check("var", x)
    return _reduced_shape(x.shape, axis, keepdims), x.dtype


def _count(shape: tuple[int, ...], axis: Any) -> int:
    return math.prod(shape) if axis is None else math.prod(shape[i] for i in axis)


def _var_kernel(x: np.ndarray, axis: Any, keepdims: bool, correction: float) -> np.ndarray:
    n = _count(x.shape, axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = np.mean(x, axis=axis, keepdims=True)
        d = x - mu
        s = np.sum(d * d, axis=axis, keepdims=keepdims)
        return np.asarray(s / x.dtype.type(max(n - correction, 0)), dtype=x.dtype)


def _var_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x = args[0]
    axis, keepdims, c = kw["axis"], kw["keepdims"], kw["correction"]
    shape = tuple(x.shape)
    n = _count(shape, axis)
    d = x - xp.sum(x, axis, True) / n
    gb = _expand_back(xp, g, shape, axis, keepdims)
    denom = max(n - c, 0)
    return (gb * d * (2.0 / denom if denom else math.inf),)


OP_VAR = defop("var", _var_kernel, _var_meta, _var_rule)


def _var_args(op: str, x: Tensor, dim: Any, unbiased: Any, keepdim: bool, correction: Any) -> dict[str, Any]:
    if isinstance(dim, bool):  # var(x, unbiased)
        dim, unbiased = None, dim
    if unbiased is not None and correction is not None:
        raise OpError(f"{op}: pass either unbiased or correction, not both")
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    return {"axis": _norm_axes(op, x.shape, dim), "keepdims": bool(keepdim), "correction": float(correction)}


def var(
    input: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *, correction: Any = None
) -> Tensor:
    """Variance over ``dim`` with Bessel's ``correction`` (default 1; ``unbiased=False`` means 0)."""
    return apply(OP_VAR, (input,), _var_args("var", input, dim, unbiased, keepdim, correction))


def std(
    input: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *, correction: Any = None
) -> Tensor:
    """Standard deviation: ``sqrt(var(...))`` with the same arguments."""
    from ._ops_elementwise import sqrt

    return sqrt(apply(OP_VAR, (input,), _var_args("std", input, dim, unbiased, keepdim, correction)))


# ---- losses ----------------------------------------------------------------------------------------------


def _reduction(size_average: Any, reduce: Any, reduction: str) -> str:
    if size_average is not None or reduce is not None:  # PyTorch's legacy arguments
        sa = True if size_average is None else size_average
        rd = True if reduce is None else reduce
        reduction = ("mean" if sa else "sum") if rd else "none"
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return reduction


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return loss.mean()  # type: ignore[attr-defined,no-any-return]
    if reduction == "sum":
        return loss.sum()  # type: ignore[attr-defined,no-any-return]
    return loss


def _weighted(loss: Tensor, weight: Tensor | None, input: Tensor, reduction: str, mean_by_weight: bool) -> Tensor:
    """Reduce an elementwise loss, weighted per element by ``weight`` if given (``mean_by_weight``: the
    weighted 'mean' divides by the sum of the weights, not by the count)."""
    if weight is None:
        return _reduce(loss, reduction)
    if tuple(weight.shape) != tuple(input.shape):
        raise ValueError(
            f"loss weight has shape {tuple(weight.shape)} but the input has {tuple(input.shape)}; they must match"
        )
    wl = loss * weight
    if reduction == "mean" and mean_by_weight:
        return wl.sum() / weight.sum()  # type: ignore[attr-defined,no-any-return]
    return _reduce(wl, reduction)


def _class_targets(op: str, x: Tensor, target: Any) -> Any:
    t = _index_arg(op, target)
    want = (x.shape[0], *x.shape[2:])
    if tuple(t.shape) != want:
        raise OpError(
            f"{op}: expected target of shape {want} for input of shape {x.shape}, got {tuple(t.shape)}"
        )
    return t


class _Targets:
    """What a class-index loss needs of its targets: safe indices, per-sample weights, the mean's divisor."""

    __slots__ = ("all_valid", "denom", "idx", "ts", "valid", "wt")

    def __init__(self, t: np.ndarray, c: int, w: Any, ignore_index: int, dtype: Any) -> None:
        lo, hi = (int(t.min()), int(t.max())) if t.size else (0, 0)
        if 0 <= lo and hi < c and not lo <= ignore_index <= hi:  # the common case: nothing to ignore
            self.all_valid = all_valid = True
            self.valid: Any = True
            self.ts = ts = t
        else:
            valid = t != ignore_index
            self.all_valid = all_valid = bool(valid.all())
            self.valid = valid
            self.ts = ts = t if all_valid else np.where(valid, t, 0)
            if ts.size and (ts.min() < 0 or ts.max() >= c):
                bad = ts[(ts < 0) | (ts >= c)].flat[0]
                raise IndexError(f"Target {bad} is out of bounds.")
        # per-sample weights: None when they are all 1
        wt = None
        if w is not None:
            wt = w[ts].astype(dtype, copy=False)
        if not all_valid:
            wt = self.valid.astype(dtype) if wt is None else wt * self.valid
        self.wt = wt
        self.denom = dtype.type(ts.size) if wt is None else wt.sum(dtype=dtype)
        # an index picking each sample's target class out of an (N, C, ...) array
        if ts.ndim == 1:
            self.idx: Any = (np.arange(ts.shape[0]), ts)
        else:
            grids: Any = np.indices(ts.shape, sparse=True)
            self.idx = (grids[0], ts, *grids[1:])

    def onehot(self, c: int, dtype: Any) -> np.ndarray:
        oh = np.zeros((self.ts.shape[0], c, *self.ts.shape[1:]), dtype)
        oh[self.idx] = 1
        return oh


def _class_weights(w: Any, c: int, nd: int, dtype: Any) -> np.ndarray:
    """The class weights (ones when None) shaped to broadcast along the class dim of an nd-dim input."""
    wb = np.ones(c, dtype) if w is None else w.astype(dtype, copy=False)
    return wb.reshape((1, c) + (1,) * (nd - 2))


def _reduce_loss(loss: np.ndarray, reduction: str, tg: _Targets, dtype: Any) -> np.ndarray:
    if reduction == "none":
        return loss
    s = loss.sum(dtype=dtype)
    if reduction == "sum":
        return np.asarray(s, dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(s / tg.denom, dtype)


def _ce_meta(x: Tensor, t: Any, w: Any, ignore_index: int, reduction: str, ls: float) -> Any:
    shape = (x.shape[0], *x.shape[2:]) if reduction == "none" else ()
    return shape, x.dtype


def _ce_kernel(
    x: np.ndarray, t: np.ndarray, w: Any, ignore_index: int, reduction: str, ls: float
) -> np.ndarray:
    if w is None and not ls and reduction == "mean" and x.ndim == 2 and t.ndim == 1 and t.size:
        loss = _ce_fast(x, t, ignore_index)
        if loss is not None:
            return loss
    c, dt = x.shape[1], x.dtype
    tg = _Targets(t, c, w, ignore_index, dt)
    z = x - x.max(1, keepdims=True)
    lse = np.log(np.exp(z).sum(1, keepdims=True))
    loss = lse[:, 0] - z[tg.idx]  # -log p(target)
    if tg.wt is not None:
        loss *= tg.wt
    if ls:
        # smoothing term: -sum_c w_c log p_c = (sum_c w_c) lse - sum_c w_c z_c (0 for ignored targets)
        wb = _class_weights(w, c, x.ndim, dt)
        smooth = wb.sum() * lse[:, 0] - (z * wb).sum(1)
        if not tg.all_valid:
            smooth *= tg.valid
        loss = (1 - ls) * loss + (ls / c) * smooth
    return _reduce_loss(loss, reduction, tg, dt)


def _ce_fast(x: np.ndarray, t: np.ndarray, ignore_index: int) -> np.ndarray | None:
    """The common case (N, C) logits, class indices all valid, no weights or smoothing, mean: the loss as a
    0-dim view into a buffer that also holds the softmax, which the rule then reuses (`_ce_softmax`)
    instead of computing it again. None when a target is out of range or ignored (the general path)."""
    n, c = x.shape
    lo, hi = t.min(), t.max()
    if lo < 0 or hi >= c or lo <= ignore_index <= hi:
        return None
    buf = np.empty(1 + n * c, x.dtype)
    p = buf[1:].reshape(n, c)
    np.subtract(x, x.max(1, keepdims=True), out=p)
    picked = p[np.arange(n), t].sum()
    np.exp(p, out=p)
    s = p.sum(1, keepdims=True)
    buf[0] = (np.log(s).sum() - picked) / n
    p /= s
    return buf[:1].reshape(())


def _ce_softmax(out: Any, x: np.ndarray) -> np.ndarray | None:
    """The softmax `_ce_fast` left beside the loss ``out``, or None if ``out`` came from the general path."""
    b = out.base if isinstance(out, np.ndarray) else None
    if b is None or b.ndim != 1 or b.size != 1 + x.size:
        return None
    return b[1:].reshape(x.shape)  # type: ignore[no-any-return]


def _ce_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # d loss_i / d x_i = p_i * A_i - B_i with A_i = (1-ls) w_i + (ls/C) W and
    # B_i = (1-ls) w_i onehot(t_i) + (ls/C) w  (w_i: the target's weight, W = sum of class weights),
    # both 0 for ignored targets; then times the upstream gradient (divided by the weight sum for 'mean').
    x, t, w = args
    ls, reduction = kw["ls"], kw["reduction"]
    if xp is NP and out is not None:
        p = _ce_softmax(out, x)
        if p is not None:  # the forward took the fast path: valid targets, mean, no weights or smoothing
            r = g / x.shape[0]
            gx = p * r
            gx[np.arange(x.shape[0]), t] -= r
            return (gx, None, None)
    xv = xp.value(x)
    c, nd, dt = xv.shape[1], xv.ndim, xv.dtype
    wv = None if w is None else xp.value(w)
    tg = _Targets(xp.value(t), c, wv, kw["ignore_index"], dt)
    wt = tg.wt  # the target weights; None: all 1
    bo = dt.type(1 - ls) if wt is None else (1 - ls) * wt  # coefficient of the one-hot part of B
    a = wt  # A; None: all 1
    bd = None  # the dense (smoothing) part of B
    if ls:
        wb = _class_weights(wv, c, nd, dt)
        vm = None if tg.all_valid else tg.valid.astype(dt)
        a = (1 - ls) * (1 if wt is None else wt) + (ls / c) * wb.sum() * (1 if vm is None else vm)
        a = np.broadcast_to(np.asarray(a, dt), tg.ts.shape)
        bd = (ls / c) * wb * (1 if vm is None else vm[:, None])
    if reduction == "mean":
        # every target ignored: the loss is 0/0 = NaN, and its gradient 0, as in PyTorch (a fully padded
        # batch must not put NaN into the parameters)
        r = g / tg.denom if tg.denom != 0 else g * 0
    else:
        r = g if reduction == "sum" else xp.expand_dims(g, 1)
    if xp is NP:  # fused, in place
        p = np.exp(xv - xv.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        if a is not None:
            p *= a[:, None]
        p[tg.idx] -= bo
        if bd is not None:
            p -= bd
        p *= r
        return (p, None, None)
    m = xp.const(np.max(xv, axis=1, keepdims=True), x)
    e = xp.exp(x - m)
    p = e / xp.sum(e, 1, True)
    b = tg.onehot(c, dt) * (bo if np.ndim(bo) == 0 else bo[:, None])
    if bd is not None:
        b = b + bd
    pa = p if a is None else p * a[:, None]
    return (r * (pa - b), None, None)


# the output is saved: after the fast path it carries the softmax for the rule
OP_CROSS_ENTROPY = defop("cross_entropy", _ce_kernel, _ce_meta, _ce_rule, save_out=True)


def _as_batched(x: Tensor, target: Any) -> tuple[Tensor, Any, bool]:
    """(C,) input with a () target -> (1, C) and (1,), as PyTorch allows; says whether it did."""
    if x.ndim != 1:
        return x, target, False
    from ._ops_shape import reshape

    t = reshape(target, (1,)) if isinstance(target, Tensor) else np.asarray(target).reshape(1)
    return reshape(x, (1, x.shape[0])), t, True


def cross_entropy(
    input: Tensor,
    target: Any,
    weight: Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Softmax cross-entropy between logits (N, C) / (N, C, d1, ...) / (C,) and class-index targets
    (or class probabilities of the input's shape), like ``torch.nn.functional.cross_entropy``.

    One fused op for class-index targets. ``weight`` (C,) rescales classes (it gets no gradient);
    ``ignore_index`` targets contribute nothing (and are left out of the mean's denominator);
    ``label_smoothing`` mixes the targets with the uniform distribution.
    """
    reduction = _reduction(size_average, reduce, reduction)
    ls = float(label_smoothing)
    if not 0.0 <= ls <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {ls}")
    _float_check("cross_entropy", input)
    if weight is not None:
        if tuple(weight.shape) != (input.shape[1 if input.ndim > 1 else 0],):
            raise OpError(
                f"cross_entropy: weight of shape {tuple(weight.shape)} must be (C,) for input {input.shape}"
            )
        weight = weight.detach()
    is_prob = (isinstance(target, Tensor) and target.dtype.kind == "f") or (
        not isinstance(target, Tensor) and np.asarray(target).dtype.kind == "f"
    )
    if is_prob:
        return _cross_entropy_probs(input, target, weight, reduction, ls)
    x, t, unb = _as_batched(input, target)
    t = _class_targets("cross_entropy", x, t)
    kw = {"ignore_index": int(ignore_index), "reduction": reduction, "ls": ls}
    out = apply(OP_CROSS_ENTROPY, (x, t, weight), kw)
    if unb and reduction == "none":
        from ._ops_shape import reshape

        out = reshape(out, ())
    return out


def _cross_entropy_probs(x: Tensor, target: Any, weight: Any, reduction: str, ls: float) -> Tensor:
    from ._ops_nn import log_softmax

    if tuple(target.shape) != tuple(x.shape):
        raise OpError(
            f"cross_entropy: probability targets must have the input's shape {x.shape}, got {target.shape}"
        )
    cdim = 1 if x.ndim > 1 else 0
    c = x.shape[cdim]
    if ls:
        target = target * (1 - ls) + ls / c
    prod = log_softmax(x, cdim) * target
    if weight is not None:
        prod = prod * weight.reshape((c,) + (1,) * (x.ndim - cdim - 1))  # type: ignore[attr-defined]
    loss = -prod.sum(cdim)  # type: ignore[attr-defined]
    if reduction == "mean":
        return loss.sum() / (x.numel() // c)  # type: ignore[no-any-return]
    return _reduce(loss, reduction)


def _nll_kernel(x: np.ndarray, t: np.ndarray, w: Any, ignore_index: int, reduction: str) -> np.ndarray:
    tg = _Targets(t, x.shape[1], w, ignore_index, x.dtype)
    loss = -x[tg.idx]
    if tg.wt is not None:
        loss *= tg.wt
    return _reduce_loss(loss, reduction, tg, x.dtype)


def _nll_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, t, w = args
    dt = np.dtype(x.dtype)
    c = x.shape[1]
    tg = _Targets(xp.value(t), c, None if w is None else xp.value(w), kw["ignore_index"], dt)
    coef = -np.ones(tg.ts.shape, dt) if tg.wt is None else -tg.wt
    if kw["reduction"] == "mean":
        coef = coef / tg.denom if tg.denom != 0 else coef * 0  # all ignored: gradient 0 (PyTorch)
    b = np.zeros((tg.ts.shape[0], c, *tg.ts.shape[1:]), dt)
    b[tg.idx] = coef
    r = xp.expand_dims(g, 1) if kw["reduction"] == "none" else g
    return (r * b, None, None)


OP_NLL_LOSS = defop(
    "nll_loss",
    _nll_kernel,
    lambda x, t, w, ignore_index, reduction: _ce_meta(x, t, w, ignore_index, reduction, 0.0),
    _nll_rule,
)


def nll_loss(
    input: Tensor,
    target: Any,
    weight: Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
) -> Tensor:
    """Negative log-likelihood of class-index targets given log-probabilities (``F.nll_loss``)."""
    reduction = _reduction(size_average, reduce, reduction)
    _float_check("nll_loss", input)
    if weight is not None:
        weight = weight.detach()
    x, t, unb = _as_batched(input, target)
    t = _class_targets("nll_loss", x, t)
    out = apply(OP_NLL_LOSS, (x, t, weight), {"ignore_index": int(ignore_index), "reduction": reduction})
    if unb and reduction == "none":
        from ._ops_shape import reshape

        out = reshape(out, ())
    return out


def mse_loss(
    input: Tensor,
    target: Any,
    size_average: Any = None,
    reduce: Any = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
) -> Tensor:
    """Mean squared error (``torch.nn.functional.mse_loss``; with ``weight``, 'mean' is sum(w*se)/sum(w))."""
    reduction = _reduction(size_average, reduce, reduction)
    d = input - target
    se = d * d
    return _weighted(se, weight, input, reduction, True)


def _bce_meta(x: Tensor, t: Any, w: Any, pw: Any) -> Any:
    shape = x.shape
    for v in (t, w, pw):
        if v is not None:
            shape = broadcast_shapes("binary_cross_entropy_with_logits", shape, tuple(v.shape))
    return shape, x.dtype


def _bce_kernel(x: np.ndarray, t: np.ndarray, w: Any, pw: Any) -> np.ndarray:
    sp = np.logaddexp(x.dtype.type(0), -x)  # softplus(-x), stable
    lw = sp if pw is None else ((pw - 1) * t + 1) * sp
    loss = (1 - t) * x + lw
    if w is not None:
        loss = loss * w
    return np.asarray(loss, x.dtype)


def _bce_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, t, w, pw = args
    pos = xp.value(x) >= 0  # a constant mask (numpy), also under create_graph
    e = xp.exp(-xp.abs(x))
    sig_neg = xp.where(pos, e / (1 + e), 1 / (1 + e))  # sigmoid(-x)
    sp = xp.log(1 + e) + xp.where(pos, 0, -x)  # softplus(-x)
    gw_ = g if w is None else g * w
    lw = 1 if pw is None else (pw - 1) * t + 1
    gx = gw_ * ((1 - t) - lw * sig_neg) if needs[0] else None
    gt = None
    if needs[1]:
        gt = gw_ * (-x if pw is None else (pw - 1) * sp - x)
    gwt = g * ((1 - t) * x + lw * sp) if needs[2] else None
    gpw = gw_ * t * sp if needs[3] else None
    return (gx, gt, gwt, gpw)


OP_BCE_LOGITS = defop("binary_cross_entropy_with_logits", _bce_kernel, _bce_meta, _bce_rule)


def binary_cross_entropy_with_logits(
    input: Tensor,
    target: Any,
    weight: Tensor | None = None,
    size_average: Any = None,
    reduce: Any = None,
    reduction: str = "mean",
    pos_weight: Tensor | None = None,
) -> Tensor:
    """Sigmoid + binary cross-entropy in one stable op (``F.binary_cross_entropy_with_logits``).

    ``pos_weight`` weighs positive examples (broadcast along the last dim, i.e. per class).
    """
    reduction = _reduction(size_average, reduce, reduction)
    _float_check("binary_cross_entropy_with_logits", input)
    if not isinstance(target, Tensor):
        target = np.asarray(target, dtype=input.dtype)
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(
            f"Target size ({tuple(target.shape)}) must be the same as input size ({tuple(input.shape)})"
        )
    loss = apply(OP_BCE_LOGITS, (input, target, weight, pos_weight))
    return _reduce(loss, reduction)


# ---- Tensor methods ------------------------------------------------------------------------------------


def _install() -> None:
    T = Tensor
    T.clamp = clamp  # type: ignore[attr-defined]
    T.clip = clamp  # type: ignore[attr-defined]
    T.clamp_min = clamp_min  # type: ignore[attr-defined]
    T.clamp_max = clamp_max  # type: ignore[attr-defined]
    T.gather = gather  # type: ignore[attr-defined]
    T.index_select = index_select  # type: ignore[attr-defined]
    T.cumsum = cumsum  # type: ignore[attr-defined]
    T.logsumexp = logsumexp  # type: ignore[attr-defined]
    T.var = var  # type: ignore[attr-defined]
    T.std = std  # type: ignore[attr-defined]


_install()
