"""The W9 kernel fast paths (issue 21): each one against the general path or PyTorch, and its gradient in
float64 against finite differences where it has one of its own.

- float32 erf (``ops/_math._erf32``, used by GELU) against the exact erf; GELU's float32 backward from its
  saved output;
- conv2d with 1-3 NCHW input channels (forward and weight gradient as per-image GEMMs), and NCHW inputs
  run image block by image block (forward and both gradients);
- max_pool2d's backward for tiling windows (stride == kernel), incl. odd sizes, ties and inf gradients;
- layer_norm's fused numpy backward; the short-row max and sum (``ops/_rows``) of softmax, attention and
  cross-entropy; scaled_dot_product_attention's in-place softmax (causal, masks);
- linear with leading dims (one 2-D GEMM) and the in-place LSTM gates, float32 vs torch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.ops._conv import _argmax_taps, _pool_scatter_kernel, _taps
from asyncgrad.ops._math import _erf32
from tests._util import vs_torch

torch = pytest.importorskip("torch")
F = torch.nn.functional
T = 30  # seconds: every test here runs in well under that


def test_erf32_close_to_exact_and_float32() -> None:
    x = np.concatenate([np.linspace(-7, 7, 200001), [0.0, -0.0, np.inf, -np.inf, 1e-30]]).astype(np.float32)
    got = _erf32(x)
    assert got.dtype == np.float32
    exact = np.array([math.erf(float(v)) for v in x])
    assert np.max(np.abs(got - exact)) < 6e-7
    assert got[-3] == 1.0 and got[-2] == -1.0 and abs(got[-1]) < 1e-29
    assert np.isnan(_erf32(np.array([np.nan], np.float32)))[0]
    # as close to torch's own float32 erf as torch is to the exact one
    assert np.max(np.abs(got - torch.erf(torch.tensor(x)).numpy())) < 6e-7


async def test_gelu_float32_vs_torch(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(T):
        a = (rng.standard_normal((8, 64)) * 3).astype(np.float32)
        x = ag.tensor(a, requires_grad=True)
        y = ag.nn.functional.gelu(x)
        (g,) = await ag.grad(y.sum(), [x])
        tx = torch.tensor(a, requires_grad=True)
        ty = F.gelu(tx)
        ty.sum().backward()
        assert y.dtype == np.float32 and g.dtype == np.float32
        np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), atol=2e-6, rtol=1e-5)
        np.testing.assert_allclose(g.numpy(), tx.grad.numpy(), atol=2e-6, rtol=1e-5)


async def test_gelu_float32_backward_from_output_edges(rt: Any, rng: np.random.Generator) -> None:
    """The float32 backward reads cdf off the saved output (out / a): zero, denormal and tiny inputs take the
    limit 1/2, large ones saturate; against torch's float64 gradient."""
    with trio.fail_after(T):
        edges = [0.0, -0.0, 1e-39, -1e-39, 1e-30, -1e-20, 1e-7, -6.0, 6.0, -20.0, 20.0]
        a = np.concatenate([edges, rng.standard_normal(500) * 4]).astype(np.float32)
        x = ag.tensor(a, requires_grad=True)
        gw = rng.standard_normal(a.shape).astype(np.float32)
        (g,) = await ag.grad((ag.nn.functional.gelu(x) * ag.tensor(gw)).sum(), [x])
        tx = torch.tensor(a.astype(np.float64), requires_grad=True)
        (F.gelu(tx) * torch.tensor(gw.astype(np.float64))).sum().backward()
        assert g.dtype == np.float32
        np.testing.assert_allclose(g.numpy(), tx.grad.numpy(), atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(16, 2, 16, 16), (256, 65), (40, 3), (5, 7), (64, 1), (33, 256), (8, 300)])
def test_row_max_and_sum_match_numpy(shape: Any, rng: np.random.Generator) -> None:
    from asyncgrad.ops._rows import row_max, row_sum

    for dt in (np.float32, np.float64):
        a = rng.standard_normal(shape).astype(dt)
        a.reshape(-1, shape[-1])[::3, 1:] = -np.inf  # causal-style rows, with their finite first column
        a.reshape(-1, shape[-1])[-1, 0] = np.nan  # NaN wins the max, as in np.max
        for v in (a, np.swapaxes(a, 0, -1).copy().swapaxes(0, -1)):  # contiguous and not
            np.testing.assert_array_equal(row_max(v), np.max(v, axis=-1, keepdims=True))
        b = rng.standard_normal(shape).astype(dt)
        got = row_sum(b)
        assert got.dtype == dt and got.shape == (*shape[:-1], 1)
        np.testing.assert_allclose(got, np.sum(b, axis=-1, keepdims=True), rtol=1e-5 if dt == np.float32 else 1e-12,
                                   atol=1e-5 if dt == np.float32 else 1e-12)


FEW = [
    ((2, 1, 9, 8), (4, 1, 3, 3), {}),
    ((2, 3, 9, 9), (5, 3, 3, 2), {"stride": 2, "padding": 1}),
    ((1, 2, 10, 9), (3, 2, 2, 3), {"dilation": (2, 1), "padding": (1, 2), "stride": (1, 2)}),
]


