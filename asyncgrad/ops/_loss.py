"""Losses with PyTorch's names, arguments and semantics: cross_entropy, nll_loss, mse_loss,
binary_cross_entropy(_with_logits), nn.functional's l1_loss, smooth_l1_loss, huber_loss and kl_div (composed
of elementwise ops), and the reduction helpers they share.

Speed-critical ones are single ops with fused numpy kernels (cross_entropy); every backward rule is written
against ``xp``, so all have second derivatives. Integer targets reach rules as numpy arrays through
``xp.value``.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..kernels._rows import row_max, row_sum
from ..runtime._dispatch import apply
from ..runtime._factories import tensor
from ..runtime._meta import _float_check, _index_arg, broadcast_shapes
from ..runtime._op import OpError, defop
from ..runtime._promote import result_type2
from ..runtime._tensor import Tensor
from ..runtime._xp import NP
from . import _elementwise as _ew
from ._convert import astype
from ._nn import log_softmax
from ._shape import reshape
from ._slices import SPLIT_MIN_ELEMENTS, run_slices, sliced_flat, slices

# ---- losses ----------------------------------------------------------------------------------------------


def legacy_reduction(size_average: Any, reduce: Any, reduction: str) -> str:
    if size_average is not None or reduce is not None:  # PyTorch's legacy arguments
        sa = True if size_average is None else size_average
        rd = True if reduce is None else reduce
        reduction = ("mean" if sa else "sum") if rd else "none"
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return reduction


def reduce_loss(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return loss.mean()  # type: ignore[attr-defined,no-any-return]
    if reduction == "sum":
        return loss.sum()  # type: ignore[attr-defined,no-any-return]
    return loss


def weighted_loss(loss: Tensor, weight: Tensor | None, input: Tensor, reduction: str, mean_by_weight: bool) -> Tensor:
    """Reduce an elementwise loss, weighted per element by ``weight`` if given (``mean_by_weight``: the
    weighted 'mean' divides by the sum of the weights, not by the count)."""
    if weight is None:
        return reduce_loss(loss, reduction)
    if tuple(weight.shape) != tuple(input.shape):
        raise ValueError("Weights and input must have the same size.")  # PyTorch's words
    wl = loss * weight
    if reduction == "mean" and mean_by_weight:
        return wl.sum() / weight.sum()  # type: ignore[attr-defined,no-any-return]
    return reduce_loss(wl, reduction)


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
    picked = np.empty(n, x.dtype)  # each row's shifted target logit
    s = np.empty((n, 1), x.dtype)  # each row's sum of exponentials

    def rows(lo: int, hi: int) -> None:
        pb = p[lo:hi]
        np.subtract(x[lo:hi], row_max(x[lo:hi]), out=pb)
        picked[lo:hi] = pb[np.arange(hi - lo), t[lo:hi]]
        np.exp(pb, out=pb)
        s[lo:hi] = row_sum(pb)
        pb /= s[lo:hi]

    # rows are independent: a big batch's rows run as slices an idle lane helps with (W9's LSTM, 700 x
    # 10000 logits: ~12 ms on one core); the loss sums the per-row terms afterwards, whoever ran them
    run_slices(rows, slices(n, 1, x.size >= SPLIT_MIN_ELEMENTS))
    buf[0] = (np.log(s).sum() - picked.sum()) / n
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
            gx = np.empty(p.shape, np.result_type(p, r))
            pf, gf = p.reshape(-1), gx.reshape(-1)
            sliced_flat(lambda lo, hi: np.multiply(pf[lo:hi], r, out=gf[lo:hi]), p.size)
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


# the output is saved: after the fast path it carries the softmax for the rule, which reads that and never
# the loss itself (`Op.save_out_side`)
OP_CROSS_ENTROPY = defop("cross_entropy", _ce_kernel, _ce_meta, _ce_rule, save_out=True, save_out_side=True)


def _as_batched(x: Tensor, target: Any) -> tuple[Tensor, Any, bool]:
    """(C,) input with a () target -> (1, C) and (1,), as PyTorch allows; says whether it did."""
    if x.ndim != 1:
        return x, target, False

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
    reduction = legacy_reduction(size_average, reduce, reduction)
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
        out = reshape(out, ())
    return out


def _cross_entropy_probs(x: Tensor, target: Any, weight: Any, reduction: str, ls: float) -> Tensor:
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
    return reduce_loss(loss, reduction)


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
    reduction = legacy_reduction(size_average, reduce, reduction)
    _float_check("nll_loss", input)
    if weight is not None:
        weight = weight.detach()
    x, t, unb = _as_batched(input, target)
    t = _class_targets("nll_loss", x, t)
    out = apply(OP_NLL_LOSS, (x, t, weight), {"ignore_index": int(ignore_index), "reduction": reduction})
    if unb and reduction == "none":
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
    """Mean squared error (``torch.nn.functional.mse_loss``; with ``weight``, 'mean' is sum(w*se)/sum(w)).

    A target of another shape broadcasts, with PyTorch's warning; one that is not a tensor is converted to
    the input's dtype.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    target = _loss_shapes("mse_loss", input, target)
    _needs_float("mse_cpu", input, target)
    d = input - target
    se = d * d
    return weighted_loss(se, weight, input, reduction, True)


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
    reduction = legacy_reduction(size_average, reduce, reduction)
    if input.dtype.kind not in "fc":  # PyTorch's words (its log_sigmoid refuses integers)
        raise NotImplementedError(f'"log_sigmoid_cpu" not implemented for {_torch_name(input.dtype)!r}')
    if not isinstance(target, Tensor):
        target = np.asarray(target, dtype=input.dtype)
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(
            f"Target size ({tuple(target.shape)}) must be the same as input size ({tuple(input.shape)})"
        )
    tdt = np.dtype(target.dtype)
    if tdt != input.dtype:
        # PyTorch computes into a tensor of the target's dtype: an integer one can't hold the loss, a float
        # one gives the loss its dtype
        if tdt.kind == "b":
            raise RuntimeError(
                "Subtraction, the `-` operator, with two bool tensors is not supported. "
                "Use the `^` or `logical_xor()` operator instead."
            )
        if tdt.kind not in "fc":
            raise RuntimeError(
                f"result type {_torch_name(result_type2(input, target))} can't be cast to the desired output "
                f"type {_torch_name(tdt)}"
            )
        input = astype(input, tdt)
    loss = apply(OP_BCE_LOGITS, (input, target, weight, pos_weight))
    return reduce_loss(loss, reduction)


