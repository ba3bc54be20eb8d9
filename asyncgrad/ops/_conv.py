"""Convolution and pooling: conv2d, max_pool2d, avg_pool2d (PyTorch's ``torch.nn.functional`` semantics).

Kernels use numpy stride tricks: a padded input is viewed as its sliding windows (``as_strided``), the
windows are copied once into an im2col matrix and multiplied with the weights by one (batched over
groups) ``matmul``. Depthwise convolutions and pooling run as kh * kw vectorised operations over strided
views (one per kernel *tap*), and so do the adjoints that scatter back into the input (col2im, pooling
backward): Python loops run over taps, never over pixels.

Layouts: NCHW arrays and channels-last ones (an NHWC buffer viewed as NCHW through permuted strides) both
work; a channels-last input gives a channels-last output and channels-last gradients, so AccumulateGrad
can steal them (the layout contract).

Backward rules are written once against ``xp``; the adjoint kernels are themselves differentiable ops
(``conv2d_input_grad`` / ``conv2d_weight_grad``, the pooling scatters and gathers), so
``create_graph=True`` gives second derivatives.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..runtime._dispatch import apply
from ..runtime._op import OpError, defop
from ..runtime._tensor import Tensor
from ..runtime._xp import NP, register_xp
from ._shape import reshape
from ._slices import SPLIT_MIN_ELEMENTS, run_slices, slices

Geom = dict[str, Any]


# ---- argument normalisation ----------------------------------------------------------------------------


def _pair(name: str, what: str, v: Any) -> tuple[int, int]:
    if isinstance(v, (int, np.integer)):
        return int(v), int(v)
    t = tuple(int(i) for i in v)
    if len(t) == 1:
        return t[0], t[0]
    if len(t) != 2:
        raise OpError(f"{name}: {what} must be an int or a pair of ints, got {v!r}")
    return t  # type: ignore[return-value]


def _channels_last(a: Any) -> bool:
    """Is a 4-d array laid out NHWC in memory (channels-last), i.e. is C its fastest dim?"""
    if a.ndim != 4 or a.shape[1] == 1:
        return False
    _, sc, sh, sw = (abs(s) for s in a.strides)
    h, w = a.shape[2:]
    return sc < (sw if w > 1 else np.inf) and sc < (sh if h > 1 else np.inf)


def _empty(shape: tuple[int, ...], dtype: Any, cl: bool) -> np.ndarray:
    """An NCHW-indexed buffer, channels-last in memory when ``cl``."""
    if cl:
        n, c, h, w = shape
        return np.empty((n, h, w, c), dtype).transpose(0, 3, 1, 2)
    return np.empty(shape, dtype)


def _zeros(shape: tuple[int, ...], dtype: Any, cl: bool) -> np.ndarray:
    out = _empty(shape, dtype, cl)
    out.fill(0)
    return out


def _pad(x: np.ndarray, pad: tuple[int, int, int, int], value: Any) -> np.ndarray:
    """``x`` padded on H by (top, bottom) and on W by (left, right), keeping its memory layout."""
    pt, pb, pl, pr = pad
    if not (pt or pb or pl or pr):
        return x
    n, c, h, w = x.shape
    buf = _empty((n, c, h + pt + pb, w + pl + pr), x.dtype, _channels_last(x))
    buf.fill(value)
    buf[:, :, pt : pt + h, pl : pl + w] = x
    return buf


def _tap(a: np.ndarray, i: int, j: int, geom: Geom, ho: int, wo: int) -> np.ndarray:
    """The (N, C, Ho, Wo) strided view of padded ``a`` that kernel tap (i, j) reads (or writes)."""
    (sh, sw), (dh, dw) = geom["stride"], geom["dilation"]
    return a[..., i * dh : i * dh + sh * (ho - 1) + 1 : sh, j * dw : j * dw + sw * (wo - 1) + 1 : sw]


def _out_size(n: int, k: int, s: int, p_lo: int, p_hi: int, d: int) -> int:
    return (n + p_lo + p_hi - d * (k - 1) - 1) // s + 1


# ---- conv2d kernels --------------------------------------------------------------------------------------
#
# The kernels work in NHWC whatever the caller's layout: the padded input is built channels-last, so each
# im2col row (kh, kw, C/G) copies contiguous runs of channels, and the GEMM output (N*Ho*Wo, O) is already
# a channels-last result. An NCHW caller pays one extra copy of the input and of the output.


def _nhwc_padded(x: np.ndarray, pad: tuple[int, int, int, int]) -> np.ndarray:
    """``x`` (N, C, H, W) as a padded (N, H + pt + pb, W + pl + pr, C) array with C fastest."""
    pt, pb, pl, pr = pad
    xt = x.transpose(0, 2, 3, 1)
    if not (pt or pb or pl or pr):
        return xt if _channels_last(x) or x.shape[1] == 1 else np.ascontiguousarray(xt)
    n, c, h, w = x.shape
    buf = np.empty((n, h + pt + pb, w + pl + pr, c), x.dtype)
    buf[:, :pt] = 0
    buf[:, pt + h :] = 0
    buf[:, pt : pt + h, :pl] = 0
    buf[:, pt : pt + h, pl + w :] = 0
    buf[:, pt : pt + h, pl : pl + w] = xt
    return buf


def _cols(x: np.ndarray, kh: int, kw: int, geom: Geom, ho: int, wo: int) -> np.ndarray:
    """im2col: (G, N*Ho*Wo, K), K ordered (kh, kw, C/G)."""
    g = geom["groups"]
    n, c = x.shape[:2]
    xp_ = _nhwc_padded(x, geom["padding"])
    sn, sh, sw, sc = xp_.strides
    (st_h, st_w), (dh, dw) = geom["stride"], geom["dilation"]
    cg = c // g
    if g == 1 and c < 4:  # few channels: copying tap by tap gives longer contiguous runs
        cols = np.empty((n, ho, wo, kh, kw, c), x.dtype)
        for i in range(kh):
            for j in range(kw):
                cols[:, :, :, i, j] = _tap_nhwc(xp_, i, j, geom["stride"], geom["dilation"], ho, wo)
        return cols.reshape(1, n * ho * wo, kh * kw * c)
    win = as_strided(
        xp_,
        (g, n, ho, wo, kh, kw, cg),
        (sc * cg, sn, sh * st_h, sw * st_w, sh * dh, sw * dw, sc),
        writeable=False,
    )
    return win.reshape(g, n * ho * wo, kh * kw * cg)


def _wmat(w: np.ndarray, groups: int) -> np.ndarray:
    """Weights (O, C/G, kh, kw) as (G, O/G, K), K in the im2col order (kh, kw, C/G)."""
    o, cg, kh, kw = w.shape
    return w.transpose(0, 2, 3, 1).reshape(groups, o // groups, kh * kw * cg)


def _gmat(g: np.ndarray, groups: int) -> np.ndarray:
    """Output gradient (N, O, Ho, Wo) as (G, N*Ho*Wo, O/G)."""
    n, o, ho, wo = g.shape
    gt = g.transpose(0, 2, 3, 1)
    if groups == 1:
        return gt.reshape(1, n * ho * wo, o)
    return gt.reshape(n * ho * wo, groups, o // groups).transpose(1, 0, 2)


def _unpack(geom: Geom) -> tuple[Any, Any, Any, int]:
    """A conv op's ``geom`` (its one keyword argument): ``(stride, padding, dilation, groups)``."""
    return geom["stride"], geom["padding"], geom["dilation"], geom["groups"]