@pytest.mark.parametrize("xs,ws,kw", FEW)
async def test_conv2d_few_channels_fd(xs: Any, ws: Any, kw: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(T):
        async with ag.open_runtime():
            x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
            await ag.autograd.gradcheck(
                lambda x, w, b: ag.conv2d(x, w, b, **kw), [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=3
            )
            await vs_torch(lambda x, w, b: ag.conv2d(x, w, b, **kw), lambda x, w, b: F.conv2d(x, w, b, **kw),
                           x, w, b)


BLOCKED = [
    ((3, 5, 7, 8), (4, 5, 3, 3), {}),
    ((3, 4, 9, 9), (6, 4, 3, 2), {"stride": 2, "padding": 1}),
    ((2, 6, 10, 9), (3, 6, 2, 3), {"dilation": (2, 1), "padding": (1, 2), "stride": (1, 2)}),
    ((2, 5, 9, 10), (3, 5, 3, 2), {"dilation": (2, 1), "padding": (1, 2)}),  # stride 1: the widened col2im
]


@pytest.mark.parametrize("per_block", [1, 2, 64])
@pytest.mark.parametrize("xs,ws,kw", BLOCKED)
async def test_conv2d_nchw_blocked_fd(
    xs: Any, ws: Any, kw: Any, per_block: int, rng: np.random.Generator, monkeypatch: Any
) -> None:
    """The image-block NCHW path (forward, input and weight gradients) with blocks of 1, 2 and all images
    (the last block short), on images small enough for a float64 gradcheck."""
    from asyncgrad.ops import _conv

    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
    k = ws[1] * ws[2] * ws[3]
    pixels = math.prod(F.conv2d(torch.tensor(x), torch.tensor(w), **kw).shape[2:])
    monkeypatch.setattr(_conv, "_MIN_PIXELS", 1)
    monkeypatch.setattr(_conv, "_BLOCK_BYTES", per_block * k * pixels * 8)  # the columns of per_block images
    assert _conv._block(xs[0], k * pixels * 8) == min(per_block, xs[0])
    with trio.fail_after(T):
        async with ag.open_runtime():
            await ag.autograd.gradcheck(
                lambda x, w, b: ag.conv2d(x, w, b, **kw), [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=3
            )
            await vs_torch(lambda x, w, b: ag.conv2d(x, w, b, **kw), lambda x, w, b: F.conv2d(x, w, b, **kw),
                           x, w, b)


async def test_conv2d_mnist_conv2_float32_vs_torch(rt: Any, rng: np.random.Generator) -> None:
    """W9's second MNIST conv (32 -> 64 channels on 26x26, several image blocks) in float32."""
    with trio.fail_after(T):
        xa = rng.standard_normal((6, 32, 26, 26)).astype(np.float32)
        wa = (rng.standard_normal((64, 32, 3, 3)) * 0.05).astype(np.float32)
        ba = rng.standard_normal(64).astype(np.float32)
        x, w, b = (ag.tensor(a, requires_grad=True) for a in (xa, wa, ba))
        y = ag.conv2d(x, w, b)
        ga = rng.standard_normal(y.shape).astype(np.float32)
        grads = await ag.grad((y * ag.tensor(ga)).sum(), [x, w, b])
        tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (xa, wa, ba))
        ty = F.conv2d(tx, tw, tb)
        (ty * torch.tensor(ga)).sum().backward()
        assert y.dtype == np.float32 and all(g.dtype == np.float32 for g in grads)
        np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), atol=2e-5, rtol=1e-5)
        for g, t in zip(grads, (tx, tw, tb)):
            np.testing.assert_allclose(g.numpy(), t.grad.numpy(), atol=2e-3, rtol=1e-4)