def _bce_prob_meta(x: Any, t: Any, w: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if tuple(t.shape) != tuple(x.shape):
        raise OpError(f"binary_cross_entropy: target {tuple(t.shape)} and input {tuple(x.shape)} differ")
    if w is not None:
        np.broadcast_shapes(tuple(w.shape), tuple(x.shape))
    return tuple(x.shape), x.dtype


def _bce_prob_kernel(x: np.ndarray, t: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    if x.size and (np.any(x < 0) or np.any(x > 1) or np.any(np.isnan(x))):
        raise RuntimeError("all elements of input should be between 0 and 1")
    with np.errstate(divide="ignore"):
        lx = np.maximum(np.log(x), -100)
        l1x = np.maximum(np.log(1 - x), -100)
    loss = -(t * lx + (1 - t) * l1x)
    if w is not None:
        loss = loss * w
    return np.asarray(loss, x.dtype)


def _bce_prob_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, t, w = args
    gw = g if w is None else g * w
    gx = gt = None
    if needs[0]:  # torch: grad * (x - t) / max(x (1 - x), 1e-12)
        d = x * (1 - x)
        small = xp.value(d) < 1e-12
        gx = gw * (x - t) / xp.where(small, 1e-12, d)
    if needs[1]:  # torch: grad * (clamp(log(1 - x), -100) - clamp(log(x), -100))
        xv = xp.value(x)
        with np.errstate(divide="ignore"):
            lo = np.log(xv) < -100
            hi = np.log(1 - xv) < -100
        lx = xp.where(lo, -100.0, xp.log(xp.where(lo, 1.0, x)))
        l1x = xp.where(hi, -100.0, xp.log(xp.where(hi, 1.0, 1 - x)))
        gt = gw * (l1x - lx)
    return (gx, gt, None)


OP_BCE = defop("binary_cross_entropy", _bce_prob_kernel, _bce_prob_meta, _bce_prob_rule)


def binary_cross_entropy(
    input: Tensor,
    target: Any,
    weight: Tensor | None = None,
    size_average: Any = None,
    reduce: Any = None,
    reduction: str = "mean",
) -> Tensor:
    """Binary cross entropy of probabilities ``input`` in [0, 1] (each log is clamped at -100, as torch).

    Args:
        input: Probabilities.
        target: Same shape as ``input``, values in [0, 1]; differentiable.
        weight: Rescales each element's loss (broadcast to ``input``; not differentiated).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    if not isinstance(target, Tensor):
        target = tensor(np.asarray(target), dtype=input.dtype, device=input.device)
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(
            f"Using a target size ({tuple(target.shape)}) that is different to the input size "
            f"({tuple(input.shape)}) is deprecated. Please ensure they have the same size."
        )
    if target.dtype != input.dtype:  # PyTorch's kernel takes one dtype
        raise RuntimeError(f"Found dtype {_torch_name(target.dtype)} but expected {_torch_name(input.dtype)}")
    if input.dtype.kind not in "fc":
        raise NotImplementedError(f'"binary_cross_entropy" not implemented for {_torch_name(input.dtype)!r}')
    if weight is not None:
        weight = weight.detach()
    return reduce_loss(apply(OP_BCE, (input, target, weight)), reduction)


# ---- elementwise losses of nn.functional --------------------------------------------------------------


_TORCH_NAMES = {
    "float16": "Half",
    "bfloat16": "BFloat16",
    "float32": "Float",
    "float64": "Double",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
    "bool": "Bool",
    "int8": "Char",
    "uint8": "Byte",
    "int16": "Short",
    "int32": "Int",
    "int64": "Long",
}


def _torch_name(dtype: Any) -> str:
    """A dtype by PyTorch's scalar-type name (what its dtype errors say: 'Float', 'Long', ...)."""
    name = np.dtype(dtype).name
    return _TORCH_NAMES.get(name, name)


def _needs_float(kernel: str, input: Tensor, target: Tensor) -> None:
    """PyTorch's error for a loss kernel on integers or bools (an integer input with a float target is fine)."""
    dt = result_type2(input, target)
    if dt.kind not in "fc":
        raise NotImplementedError(f'"{kernel}" not implemented for {_torch_name(dt)!r}')


def _no_bool_sub(input: Tensor, target: Tensor) -> None:
    if input.dtype.kind == "b" or target.dtype.kind == "b":  # PyTorch's l1_loss subtracts
        raise RuntimeError(
            "Subtraction, the `-` operator, with a bool tensor is not supported. If you are trying to invert "
            "a mask, use the `~` or `logical_not()` operator instead."
        )


def _loss_shapes(op: str, input: Tensor, target: Any) -> Any:
    """``target`` as a tensor (converted to the input's dtype if it is not one), with PyTorch's warning when
    its shape differs from the input's (they broadcast)."""
    if not isinstance(target, Tensor):
        target = tensor(np.asarray(target), dtype=input.dtype, device=input.device)
    if tuple(target.shape) != tuple(input.shape):
        warnings.warn(
            f"Using a target size ({tuple(target.shape)}) that is different to the input size "
            f"({tuple(input.shape)}). This will likely lead to incorrect results due to broadcasting. "
            "Please ensure they have the same size.",
            stacklevel=3,
        )
        _check_broadcast(tuple(input.shape), tuple(target.shape))
    return target


def _check_broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    """PyTorch's error (``torch.broadcast_tensors``) for shapes that don't broadcast, from the last dim."""
    n = max(len(a), len(b))
    for i in range(n - 1, -1, -1):
        da = a[i - n + len(a)] if i >= n - len(a) else 1
        db = b[i - n + len(b)] if i >= n - len(b) else 1
        if da != db and da != 1 and db != 1:
            raise RuntimeError(
                f"The size of tensor a ({da}) must match the size of tensor b ({db}) at non-singleton "
                f"dimension {i}"
            )


def l1_loss(
    input: Tensor,
    target: Any,
    size_average: Any = None,
    reduce: Any = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
) -> Tensor:
    """Mean absolute error ``|input - target|`` (with ``weight``, 'mean' is ``sum(w*|d|) / sum(w)``)."""
    reduction = legacy_reduction(size_average, reduce, reduction)
    target = _loss_shapes("l1_loss", input, target)
    _no_bool_sub(input, target)
    return weighted_loss(_ew.abs(input - target), weight, input, reduction, True)


def smooth_l1_loss(
    input: Tensor,
    target: Any,
    size_average: Any = None,
    reduce: Any = None,
    reduction: str = "mean",
    beta: float = 1.0,
) -> Tensor:
    """``0.5 d^2 / beta`` where ``|d| < beta``, else ``|d| - 0.5 beta`` (``d = input - target``)."""
    reduction = legacy_reduction(size_average, reduce, reduction)
    if beta < 0:
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")
    target = _loss_shapes("smooth_l1_loss", input, target)
    if beta == 0.0:  # PyTorch's l1_loss then
        _no_bool_sub(input, target)
    else:
        _needs_float("smooth_l1_cpu", input, target)
    d = input - target
    ad = _ew.abs(d)
    if beta == 0.0:
        return reduce_loss(ad, reduction)
    loss = _ew.where(ad < beta, d * d * (0.5 / beta), ad - 0.5 * beta)
    return reduce_loss(loss, reduction)


def huber_loss(
    input: Tensor, target: Any, reduction: str = "mean", delta: float = 1.0, weight: Tensor | None = None
) -> Tensor:
    """``0.5 d^2`` where ``|d| < delta``, else ``delta (|d| - 0.5 delta)`` (with ``weight``: mean of ``w*l``)."""
    reduction = legacy_reduction(None, None, reduction)
    if delta <= 0:
        raise RuntimeError("huber_loss does not support non-positive values for delta.")
    target = _loss_shapes("huber_loss", input, target)
    _needs_float("huber_cpu", input, target)
    if target.dtype != input.dtype:  # PyTorch's huber_loss computes into a tensor of the input's dtype
        if input.dtype.kind not in "fc":
            raise RuntimeError(
                f"result type {_torch_name(result_type2(input, target))} can't be cast to the desired output "
                f"type {_torch_name(input.dtype)}"
            )
        target = astype(target, input.dtype)
    d = input - target
    ad = _ew.abs(d)
    loss = _ew.where(ad < delta, d * d * 0.5, (ad - 0.5 * delta) * delta)
    return weighted_loss(loss, weight, input, reduction, False)


def _xlogy_self(t: Tensor) -> Tensor:
    zero = t == 0
    return _ew.where(zero, 0.0, t * _ew.log(_ew.where(zero, 1.0, t)))


def kl_div(
    input: Tensor,
    target: Any,
    size_average: Any = None,
    reduce: Any = None,
    reduction: str = "mean",
    log_target: bool = False,
) -> Tensor:
    """KL divergence ``target * (log(target) - input)`` of log-probabilities ``input``.

    Args:
        input: Log-probabilities.
        target: Probabilities (or log-probabilities with ``log_target=True``); differentiable.
        reduction: ``"mean"`` (over all elements, as torch), ``"batchmean"`` (sum / batch size, the
            mathematically correct KL), ``"sum"`` or ``"none"``.
        log_target: Whether ``target`` holds log-probabilities.
    """
    if reduction == "batchmean":
        if size_average is not None or reduce is not None:
            reduction = legacy_reduction(size_average, reduce, "mean")
    else:
        reduction = legacy_reduction(size_average, reduce, reduction)
    if reduction == "mean":
        warnings.warn(
            "reduction: 'mean' divides the total loss by both the batch size and the support size."
            "'batchmean' divides only by the batch size, and aligns with the KL div math definition."
            "'mean' will be changed to behave the same as 'batchmean' in the next major release.",
            stacklevel=2,
        )
    if not isinstance(target, Tensor):
        target = tensor(np.asarray(target), dtype=input.dtype, device=input.device)
    if log_target:
        loss = _ew.exp(target) * (target - input)
    else:
        loss = _xlogy_self(target) - target * input
    if reduction == "batchmean":
        if input.ndim == 0:
            return loss.sum()  # type: ignore[attr-defined,no-any-return]
        return loss.sum() / input.shape[0]  # type: ignore[attr-defined,no-any-return]
    return reduce_loss(loss, reduction)