def conv2d_kernel(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, geom: Geom) -> np.ndarray:
    stride, padding, dilation, groups = _unpack(geom)
    n, _, h, wd = x.shape
    o, _, kh, kw = w.shape
    pt, pb, pl, pr = padding
    ho = _out_size(h, kh, stride[0], pt, pb, dilation[0])
    wo = _out_size(wd, kw, stride[1], pl, pr, dilation[1])
    dt = np.result_type(x.dtype, w.dtype)
    cl = _channels_last(x)
    if _nchw_blocked(x.shape[1], groups, ho, wo, cl):
        return _nchw_forward(x, w, b, geom, ho, wo, dt)
    if _is_depthwise(w, groups):
        src = _depthwise_forward(x, w, geom, ho, wo).transpose(0, 3, 1, 2)
    else:
        cols = _cols(x, kh, kw, geom, ho, wo)
        wm = _wmat(w, groups)
        if groups == 1:
            res = cols[0] @ wm[0].T  # (N*Ho*Wo, O): channels-last already
            src = res.reshape(n, ho, wo, o).transpose(0, 3, 1, 2)
        else:
            res = np.matmul(cols, wm.transpose(0, 2, 1))  # (G, N*Ho*Wo, O/G)
            src = res.reshape(groups, n, ho, wo, o // groups).transpose(1, 0, 4, 2, 3)
    if cl and src.ndim == 4 and src.dtype == dt:  # already a channels-last buffer of our own
        if b is not None:
            src += b.reshape(1, o, 1, 1)
        return src
    out = _empty((n, o, ho, wo), dt, cl)
    ov = out.reshape(src.shape)  # splitting C into (G, O/G) is always a view
    assert ov.base is out or ov.base is out.base
    if b is not None:
        np.add(src, b.reshape(*src.shape[1:-2], 1, 1), out=ov)
    else:
        np.copyto(ov, src)
    return out


# An NCHW input (not grouped) runs image block by image block instead: per image, weights (O, K) @ columns
# (K, Ho*Wo), K = C*kh*kw ordered (C, kh, kw) as the weights are. A block's columns stay in the L2 cache
# between the copy that builds them and the GEMM that reads them (the whole batch's im2col matrix, 42 MB for
# W9's MNIST conv2, went through memory twice), the products land in NCHW order (no (N*Ho*Wo, O) result to
# transpose) and the backward products col2im / sum block by block the same way. Measured on W9's conv2
# (64x32x26x26, 3x3 -> 64), one BLAS thread: forward 33 -> 19 ms, input grad 35 -> 24 ms, weight grad
# 29 -> 21 ms. Small images (few pixels per image: a thin GEMM) keep the whole-batch NHWC GEMM.

_BLOCK_BYTES = 3 << 18  # the columns of one image block: 768 KiB, inside a 1 MiB L2 with room for the rest
_MIN_PIXELS = 256  # output pixels per image below which the per-image GEMM gets too thin


def _nchw_blocked(c: int, groups: int, ho: int, wo: int, cl: bool) -> bool:
    """Does a convolution with ``c`` input channels run `_nchw_forward` and its blocked adjoints?"""
    return groups == 1 and not cl and (c < 4 or ho * wo >= _MIN_PIXELS)


def _block(n: int, per_image: int) -> int:
    """Images per block: as many as keep ``per_image`` bytes each within `_BLOCK_BYTES`, at least one."""
    return max(1, min(n, _BLOCK_BYTES // max(1, per_image)))


def _nchw_windows(x: np.ndarray, kh: int, kw: int, geom: Geom, ho: int, wo: int) -> np.ndarray:
    """The (N, C, kh, kw, Ho, Wo) strided view of padded NCHW ``x`` that im2col copies."""
    xp_ = _pad(x, geom["padding"], 0)
    sn, sc, sh, sw = xp_.strides
    (st_h, st_w), (dh, dw) = geom["stride"], geom["dilation"]
    n, c = x.shape[:2]
    return as_strided(
        xp_, (n, c, kh, kw, ho, wo), (sn, sc, sh * dh, sw * dw, sh * st_h, sw * st_w), writeable=False
    )


# A big blocked kernel runs as a few slices of whole image blocks (`_slices`): each image's products are the
# same whichever lane runs them, and the weight gradient sums the slices' partial sums in slice order.

_SPLIT_MIN_MACS = 48_000_000  # multiply-adds below which a kernel runs as one slice (~1 ms on one core)


def _image_slices(n: int, step: int, macs: int) -> list[tuple[int, int]]:
    """The image ranges [lo, hi) a blocked kernel of ``macs`` multiply-adds runs as separate slices."""
    return slices(n, step, macs >= _SPLIT_MIN_MACS)


def _nchw_forward(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, geom: Geom, ho: int, wo: int, dt: Any
) -> np.ndarray:
    n = x.shape[0]
    o, c, kh, kw = w.shape
    k, p = c * kh * kw, ho * wo
    win = _nchw_windows(x, kh, kw, geom, ho, wo)
    wm = np.ascontiguousarray(w.reshape(o, k), dtype=dt)
    out = np.empty((n, o, p), dt)
    step = _block(n, k * p * dt.itemsize)
    bias = None if b is None else b.reshape(o, 1)

    def images(lo: int, hi: int) -> None:
        buf = np.empty((min(step, hi - lo), c, kh, kw, ho, wo), dt)
        for s in range(lo, hi, step):
            e = min(hi, s + step)
            cols = buf[: e - s]
            np.copyto(cols, win[s:e])
            ob = out[s:e]
            np.matmul(wm, cols.reshape(e - s, k, p), out=ob)
            if bias is not None:
                ob += bias

    run_slices(images, _image_slices(n, step, n * o * k * p))
    return out.reshape(n, o, ho, wo)


def _nchw_input_grad(
    g: np.ndarray, w: np.ndarray, x_shape: tuple[int, ...], geom: Geom, dt: Any
) -> np.ndarray:
    """col2im block by block: columns (K, Ho*Wo) = weights^T (K, O) @ g (O, Ho*Wo) per image, each tap's
    rows added into its strided view of the (padded) block of the input gradient."""
    n, c, h, wd = x_shape
    o, _, kh, kw = w.shape
    ho, wo = g.shape[2:]
    pt, pb, pl, pr = geom["padding"]
    padded = bool(pt or pb or pl or pr)
    k, p = c * kh * kw, ho * wo
    wt = np.ascontiguousarray(w.reshape(o, k).T, dtype=dt)
    gm = g.reshape(n, o, p)
    dx = np.empty(x_shape, dt)
    step = _block(n, (k * p + (c * (h + pt + pb) * (wd + pl + pr) if padded else 0)) * dt.itemsize)

    def images(lo: int, hi: int) -> None:
        m_max = min(step, hi - lo)
        dbuf = np.empty((m_max, k, p), dt)
        pbuf = np.empty((m_max, c, h + pt + pb, wd + pl + pr), dt) if padded else None
        for s in range(lo, hi, step):
            e = min(hi, s + step)
            d = np.matmul(wt, gm[s:e], out=dbuf[: e - s]).reshape(e - s, c, kh, kw, ho, wo)
            dst = dx[s:e] if pbuf is None else pbuf[: e - s]
            dst.fill(0)
            for i in range(kh):
                for j in range(kw):
                    _tap(dst, i, j, geom, ho, wo)[...] += d[:, :, i, j]
            if pbuf is not None:
                np.copyto(dx[s:e], dst[:, :, pt : pt + h, pl : pl + wd])

    run_slices(images, _image_slices(n, step, n * o * k * p))
    return dx


def _nchw_input_grad_wide(
    g: np.ndarray, w: np.ndarray, x_shape: tuple[int, ...], geom: Geom, dt: Any
) -> np.ndarray:
    """`_nchw_input_grad` for stride 1, without its short rows: ``g`` widened to the padded input's width Wp
    (zeros past Wo) makes every tap's block of the product one (C, Ho*Wp) run that lands, shifted by the
    tap's offset, on the flat (C, Hp*Wp) image (the zeros of the widened g add nothing where a run wraps
    into the next row). 8% more GEMM work for W9's conv2 (Wp / Wo = 26 / 24), and a third less time than
    adding short rows.

    The product's rows sit in a buffer with zeros around each, so all the taps' shifted runs
    are one strided view, and col2im is one sum over its tap axes per block instead of a read-add-write pass
    per tap (W9's conv2, one thread: 22.3 -> 18.6 ms)."""
    n, c, h, wd = x_shape
    o, _, kh, kw = w.shape
    ho, wo = g.shape[2:]
    pt, pb, pl, pr = geom["padding"]
    dh, dw = geom["dilation"]
    hp, wp = h + pt + pb, wd + pl + pr
    padded = bool(pt or pb or pl or pr)
    p = ho * wp
    kk = kh * kw * c
    lead = (kh - 1) * dh * wp + (kw - 1) * dw  # the largest tap offset: zeros before each product row
    rl = lead + hp * wp  # a product row with its zeros: every tap's shifted read of it stays inside
    wt = np.ascontiguousarray(w.transpose(2, 3, 1, 0).reshape(kk, o), dtype=dt)  # rows (kh, kw, C)
    step = _block(n, (kk * rl + o * p + (c * hp * wp if padded else 0)) * dt.itemsize)
    dx = np.empty(x_shape, dt)
    sz = dt.itemsize

    def images(lo: int, hi: int) -> None:
        m_max = min(step, hi - lo)
        gw = np.zeros((m_max, o, ho, wp), dt)
        rows = np.zeros(m_max * kk * rl, dt)  # the GEMM writes only the middle of each row: the rest stays 0
        prod = as_strided(rows[lead:], (m_max, kk, p), (kk * rl * sz, rl * sz, sz))
        # element (m, i, j, c, t): row (i, j, c) of image m read at t - (tap (i, j)'s offset in the flat image)
        taps = as_strided(
            rows[lead:],
            (m_max, kh, kw, c, hp * wp),
            (kk * rl * sz, (kw * c * rl - dh * wp) * sz, (c * rl - dw) * sz, rl * sz, sz),
            writeable=False,
        )
        pbuf = np.empty((m_max, c, hp * wp), dt) if padded else None
        for s in range(lo, hi, step):
            e = min(hi, s + step)
            m = e - s
            np.copyto(gw[:m, :, :, :wo], g[s:e])
            np.matmul(wt, gw[:m].reshape(m, o, p), out=prod[:m])
            dst = dx[s:e].reshape(m, c, h * wd) if pbuf is None else pbuf[:m]
            np.sum(taps[:m], axis=(1, 2), out=dst)
            if pbuf is not None:
                np.copyto(dx[s:e], pbuf[:m].reshape(m, c, hp, wp)[:, :, pt : pt + h, pl : pl + wd])

    run_slices(images, _image_slices(n, step, n * o * kk * p))
    return dx


def _nchw_weight_grad(x: np.ndarray, g: np.ndarray, w_shape: tuple[int, ...], geom: Geom, dt: Any) -> np.ndarray:
    """Per image columns (K, Ho*Wo) @ g^T (Ho*Wo, O), summed over the images block by block, then over the
    slices in order. (K, O) is the product OpenBLAS runs faster than (O, K) = g @ columns^T here: W9's
    conv2 22.7 -> 18.9 ms, same sums.)"""
    n = x.shape[0]
    o, c, kh, kw = w_shape
    ho, wo = g.shape[2:]
    k, p = c * kh * kw, ho * wo
    win = _nchw_windows(x, kh, kw, geom, ho, wo)
    gm = g.reshape(n, o, p)
    step = _block(n, k * p * dt.itemsize)

    def images(lo: int, hi: int) -> np.ndarray:
        m_max = min(step, hi - lo)
        buf = np.empty((m_max, c, kh, kw, ho, wo), dt)
        part = np.empty((m_max, k, o), dt)
        dwt = np.zeros((k, o), dt)
        for s in range(lo, hi, step):
            e = min(hi, s + step)
            cols = buf[: e - s]
            np.copyto(cols, win[s:e])
            prod = np.matmul(cols.reshape(e - s, k, p), gm[s:e].transpose(0, 2, 1), out=part[: e - s])
            dwt += prod.sum(0) if e - s > 1 else prod[0]
        return dwt

    sums = run_slices(images, _image_slices(n, step, n * o * k * p))
    dwt = sums[0]
    for part in sums[1:]:
        dwt += part
    return np.ascontiguousarray(dwt.T).reshape(w_shape)


# Depthwise convolutions (groups == in_channels == out_channels) have too little work per group for an
# im2col GEMM; they run as kh * kw multiply-accumulates over NHWC views instead.


def _is_depthwise(w: np.ndarray, groups: int) -> bool:
    return groups > 1 and w.shape[0] == groups and w.shape[1] == 1


def _tap_nhwc(a: np.ndarray, i: int, j: int, stride: Any, dilation: Any, ho: int, wo: int) -> np.ndarray:
    (sh, sw), (dh, dw) = stride, dilation
    return a[:, i * dh : i * dh + sh * (ho - 1) + 1 : sh, j * dw : j * dw + sw * (wo - 1) + 1 : sw]


def _depthwise_forward(x: np.ndarray, w: np.ndarray, geom: Geom, ho: int, wo: int) -> np.ndarray:
    xp_ = _nhwc_padded(x, geom["padding"])
    kh, kw = w.shape[2:]
    wt = w[:, 0].transpose(1, 2, 0)  # (kh, kw, C)
    dt = np.result_type(x.dtype, w.dtype)
    acc = np.zeros((x.shape[0], ho, wo, x.shape[1]), dt)
    tmp = np.empty_like(acc)
    for i in range(kh):
        for j in range(kw):
            np.multiply(_tap_nhwc(xp_, i, j, geom["stride"], geom["dilation"], ho, wo), wt[i, j], out=tmp)
            acc += tmp
    return acc


def conv2d_input_grad_kernel(
    g: np.ndarray, w: np.ndarray, x_shape: tuple[int, ...], geom: Geom, cl: bool = False
) -> np.ndarray:
    """col2im: the adjoint of ``x -> conv2d(x, w)`` applied to ``g`` (a transposed convolution).

    The result is channels-last when ``cl`` (the input's layout), else NCHW.
    """
    stride, padding, dilation, groups = _unpack(geom)
    n, c, h, wd = x_shape
    _, cg, kh, kw = w.shape
    ho, wo = g.shape[2:]
    pt, pb, pl, pr = padding
    dt = np.result_type(g.dtype, w.dtype)
    if _nchw_blocked(c, groups, ho, wo, cl):
        if tuple(stride) == (1, 1):
            return _nchw_input_grad_wide(g, w, tuple(x_shape), geom, dt)
        return _nchw_input_grad(g, w, tuple(x_shape), geom, dt)
    dxp = np.zeros((n, h + pt + pb, wd + pl + pr, c), dt)
    if _is_depthwise(w, groups):
        gt = np.ascontiguousarray(g.transpose(0, 2, 3, 1))
        wt = w[:, 0].transpose(1, 2, 0)
        tmp = np.empty(gt.shape, dt)
        for i in range(kh):
            for j in range(kw):
                np.multiply(gt, wt[i, j], out=tmp)
                _tap_nhwc(dxp, i, j, stride, dilation, ho, wo)[...] += tmp
    elif groups == 1:
        # one GEMM per tap, (N*Ho*Wo, O) @ (O, C): each tap's block is contiguous, so the adds below
        # run over long contiguous rows
        gm = _gmat(g, 1)[0]
        wt = w.transpose(2, 3, 0, 1).reshape(kh * kw, w.shape[0], c)
        dcols = np.matmul(gm, wt).reshape(kh, kw, n, ho, wo, c)
        for i in range(kh):
            for j in range(kw):
                _tap_nhwc(dxp, i, j, stride, dilation, ho, wo)[...] += dcols[i, j]
    else:
        dcols = np.matmul(_gmat(g, groups), _wmat(w, groups))  # (G, N*Ho*Wo, K)
        dcols = dcols.reshape(groups, n, ho, wo, kh, kw, cg).transpose(1, 2, 3, 4, 5, 0, 6)
        d5 = dxp.reshape(n, h + pt + pb, wd + pl + pr, groups, cg)  # a view: (N, Hp, Wp, G, Cg)
        for i in range(kh):
            for j in range(kw):
                _tap_nhwc(d5, i, j, stride, dilation, ho, wo)[...] += dcols[:, :, :, i, j]
    crop = dxp[:, pt : pt + h, pl : pl + wd].transpose(0, 3, 1, 2)
    if cl and not (pt or pb or pl or pr):
        return crop
    dx = _empty((n, c, h, wd), dt, cl)
    np.copyto(dx, crop)
    return dx


def conv2d_weight_grad_kernel(x: np.ndarray, g: np.ndarray, w_shape: tuple[int, ...], geom: Geom) -> np.ndarray:
    """The weight gradient of conv2d: im2col(x)^T applied to ``g``, per group (channels-last result)."""
    stride, padding, dilation, groups = _unpack(geom)
    o, cg, kh, kw = w_shape
    ho, wo = g.shape[2:]
    dt = np.result_type(x.dtype, g.dtype)
    if groups > 1 and o == groups and cg == 1:  # depthwise: one reduction per tap
        xp_ = _nhwc_padded(x, padding)
        gt = np.ascontiguousarray(g.transpose(0, 2, 3, 1))
        tmp = np.empty(gt.shape, dt)
        dw = np.empty((kh, kw, o), dt)
        for i in range(kh):
            for j in range(kw):
                np.multiply(_tap_nhwc(xp_, i, j, stride, dilation, ho, wo), gt, out=tmp)
                tmp.sum((0, 1, 2), out=dw[i, j])
        return dw.transpose(2, 0, 1)[:, None]
    if _nchw_blocked(x.shape[1], groups, ho, wo, _channels_last(x)):
        return _nchw_weight_grad(x, g, tuple(w_shape), geom, dt)
    cols = _cols(x, kh, kw, geom, ho, wo)
    gm = _gmat(g, groups)
    dw = np.matmul(gm.transpose(0, 2, 1), cols)  # (G, O/G, K)
    return dw.reshape(o, kh, kw, cg).transpose(0, 3, 1, 2).astype(dt, copy=False)


# ---- conv2d ops ---------------------------------------------------------------------------------------


def _conv_meta(x: Any, w: Any, b: Any, geom: Geom) -> Any:
    stride, padding, dilation, groups = _unpack(geom)
    if not isinstance(w, Tensor):
        raise TypeError(f"conv2d: weight must be a Tensor, got {type(w).__name__}")
    if x.ndim != 4:
        raise OpError(f"conv2d: expected a 3-d (C, H, W) or 4-d (N, C, H, W) input, got shape {x.shape}")
    if w.ndim != 4:
        raise OpError(
            f"conv2d: expected a 4-d weight (out_channels, in_channels/groups, kH, kW), got {w.shape}"
        )
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    if groups < 1 or c % groups or o % groups:
        raise OpError(
            f"conv2d: in_channels ({c}) and out_channels ({o}) must both be divisible by groups ({groups})"
        )
    if cg * groups != c:
        raise OpError(
            f"conv2d: input of shape {x.shape} has {c} channels but weight of shape {w.shape} expects "
            f"{cg * groups} (in_channels/groups = {cg}, groups = {groups})"
        )
    if b is not None and (not isinstance(b, Tensor) or b.shape != (o,)):
        raise OpError(f"conv2d: bias must be a Tensor of shape ({o},), got {getattr(b, 'shape', b)!r}")
    pt, pb, pl, pr = padding
    ho = _out_size(h, kh, stride[0], pt, pb, dilation[0])
    wo = _out_size(wd, kw, stride[1], pl, pr, dilation[1])
    if ho < 1 or wo < 1:
        raise OpError(
            f"conv2d: input of shape {x.shape} (padded to {(h + pt + pb, wd + pl + pr)}) is smaller than the "
            f"dilated kernel {(dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1)}"
        )
    for t in (x, w, b):
        if t is not None and t.dtype.kind not in "fc":
            raise OpError(f"conv2d: expected floating point tensors, got dtype {t.dtype}")
    return (n, o, ho, wo), np.result_type(x.dtype, w.dtype)


def _conv_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x, w, _ = args
    geom = kw["geom"]
    gx = gw = gb = None
    if needs[0]:
        gx = xp.conv2d_input_grad(g, w, x, geom)
    if needs[1]:
        gw = xp.conv2d_weight_grad(x, g, tuple(w.shape), geom)
    if needs[2]:
        gb = xp.sum(g, (0, 2, 3))
    return (gx, gw, gb)


def _cig_meta(g: Any, w: Any, x_shape: Any, geom: Geom, cl: bool = False) -> Any:
    return tuple(x_shape), np.result_type(g.dtype, w.dtype)


def _cig_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # out = A_w^T gy (linear in gy and in w); g has the input's shape
    gy, w = args
    geom = kw["geom"]
    d_gy = xp.conv2d(g, w, None, geom) if needs[0] else None
    d_w = xp.conv2d_weight_grad(g, gy, tuple(w.shape), geom) if needs[1] else None
    return (d_gy, d_w)


def _cwg_meta(x: Any, g: Any, w_shape: Any, geom: Geom) -> Any:
    return tuple(w_shape), np.result_type(x.dtype, g.dtype)


def _cwg_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    # out = dW(x, gy) (bilinear); g has the weight's shape
    x, gy = args
    geom = kw["geom"]
    d_x = xp.conv2d_input_grad(gy, g, x, geom) if needs[0] else None
    d_gy = xp.conv2d(x, g, None, geom) if needs[1] else None
    return (d_x, d_gy)


# multiply-adds of a run (`Op.work`): beside other trainings a small convolution runs inline within a bound


def _per_tap(w: Tensor) -> int:
    return math.prod(w._shape) // max(1, w._shape[0])  # C/groups x kh x kw


def _conv_work(args: tuple[Any, ...], n: int, kw: dict[str, Any]) -> int:
    return n * _per_tap(args[1])  # conv2d (x, w, b): each output element sums C/groups x kh x kw products


def _cig_work(args: tuple[Any, ...], n: int, kw: dict[str, Any]) -> int:
    return math.prod(args[0]._shape) * _per_tap(args[1])  # (g, w): each element of g spreads over a window


def _cwg_work(args: tuple[Any, ...], n: int, kw: dict[str, Any]) -> int:
    g = args[1]  # (x, g): each of the n weight elements sums over N x Ho x Wo products
    return n * (math.prod(g._shape) // max(1, g._shape[1]))


OP_CONV2D = defop("conv2d", conv2d_kernel, _conv_meta, _conv_rule, work=_conv_work)
OP_CONV2D_INPUT_GRAD = defop(
    "conv2d_input_grad", conv2d_input_grad_kernel, _cig_meta, _cig_rule, work=_cig_work
)
OP_CONV2D_WEIGHT_GRAD = defop(
    "conv2d_weight_grad", conv2d_weight_grad_kernel, _cwg_meta, _cwg_rule, work=_cwg_work
)


# the functions the rule namespaces (`_xp.NP` / `_xp.AG`) expose


def _layout_of(x: Any) -> bool:
    """Channels-last? for a numpy array, or a Tensor whose value is already there (else assume NCHW)."""
    if isinstance(x, Tensor):
        x = x._data
        if x is None:
            return False
    return _channels_last(x)


def np_conv2d_input_grad(g: Any, w: Any, x: Any, geom: Geom) -> np.ndarray:
    return conv2d_input_grad_kernel(g, w, tuple(x.shape), geom, _channels_last(x))


def ag_conv2d(x: Tensor, w: Tensor, b: Tensor | None, geom: Geom) -> Tensor:
    return apply(OP_CONV2D, (x, w, b), {"geom": geom})


def ag_conv2d_input_grad(g: Tensor, w: Tensor, x: Any, geom: Geom) -> Tensor:
    return apply(OP_CONV2D_INPUT_GRAD, (g, w), {"x_shape": tuple(x.shape), "geom": geom, "cl": _layout_of(x)})


def ag_conv2d_weight_grad(x: Tensor, g: Tensor, w_shape: Any, geom: Geom) -> Tensor:
    return apply(OP_CONV2D_WEIGHT_GRAD, (x, g), {"w_shape": tuple(w_shape), "geom": geom})


def _unbatched(fn: Any, x: Tensor, *rest: Any, **kw: Any) -> Any:

    y = fn(reshape(x, (1, *x.shape)), *rest, **kw)
    if isinstance(y, tuple):
        return tuple(reshape(t, t.shape[1:]) for t in y)
    return reshape(y, y.shape[1:])


def conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> Tensor:
    """2-D convolution (cross-correlation) like ``torch.nn.functional.conv2d``.

    ``input`` is (N, C, H, W) or unbatched (C, H, W); ``weight`` is (O, C/groups, kH, kW). ``padding``
    is an int, a pair, ``"valid"`` or ``"same"`` (stride 1 only). NCHW and channels-last layouts both
    work; a channels-last input gives a channels-last output.
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"conv2d: input must be a Tensor, got {type(input).__name__}")
    if input.ndim == 3:
        return _unbatched(conv2d, input, weight, bias, stride, padding, dilation, groups)  # type: ignore[no-any-return]
    st = _pair("conv2d", "stride", stride)
    dil = _pair("conv2d", "dilation", dilation)
    if min(st) < 1 or min(dil) < 1:
        raise OpError(f"conv2d: stride {st} and dilation {dil} must be positive")
    if isinstance(padding, str):
        if padding == "valid":
            pad = (0, 0, 0, 0)
        elif padding == "same":
            if st != (1, 1):
                raise OpError("conv2d: padding='same' is not supported for strided convolutions")
            kh, kw = weight.shape[2:]
            th, tw = dil[0] * (kh - 1), dil[1] * (kw - 1)
            pad = (th // 2, th - th // 2, tw // 2, tw - tw // 2)
        else:
            raise OpError(f"conv2d: padding must be an int, a pair, 'valid' or 'same', got {padding!r}")
    else:
        ph, pw = _pair("conv2d", "padding", padding)
        if ph < 0 or pw < 0:
            raise OpError(f"conv2d: padding must be non-negative, got {(ph, pw)}")
        pad = (ph, ph, pw, pw)
    geom = {"stride": st, "padding": pad, "dilation": dil, "groups": int(groups)}
    return apply(OP_CONV2D, (input, weight, bias), {"geom": geom})


# ---- pooling geometry --------------------------------------------------------------------------------------


def _pool_size(n: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    num = n + 2 * p - d * (k - 1) - 1
    out = (num + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= n + p:  # the last window must start inside the input or its left padding
        out -= 1
    return out


def _pool_geom(
    name: str, x: Tensor, kernel_size: Any, stride: Any, padding: Any, dilation: Any, ceil_mode: bool
) -> Geom:
    if x.ndim != 4:
        raise OpError(f"{name}: expected a 3-d (C, H, W) or 4-d (N, C, H, W) input, got shape {x.shape}")
    k = _pair(name, "kernel_size", kernel_size)
    s = (
        k
        if stride is None or (not isinstance(stride, int) and len(stride) == 0)
        else _pair(name, "stride", stride)
    )
    p = _pair(name, "padding", padding)
    d = _pair(name, "dilation", dilation)
    if min(k) < 1 or min(s) < 1 or min(d) < 1:
        raise OpError(f"{name}: kernel_size {k}, stride {s} and dilation {d} must be positive")
    if p[0] > k[0] // 2 or p[1] > k[1] // 2 or min(p) < 0:
        raise OpError(
            f"{name}: pad should be at most half of effective kernel size, got padding {p}, kernel {k}"
        )
    h, w = x.shape[2:]
    ho = _pool_size(h, k[0], s[0], p[0], d[0], ceil_mode)
    wo = _pool_size(w, k[1], s[1], p[1], d[1], ceil_mode)
    if ho < 1 or wo < 1:
        raise OpError(f"{name}: output size {(ho, wo)} is too small for input of shape {x.shape}")
    # windows may run past the padded input with ceil_mode: pad further on the bottom / right
    eb = max(0, (ho - 1) * s[0] + d[0] * (k[0] - 1) + 1 - (h + 2 * p[0]))
    er = max(0, (wo - 1) * s[1] + d[1] * (k[1] - 1) + 1 - (w + 2 * p[1]))
    return {
        "kernel": k,
        "stride": s,
        "dilation": d,
        "padding": (p[0], p[0] + eb, p[1], p[1] + er),
        "out": (ho, wo),
        "pool_pad": p,
    }


def _lowest(dtype: Any) -> Any:
    return -np.inf if dtype.kind in "fc" else np.iinfo(dtype).min


def _taps(geom: Geom) -> list[tuple[int, int]]:
    kh, kw = geom["kernel"]
    return [(i, j) for i in range(kh) for j in range(kw)]


# ---- max_pool2d --------------------------------------------------------------------------------------------


def _max_pool_kernel(x: np.ndarray, geom: Geom) -> np.ndarray:
    ho, wo = geom["out"]
    xp_ = _pad(x, geom["padding"], _lowest(x.dtype))
    taps = _taps(geom)
    cl = _channels_last(x)
    if x.size < SPLIT_MIN_ELEMENTS or not (cl or x.flags.c_contiguous):
        best = np.array(_tap(xp_, *taps[0], geom, ho, wo), order="K")
        for i, j in taps[1:]:
            np.maximum(best, _tap(xp_, i, j, geom, ho, wo), out=best)
        return best
    out = _empty((*x.shape[:2], ho, wo), x.dtype, cl)  # the layout np.array(order="K") gives above

    def images(lo: int, hi: int) -> None:
        best, src = out[lo:hi], xp_[lo:hi]
        np.copyto(best, _tap(src, *taps[0], geom, ho, wo))
        for i, j in taps[1:]:
            np.maximum(best, _tap(src, i, j, geom, ho, wo), out=best)

    run_slices(images, slices(x.shape[0], 1, True))
    return out


def _argmax_taps(x: np.ndarray, geom: Geom) -> np.ndarray:
    """Per output, which tap of its window holds the max (the first on ties; NaNs win), like PyTorch."""
    ho, wo = geom["out"]
    xp_ = _pad(x, geom["padding"], _lowest(x.dtype))
    taps = _taps(geom)
    idx = np.zeros((*x.shape[:2], ho, wo), np.int32)

    def scan(nan: bool) -> np.ndarray:
        best = np.array(_tap(xp_, *taps[0], geom, ho, wo), order="K")
        upd = np.empty(best.shape, bool)
        tap_of = np.empty(best.shape, np.int32)
        for t, (i, j) in enumerate(taps[1:], 1):
            v = _tap(xp_, i, j, geom, ho, wo)
            np.greater(v, best, out=upd)
            if nan:
                upd |= np.isnan(v)  # as PyTorch's CPU kernel: a NaN always takes over (the last one wins)
                np.copyto(best, v, where=upd)
            else:
                np.maximum(best, v, out=best)
            # idx = t where upd: every earlier tap is < t, so max(idx, upd * t) is that, and measured ~15x
            # faster than a masked copyto (W9's MNIST pool: 3 ms a tap -> 0.2 ms)
            np.multiply(upd, np.int32(t), out=tap_of)
            np.maximum(idx, tap_of, out=idx)
        return best

    # np.maximum carries a NaN of a window into its max: only when a max is NaN (a pass over the outputs,
    # not over the whole input) does the NaN-aware scan run again
    best = scan(False)
    if x.dtype.kind in "fc" and bool(np.isnan(best).any()):
        idx.fill(0)
        scan(True)
    return idx


def _tiling(geom: Geom, x_shape: Any) -> bool:
    """Do the windows tile the input without overlap or padding (stride == kernel, e.g. max_pool2d(x, 2))?"""
    (kh, kw), (sh, sw), (dh, dw) = geom["kernel"], geom["stride"], geom["dilation"]
    return (kh, kw) == (sh, sw) and dh == dw == 1 and not any(geom["padding"])


def _pool_scatter_tiled(g: np.ndarray, idx: np.ndarray, x_shape: Any, geom: Geom, cl: bool) -> np.ndarray:
    """`_pool_scatter_kernel` for tiling windows: every input element is in at most one window, so each tap's
    block is written once (no zero fill under the windows, no read-add-write)."""
    ho, wo = geom["out"]
    n, c, h, w = x_shape
    kh, kw = geom["kernel"]
    dx = _empty((n, c, h, w), g.dtype, cl)
    if ho * kh < h:  # rows and columns past the last window get no gradient
        dx[:, :, ho * kh :] = 0
    if wo * kw < w:
        dx[:, :, :, wo * kw :] = 0
    # g * mask is one pass, but inf * 0 would give NaN where another tap holds the max: then zero and copy
    finite = g.dtype.kind not in "fc" or bool(np.isfinite(g).all())
    hit = np.empty(idx.shape, bool)
    for t, (i, j) in enumerate(_taps(geom)):
        np.equal(idx, t, out=hit)
        dst = dx[:, :, i : ho * kh : kh, j : wo * kw : kw]
        if finite:
            np.multiply(g, hit, out=dst)
        else:
            dst.fill(0)
            np.copyto(dst, g, where=hit)
    return dx


def _pool_scatter_kernel(g: np.ndarray, idx: np.ndarray, x_shape: Any, geom: Geom) -> np.ndarray:
    """Adjoint of gathering each window's element ``idx``: add g into the input at the picked taps."""
    ho, wo = geom["out"]
    n, c, h, w = x_shape
    pt, pb, pl, pr = geom["padding"]
    cl = _channels_last(g)
    if _tiling(geom, x_shape):
        return _pool_scatter_tiled(g, idx, x_shape, geom, cl)
    dxp = _zeros((n, c, h + pt + pb, w + pl + pr), g.dtype, cl)
    zero = np.zeros((), g.dtype)
    for t, (i, j) in enumerate(_taps(geom)):
        _tap(dxp, i, j, geom, ho, wo)[...] += np.where(idx == t, g, zero)  # (not g * mask: inf * 0)
    if not (pt or pb or pl or pr):
        return dxp
    dx = _empty((n, c, h, w), g.dtype, cl)
    np.copyto(dx, dxp[:, :, pt : pt + h, pl : pl + w])
    return dx


def _pool_gather_kernel(a: np.ndarray, idx: np.ndarray, geom: Geom) -> np.ndarray:
    ho, wo = geom["out"]
    ap = _pad(a, geom["padding"], 0)
    out = np.zeros(idx.shape, a.dtype)
    for t, (i, j) in enumerate(_taps(geom)):
        np.copyto(out, _tap(ap, i, j, geom, ho, wo), where=idx == t)
    return out


def _max_pool_meta(x: Tensor, geom: Geom) -> Any:
    return (*x.shape[:2], *geom["out"]), x.dtype


def _tap_major(a: np.ndarray, geom: Geom) -> np.ndarray:
    """The (kh, kw, N, C, Ho, Wo) view of ``a`` (any layout) whose [i, j] is what tap (i, j) of tiling
    windows reads (or writes)."""
    (kh, kw), (ho, wo) = geom["kernel"], geom["out"]
    sn, sc, sh, sw = a.strides
    n, c = a.shape[:2]
    return as_strided(a, (kh, kw, n, c, ho, wo), (sh, sw, sn, sc, sh * kh, sw * kw))


def _max_pool_tiled_backward(x: np.ndarray, g: np.ndarray, geom: Geom) -> np.ndarray | None:
    """max_pool2d's input gradient for tiling windows from ``x`` alone, or None when a window's max is NaN
    or ``g`` is not finite (then the general path, which handles them, runs).

    Each tap's values are copied out once into a contiguous array and the gradient built tap by tap there
    (numpy's ufuncs run ~5x slower on the taps' strided views, whose rows are Wo elements with a stride):
    ``hit = tap == max``; ``dx_tap = rest * hit``; ``rest -= dx_tap``, so g goes to the first tap that holds
    the max, as PyTorch's argmax picks it. W9's pool (64x64x24x24), one thread: 7.9 -> 5.7 ms.
    """
    if x.dtype.kind != "f" or g.dtype != x.dtype or not bool(np.isfinite(g).all()):
        return None
    (kh, kw), (ho, wo) = geom["kernel"], geom["out"]
    n, c, h, w = x.shape
    taps = kh * kw
    dx = _empty((n, c, h, w), g.dtype, _channels_last(g))
    if ho * kh < h:  # rows and columns past the last window get no gradient
        dx[:, :, ho * kh :] = 0
    if wo * kw < w:
        dx[:, :, :, wo * kw :] = 0
    src, dst = _tap_major(x, geom), _tap_major(dx, geom)

    def images(lo: int, hi: int) -> bool:
        m = hi - lo
        vals = np.empty((taps, m, c, ho, wo), x.dtype)
        for t in range(taps):
            np.copyto(vals[t], src[t // kw, t % kw, lo:hi])
        best = np.array(vals[0]) if taps == 1 else np.maximum(vals[0], vals[1])
        for t in range(2, taps):
            np.maximum(best, vals[t], out=best)
        if bool(np.isnan(best).any()):
            return False
        hit = np.empty(best.shape, bool)
        part = np.empty(best.shape, g.dtype)
        rest = g[lo:hi]
        for t in range(taps):
            np.equal(vals[t], best, out=hit)
            np.multiply(rest, hit, out=part)
            np.copyto(dst[t // kw, t % kw, lo:hi], part)
            if t < taps - 1:
                rest = np.subtract(rest, part) if t == 0 else np.subtract(rest, part, out=rest)
        return True

    return dx if all(run_slices(images, slices(n, 1, x.size >= SPLIT_MIN_ELEMENTS))) else None


def _max_pool_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    x = args[0]
    if xp is NP and _tiling(kw["geom"], x.shape):
        dx = _max_pool_tiled_backward(x, g, kw["geom"])
        if dx is not None:
            return (dx,)
    idx = _argmax_taps(xp.value(x), kw["geom"])
    return (xp.max_pool2d_scatter(g, idx, tuple(x.shape), kw["geom"]),)


def _scatter_meta(g: Tensor, idx: Any, x_shape: Any, geom: Geom) -> Any:
    return tuple(x_shape), g.dtype


def _scatter_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (xp.max_pool2d_gather(g, args[1], kw["geom"]), None)


def _gather_meta(a: Tensor, idx: Any, geom: Geom) -> Any:
    return tuple(idx.shape), a.dtype


def _gather_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    a, idx = args
    return (xp.max_pool2d_scatter(g, idx, tuple(a.shape), kw["geom"]), None)


def _max_pool_indices_kernel(x: np.ndarray, geom: Geom) -> np.ndarray:
    idx = _argmax_taps(x, geom)
    ho, wo = geom["out"]
    (sh, sw), (dh, dw) = geom["stride"], geom["dilation"]
    pt, _, pl, _ = geom["padding"]
    kw = geom["kernel"][1]
    ti, tj = np.divmod(idx, kw)
    rows = np.arange(ho).reshape(ho, 1) * sh - pt + ti * dh
    cols = np.arange(wo).reshape(1, wo) * sw - pl + tj * dw
    return (rows * x.shape[3] + cols).astype(np.int64)


def _window_work(args: tuple[Any, ...], n: int, kw: dict[str, Any]) -> int:
    """A pooling op's reads (`Op.work`): each element of the larger of its output and input reads a window."""
    kh, kw_ = kw["geom"]["kernel"]
    return max([n, *(math.prod(a._shape) for a in args if isinstance(a, Tensor))]) * kh * kw_


OP_MAX_POOL2D = defop("max_pool2d", _max_pool_kernel, _max_pool_meta, _max_pool_rule, work=_window_work)
OP_MAX_POOL2D_SCATTER = defop(
    "max_pool2d_scatter", _pool_scatter_kernel, _scatter_meta, _scatter_rule, work=_window_work
)
OP_MAX_POOL2D_GATHER = defop(
    "max_pool2d_gather", _pool_gather_kernel, _gather_meta, _gather_rule, work=_window_work
)
OP_MAX_POOL2D_INDICES = defop(
    "max_pool2d_indices",
    _max_pool_indices_kernel,
    lambda x, geom: (_max_pool_meta(x, geom)[0], np.dtype(np.int64)),
    work=_window_work,
)


def ag_max_pool2d_scatter(g: Tensor, idx: np.ndarray, x_shape: Any, geom: Geom) -> Tensor:
    return apply(OP_MAX_POOL2D_SCATTER, (g, idx), {"x_shape": tuple(x_shape), "geom": geom})


def ag_max_pool2d_gather(a: Tensor, idx: np.ndarray, geom: Geom) -> Tensor:
    return apply(OP_MAX_POOL2D_GATHER, (a, idx), {"geom": geom})


def max_pool2d(
    input: Tensor,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Any:
    """2-D max pooling like ``torch.nn.functional.max_pool2d`` (the gradient goes to the first max).

    With ``return_indices=True`` returns ``(output, indices)``, indices into each input plane's H*W.
    """
    if input.ndim == 3:
        return _unbatched(
            max_pool2d, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices
        )
    geom = _pool_geom("max_pool2d", input, kernel_size, stride, padding, dilation, bool(ceil_mode))
    out = apply(OP_MAX_POOL2D, (input,), {"geom": geom})
    if return_indices:
        return out, apply(OP_MAX_POOL2D_INDICES, (input,), {"geom": geom})
    return out


# ---- avg_pool2d --------------------------------------------------------------------------------------------


def _avg_divisor(x_hw: Any, geom: Geom, count_include_pad: bool, divisor_override: Any) -> Any:
    if divisor_override is not None:
        return divisor_override
    counts = []
    for n, o, k, s, p in zip(x_hw, geom["out"], geom["kernel"], geom["stride"], geom["pool_pad"]):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, n + p)
        size = end - start
        if not count_include_pad:
            size = np.minimum(end, n) - np.maximum(start, 0)
        counts.append(size)
    return (counts[0].reshape(-1, 1) * counts[1].reshape(1, -1)).astype(np.float64)


def _avg_pool_kernel(x: np.ndarray, geom: Geom, div: Any) -> np.ndarray:
    ho, wo = geom["out"]
    xp_ = _pad(x, geom["padding"], 0)
    taps = _taps(geom)
    acc = np.array(_tap(xp_, *taps[0], geom, ho, wo), order="K")
    for i, j in taps[1:]:
        acc += _tap(xp_, i, j, geom, ho, wo)
    acc /= np.asarray(div, x.dtype) if np.ndim(div) else div
    return acc


def _avg_pool_backward_kernel(g: np.ndarray, x_shape: Any, geom: Geom, div: Any) -> np.ndarray:
    ho, wo = geom["out"]
    n, c, h, w = x_shape
    pt, pb, pl, pr = geom["padding"]
    cl = _channels_last(g)
    gd = g / (np.asarray(div, g.dtype) if np.ndim(div) else div)
    dxp = _zeros((n, c, h + pt + pb, w + pl + pr), g.dtype, cl)
    for i, j in _taps(geom):
        _tap(dxp, i, j, geom, ho, wo)[...] += gd
    if not (pt or pb or pl or pr):
        return dxp
    dx = _empty((n, c, h, w), g.dtype, cl)
    np.copyto(dx, dxp[:, :, pt : pt + h, pl : pl + w])
    return dx


def _avg_pool_meta(x: Tensor, geom: Geom, div: Any) -> Any:
    if x.dtype.kind not in "fc":
        raise OpError(f"avg_pool2d: expected a floating point input, got dtype {x.dtype}")
    return (*x.shape[:2], *geom["out"]), x.dtype


def _avg_pool_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (xp.avg_pool2d_backward(g, tuple(args[0].shape), kw["geom"], kw["div"]),)


def _avg_back_meta(g: Tensor, x_shape: Any, geom: Geom, div: Any) -> Any:
    return tuple(x_shape), g.dtype


def _avg_back_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    return (xp.avg_pool2d(g, kw["geom"], kw["div"]),)


OP_AVG_POOL2D = defop("avg_pool2d", _avg_pool_kernel, _avg_pool_meta, _avg_pool_rule, work=_window_work)
OP_AVG_POOL2D_BACKWARD = defop(
    "avg_pool2d_backward", _avg_pool_backward_kernel, _avg_back_meta, _avg_back_rule, work=_window_work
)


def ag_avg_pool2d(x: Tensor, geom: Geom, div: Any) -> Tensor:
    return apply(OP_AVG_POOL2D, (x,), {"geom": geom, "div": div})


def ag_avg_pool2d_backward(g: Tensor, x_shape: Any, geom: Geom, div: Any) -> Tensor:
    return apply(OP_AVG_POOL2D_BACKWARD, (g,), {"x_shape": tuple(x_shape), "geom": geom, "div": div})


def avg_pool2d(
    input: Tensor,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Tensor:
    """2-D average pooling like ``torch.nn.functional.avg_pool2d``."""
    if input.ndim == 3:
        return _unbatched(  # type: ignore[no-any-return]
            avg_pool2d, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
        )
    geom = _pool_geom("avg_pool2d", input, kernel_size, stride, padding, 1, bool(ceil_mode))
    if divisor_override is not None and divisor_override == 0:
        raise OpError("avg_pool2d: divisor must be not zero")
    div = _avg_divisor(input.shape[2:], geom, bool(count_include_pad), divisor_override)
    return apply(OP_AVG_POOL2D, (input,), {"geom": geom, "div": div})


# the rule namespaces' adjoint kernels (see `runtime._xp`): each an op with its own rule under create_graph
register_xp("conv2d", conv2d_kernel, ag_conv2d)
register_xp("conv2d_input_grad", np_conv2d_input_grad, ag_conv2d_input_grad)
register_xp("conv2d_weight_grad", conv2d_weight_grad_kernel, ag_conv2d_weight_grad)
register_xp("max_pool2d_scatter", _pool_scatter_kernel, ag_max_pool2d_scatter)
register_xp("max_pool2d_gather", _pool_gather_kernel, ag_max_pool2d_gather)
register_xp("avg_pool2d", _avg_pool_kernel, ag_avg_pool2d)
register_xp("avg_pool2d_backward", _avg_pool_backward_kernel, ag_avg_pool2d_backward)