async def test_conv2d_mnist_conv1_float32_vs_torch(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(T):
        xa = rng.standard_normal((4, 1, 28, 28)).astype(np.float32)
        wa = rng.standard_normal((32, 1, 3, 3)).astype(np.float32)
        x, w = ag.tensor(xa), ag.tensor(wa, requires_grad=True)
        y = ag.conv2d(x, w)
        ga = rng.standard_normal(y.shape).astype(np.float32)
        (gw,) = await ag.grad((y * ag.tensor(ga)).sum(), [w])
        tw = torch.tensor(wa, requires_grad=True)
        ty = F.conv2d(torch.tensor(xa), tw)
        (ty * torch.tensor(ga)).sum().backward()
        assert y.dtype == np.float32 and gw.dtype == np.float32
        np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(gw.numpy(), tw.grad.numpy(), atol=1e-3, rtol=1e-5)


def _scatter_general(g: np.ndarray, idx: np.ndarray, x_shape: Any, geom: Any) -> np.ndarray:
    """The general (overlapping-window) scatter, the reference for the tiling fast path."""
    ho, wo = geom["out"]
    dx = np.zeros(x_shape, g.dtype)
    (sh, sw) = geom["stride"]
    for t, (i, j) in enumerate(_taps(geom)):
        dx[..., i : i + sh * (ho - 1) + 1 : sh, j : j + sw * (wo - 1) + 1 : sw] += np.where(idx == t, g, 0)
    return dx


@pytest.mark.parametrize("hw", [(8, 8), (9, 7)])
@pytest.mark.parametrize("k", [2, 3])
def test_max_pool_tiled_scatter_matches_general(hw: Any, k: int, rng: np.random.Generator) -> None:
    h, w = hw
    x = np.maximum(rng.standard_normal((2, 3, h, w)), 0.0)  # ReLU'd: many tied zeros in a window
    ho, wo = h // k, w // k
    geom = {"kernel": (k, k), "stride": (k, k), "dilation": (1, 1), "padding": (0, 0, 0, 0), "out": (ho, wo),
            "pool_pad": (0, 0)}
    idx = _argmax_taps(x, geom)
    g = rng.standard_normal((2, 3, ho, wo))
    np.testing.assert_array_equal(_pool_scatter_kernel(g, idx, x.shape, geom), _scatter_general(g, idx, x.shape, geom))
    g[0, 0, 0, 0] = np.inf  # must not turn the window's other entries into NaN (inf * 0)
    np.testing.assert_array_equal(_pool_scatter_kernel(g, idx, x.shape, geom), _scatter_general(g, idx, x.shape, geom))


async def test_max_pool2d_tiling_grad_vs_torch(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(T):
        x = rng.standard_normal((2, 3, 9, 8))
        await vs_torch(lambda x: ag.max_pool2d(x, 2), lambda x: F.max_pool2d(x, 2), x)


async def test_layer_norm_backward_fd_and_torch(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(T):
        x, w, b = rng.standard_normal((3, 4, 5)), rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
        fn = lambda x, w, b: ag.layer_norm(x, (4, 5), w, b)  # noqa: E731
        await ag.autograd.gradcheck(fn, [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=5)
        await vs_torch(fn, lambda x, w, b: F.layer_norm(x, (4, 5), w, b), x, w, b)
        await vs_torch(lambda x: ag.layer_norm(x, (5,)), lambda x: F.layer_norm(x, (5,)), x)


@pytest.mark.parametrize("case", ["causal", "float_mask", "bool_mask"])
async def test_sdpa_in_place_softmax_vs_torch(case: str, rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(T):
        q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
        fm = rng.standard_normal((5, 5))
        bm = rng.random((5, 5)) < 0.6
        bm[:, 0] = True

        def a(q: Any, k: Any, v: Any) -> Any:
            if case == "causal":
                return ag.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            m = ag.tensor(fm) if case == "float_mask" else ag.tensor(bm)
            return ag.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

        def t(q: Any, k: Any, v: Any) -> Any:
            if case == "causal":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            m = torch.tensor(fm) if case == "float_mask" else torch.tensor(bm)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

        await vs_torch(a, t, q, k, v)


async def test_linear_leading_dims_fd_and_float32(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(T):
        x, w, b = rng.standard_normal((3, 2, 4)), rng.standard_normal((5, 4)), rng.standard_normal(5)
        await ag.autograd.gradcheck(ag.nn.functional.linear, [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=2)
        xt = ag.tensor(x[:, :, ::-1].astype(np.float32), requires_grad=True)  # a non-contiguous input too
        wt = ag.tensor(w[:, ::-1].astype(np.float32), requires_grad=True)
        y = ag.nn.functional.linear(xt, wt)
        gx, gw = await ag.grad(y.sum(), [xt, wt])
        txx = torch.tensor(x[:, :, ::-1].astype(np.float32), requires_grad=True)
        tww = torch.tensor(w[:, ::-1].astype(np.float32), requires_grad=True)
        ty = F.linear(txx, tww)
        ty.sum().backward()
        assert y.shape == (3, 2, 5) and gx.shape == (3, 2, 4)
        np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gx.numpy(), txx.grad.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gw.numpy(), tww.grad.numpy(), rtol=1e-5, atol=1e-5)


async def test_lstm_float32_step_vs_torch(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(T):
        torch.manual_seed(0)
        tm = torch.nn.LSTM(6, 5, 2)
        am = ag.nn.LSTM(6, 5, 2)
        am.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
        xa = rng.standard_normal((7, 3, 6)).astype(np.float32)
        out, (h, c) = am(ag.tensor(xa))
        tout, (th, tc) = tm(torch.tensor(xa))
        loss = (out * out).sum() + c.sum()
        await loss.backward()
        ((tout * tout).sum() + tc.sum()).backward()
        np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(h.numpy(), th.detach().numpy(), rtol=1e-5, atol=1e-6)
        for name, p in am.named_parameters():
            np.testing.assert_allclose(p.grad.numpy(), dict(tm.named_parameters())[name].grad.numpy(),
                                       rtol=1e-4, atol=1e-5, err_msg=name)
