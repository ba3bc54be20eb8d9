"""The W9 kernel fast paths (issue 21): each one against the general path or PyTorch, and its gradient in
float64 against finite differences where it has one of its own.

- float32 erf (``kernels/_gelu.erf32``, used by GELU) against the exact erf; GELU's float32 backward from its
  saved output;
- conv2d with 1-3 NCHW input channels (forward and weight gradient as per-image GEMMs), and NCHW inputs
  run image block by image block (forward and both gradients);
- max_pool2d's backward for tiling windows (stride == kernel), incl. odd sizes, ties and inf gradients;
- layer_norm's fused numpy backward; the short-row max and sum (``kernels/_rows``) of softmax, attention and
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
from asyncgrad.kernels._gelu import erf32 as _erf32
from asyncgrad.ops._conv import _argmax_taps, _pool_scatter_kernel, _taps
from tests._util import grads_of, load_state, state_from_torch, vs_torch

T = 30  # seconds: every test here runs in well under that


def _with_inputs(torch_ref: Any, **consts: Any) -> Any:
    """``torch_ref`` that also records ``consts`` (masks, options the torch side closes over) as the case's
    inputs: ``vs_torch`` records only the tensors it differentiates."""
    return lambda key, fn, **inputs: torch_ref(key, fn, **inputs, **consts)


def _conv_out_hw(torch_ref: Any, x: np.ndarray, w: np.ndarray, kw: Any) -> Any:
    """PyTorch's conv2d output (height, width) for ``x``, ``w`` and ``kw``."""
    return torch_ref(
        "out_hw", lambda torch: tuple(torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), **kw).shape[2:]),
        x=x, w=w, kw=kw,
    )


def test_erf32_close_to_exact_and_float32(torch_ref) -> None:
    x = np.concatenate([np.linspace(-7, 7, 200001), [0.0, -0.0, np.inf, -np.inf, 1e-30]]).astype(np.float32)
    got = _erf32(x)
    assert got.dtype == np.float32
    exact = np.array([math.erf(float(v)) for v in x])
    assert np.max(np.abs(got - exact)) < 6e-7
    assert got[-3] == 1.0 and got[-2] == -1.0 and abs(got[-1]) < 1e-29
    assert np.isnan(_erf32(np.array([np.nan], np.float32)))[0]
    # as close to torch's own float32 erf as torch is to the exact one
    assert np.max(np.abs(got - torch_ref("erf", lambda torch: torch.erf(torch.tensor(x)), x=x))) < 6e-7


async def test_gelu_float32_vs_torch(rt: Any, rng: np.random.Generator, torch_ref) -> None:
    with trio.fail_after(T):
        a = (rng.standard_normal((8, 64)) * 3).astype(np.float32)
        x = ag.tensor(a, requires_grad=True)
        y = ag.nn.functional.gelu(x)
        (g,) = await ag.grad(y.sum(), [x])

        def reference(torch: Any) -> Any:
            tx = torch.tensor(a, requires_grad=True)
            ty = torch.nn.functional.gelu(tx)
            ty.sum().backward()
            return ty.detach(), tx.grad

        ty, tg = torch_ref("gelu", reference, a=a)
        assert y.dtype == np.float32 and g.dtype == np.float32
        np.testing.assert_allclose(y.numpy(), ty, atol=2e-6, rtol=1e-5)
        np.testing.assert_allclose(g.numpy(), tg, atol=2e-6, rtol=1e-5)


async def test_gelu_float32_backward_from_output_edges(rt: Any, rng: np.random.Generator, torch_ref) -> None:
    """The float32 backward reads cdf off the saved output (out / a): zero, denormal and tiny inputs take the
    limit 1/2, large ones saturate; against torch's float64 gradient."""
    with trio.fail_after(T):
        edges = [0.0, -0.0, 1e-39, -1e-39, 1e-30, -1e-20, 1e-7, -6.0, 6.0, -20.0, 20.0]
        a = np.concatenate([edges, rng.standard_normal(500) * 4]).astype(np.float32)
        x = ag.tensor(a, requires_grad=True)
        gw = rng.standard_normal(a.shape).astype(np.float32)
        (g,) = await ag.grad((ag.nn.functional.gelu(x) * ag.tensor(gw)).sum(), [x])

        def reference(torch: Any) -> Any:
            tx = torch.tensor(a.astype(np.float64), requires_grad=True)
            (torch.nn.functional.gelu(tx) * torch.tensor(gw.astype(np.float64))).sum().backward()
            return tx.grad

        tg = torch_ref("gelu_grad", reference, a=a, gw=gw)
        assert g.dtype == np.float32
        np.testing.assert_allclose(g.numpy(), tg, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(16, 2, 16, 16), (256, 65), (40, 3), (5, 7), (64, 1), (33, 256), (8, 300)])
def test_row_max_and_sum_match_numpy(shape: Any, rng: np.random.Generator) -> None:
    from asyncgrad.kernels._rows import row_max, row_sum

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
async def test_conv2d_few_channels_fd(xs: Any, ws: Any, kw: Any, rng: np.random.Generator, torch_ref) -> None:
    with trio.fail_after(T):
        async with ag.open_runtime():
            x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
            await ag.autograd.gradcheck(
                lambda x, w, b: ag.conv2d(x, w, b, **kw), [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=3
            )
            await vs_torch(_with_inputs(torch_ref, kw=kw), "conv2d", lambda x, w, b: ag.conv2d(x, w, b, **kw),
                           lambda torch, x, w, b: torch.nn.functional.conv2d(x, w, b, **kw), x, w, b)


BLOCKED = [
    ((3, 5, 7, 8), (4, 5, 3, 3), {}),
    ((3, 4, 9, 9), (6, 4, 3, 2), {"stride": 2, "padding": 1}),
    ((2, 6, 10, 9), (3, 6, 2, 3), {"dilation": (2, 1), "padding": (1, 2), "stride": (1, 2)}),
    ((2, 5, 9, 10), (3, 5, 3, 2), {"dilation": (2, 1), "padding": (1, 2)}),  # stride 1: the widened col2im
]


@pytest.mark.parametrize("per_block", [1, 2, 64])
@pytest.mark.parametrize("xs,ws,kw", BLOCKED)
async def test_conv2d_nchw_blocked_fd(
    xs: Any, ws: Any, kw: Any, per_block: int, rng: np.random.Generator, monkeypatch: Any, torch_ref
) -> None:
    """The image-block NCHW path (forward, input and weight gradients) with blocks of 1, 2 and all images
    (the last block short), on images small enough for a float64 gradcheck."""
    from asyncgrad.ops import _conv

    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
    k = ws[1] * ws[2] * ws[3]
    pixels = math.prod(_conv_out_hw(torch_ref, x, w, kw))
    monkeypatch.setattr(_conv, "_MIN_PIXELS", 1)
    monkeypatch.setattr(_conv, "_BLOCK_BYTES", per_block * k * pixels * 8)  # the columns of per_block images
    assert _conv._block(xs[0], k * pixels * 8) == min(per_block, xs[0])
    with trio.fail_after(T):
        async with ag.open_runtime():
            await ag.autograd.gradcheck(
                lambda x, w, b: ag.conv2d(x, w, b, **kw), [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=3
            )
            await vs_torch(_with_inputs(torch_ref, kw=kw), "conv2d", lambda x, w, b: ag.conv2d(x, w, b, **kw),
                           lambda torch, x, w, b: torch.nn.functional.conv2d(x, w, b, **kw), x, w, b)


SLICED = [
    ((5, 3, 8, 9), (4, 3, 3, 3), {}),  # stride 1 (the widened col2im), an odd batch
    ((3, 4, 9, 9), (6, 4, 3, 2), {"stride": 2, "padding": 1}),
    ((4, 5, 9, 10), (3, 5, 3, 2), {"dilation": (2, 1), "padding": (1, 2)}),
]


async def _conv_values(lanes: int, x: np.ndarray, w: np.ndarray, b: np.ndarray, kw: Any) -> list[np.ndarray]:
    async with ag.open_runtime(lanes=lanes) as rt:
        lanes_of = rt.devices["cpu"]._lanes
        while not all(lane._idle for lane in lanes_of):  # the sibling waiting for work, as in a training
            await trio.sleep(0.001)
        xt, wt, bt = (ag.tensor(a, requires_grad=True) for a in (x, w, b))
        y = ag.conv2d(xt, wt, bt, **kw)
        g = np.random.default_rng(5).standard_normal(y.shape)
        grads = await ag.grad((y * ag.tensor(g)).sum(), [xt, wt, bt])
        out = [y.numpy().copy(), *(t.numpy().copy() for t in grads)]
        if lanes > 1:
            await ag.autograd.gradcheck(
                lambda x, w, b: ag.conv2d(x, w, b, **kw), [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=3
            )
        return out


@pytest.mark.parametrize("per_block", [1, 2])
@pytest.mark.parametrize("xs,ws,kw", SLICED)
async def test_conv2d_nchw_image_slices_on_two_lanes(
    xs: Any, ws: Any, kw: Any, per_block: int, rng: np.random.Generator, monkeypatch: Any, torch_ref
) -> None:
    """The blocked NCHW kernels cut into image slices (every kernel counted as big enough), shared with an
    idle sibling lane: output and gradients equal the one-lane run bit for bit (the weight gradient sums
    the slices in order, whoever ran them), and match finite differences."""
    from asyncgrad.devices import _blas
    from asyncgrad.ops import _conv, _slices

    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
    k = ws[1] * ws[2] * ws[3]
    pixels = math.prod(_conv_out_hw(torch_ref, x, w, kw))
    monkeypatch.setattr(_conv, "_MIN_PIXELS", 1)
    monkeypatch.setattr(_conv, "_BLOCK_BYTES", per_block * k * pixels * 8)
    monkeypatch.setattr(_conv, "_SPLIT_MIN_MACS", 0)
    assert len(_conv._image_slices(xs[0], per_block, 1)) == min(_slices.MAX_SLICES, -(-xs[0] // per_block))
    _blas.pin_spare_cores(2)  # a sibling is lent slices only where other processes leave it a core
    try:
        with trio.fail_after(T):
            one = await _conv_values(1, x, w, b, kw)
            two = await _conv_values(2, x, w, b, kw)
    finally:
        _blas.pin_spare_cores(None)
    for a, c in zip(one, two):
        assert a.tobytes() == c.tobytes()

    def reference(torch: Any) -> Any:
        return torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), torch.tensor(b), **kw)

    ty = torch_ref("conv2d", reference, x=x, w=w, b=b, kw=kw)
    np.testing.assert_allclose(one[0], ty, rtol=1e-12, atol=1e-12)


def test_image_slices_are_whole_blocks_covering_the_batch() -> None:
    from asyncgrad.ops import _conv

    big = _conv._SPLIT_MIN_MACS
    assert _conv._image_slices(64, 1, big - 1) == [(0, 64)]
    assert _conv._image_slices(64, 1, big) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert _conv._image_slices(7, 3, big) == [(0, 3), (3, 6), (6, 7)]
    assert _conv._image_slices(5, 2, big) == [(0, 2), (2, 4), (4, 5)]
    assert _conv._image_slices(1, 1, big) == [(0, 1)]


async def test_run_slices_lends_slices_to_an_idle_lane_on_one_blas_thread() -> None:
    """`run_slices` on a lane with an idle sibling: a slice runs there (the first one waits for it), each
    result lands in its slot, and the lanes run the slices with one BLAS thread where the count can be
    switched."""
    import threading

    from threadpoolctl import ThreadpoolController

    from asyncgrad.devices import _blas
    from asyncgrad.ops import _slices

    def blas_threads() -> int:
        return int(ThreadpoolController().select(user_api="blas").info()[0]["num_threads"])

    _blas.pin_spare_cores(2)
    try:
        async with ag.open_runtime(lanes=2) as rt:
            lanes = rt.devices["cpu"]._lanes
            with trio.fail_after(T):
                while not all(lane._idle for lane in lanes):
                    await trio.sleep(0.001)
                last_ran = threading.Event()
                seen: dict[int, tuple[str, int | None]] = {}

                def fn(lo: int, hi: int) -> int:
                    if lo == 0:
                        assert last_ran.wait(T), "no sibling lane ran a slice"
                    seen[lo] = (threading.current_thread().name, blas_threads())
                    if hi == 4:
                        last_ran.set()
                    return lo * 10 + hi

                got: list[Any] = []
                stream = rt.devices["cpu"].pool.acquire()
                stream.submit(lambda: got.extend(_slices.run_slices(fn, [(0, 2), (2, 4)])))
                await stream.synchronize()
    finally:
        _blas.pin_spare_cores(None)
    assert got == [2, 24]
    assert seen[0][0] != seen[2][0]
    if _blas.boost_available():
        assert seen[0][1] == seen[2][1] == 1


async def test_conv2d_mnist_conv2_float32_vs_torch(rt: Any, rng: np.random.Generator, torch_ref) -> None:
    """W9's second MNIST conv (32 -> 64 channels on 26x26, several image blocks) in float32."""
    with trio.fail_after(T):
        xa = rng.standard_normal((6, 32, 26, 26)).astype(np.float32)
        wa = (rng.standard_normal((64, 32, 3, 3)) * 0.05).astype(np.float32)
        ba = rng.standard_normal(64).astype(np.float32)
        x, w, b = (ag.tensor(a, requires_grad=True) for a in (xa, wa, ba))
        y = ag.conv2d(x, w, b)
        ga = rng.standard_normal(y.shape).astype(np.float32)
        grads = await ag.grad((y * ag.tensor(ga)).sum(), [x, w, b])

        def reference(torch: Any) -> Any:
            tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (xa, wa, ba))
            ty = torch.nn.functional.conv2d(tx, tw, tb)
            (ty * torch.tensor(ga)).sum().backward()
            return ty.detach(), [t.grad for t in (tx, tw, tb)]

        ty, tgrads = torch_ref("conv2", reference, x=xa, w=wa, b=ba, g=ga)
        assert y.dtype == np.float32 and all(g.dtype == np.float32 for g in grads)
        np.testing.assert_allclose(y.numpy(), ty, atol=2e-5, rtol=1e-5)
        for g, tg in zip(grads, tgrads):
            np.testing.assert_allclose(g.numpy(), tg, atol=2e-3, rtol=1e-4)


async def test_conv2d_mnist_conv1_float32_vs_torch(rt: Any, rng: np.random.Generator, torch_ref) -> None:
    with trio.fail_after(T):
        xa = rng.standard_normal((4, 1, 28, 28)).astype(np.float32)
        wa = rng.standard_normal((32, 1, 3, 3)).astype(np.float32)
        x, w = ag.tensor(xa), ag.tensor(wa, requires_grad=True)
        y = ag.conv2d(x, w)
        ga = rng.standard_normal(y.shape).astype(np.float32)
        (gw,) = await ag.grad((y * ag.tensor(ga)).sum(), [w])

        def reference(torch: Any) -> Any:
            tw = torch.tensor(wa, requires_grad=True)
            ty = torch.nn.functional.conv2d(torch.tensor(xa), tw)
            (ty * torch.tensor(ga)).sum().backward()
            return ty.detach(), tw.grad

        ty, tgw = torch_ref("conv1", reference, x=xa, w=wa, g=ga)
        assert y.dtype == np.float32 and gw.dtype == np.float32
        np.testing.assert_allclose(y.numpy(), ty, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(gw.numpy(), tgw, atol=1e-3, rtol=1e-5)


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


@pytest.mark.parametrize("hw", [(8, 8), (9, 7)])
@pytest.mark.parametrize("k", [2, 3, (3, 2)])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_max_pool_tiled_backward_matches_general(hw: Any, k: Any, layout: str, rng: np.random.Generator) -> None:
    """The tap-major backward (`_max_pool_tiled_backward`) gives the general path's gradient: ties (ReLU'd
    zeros, whole windows of one value) to the first tap, -inf entries, rows and columns past the last
    window zero, every layout; NaN maxima and non-finite gradients are left to the general path."""
    from asyncgrad.ops._conv import _max_pool_tiled_backward

    h, w = hw
    kh, kw = (k, k) if isinstance(k, int) else k
    x = np.maximum(rng.standard_normal((2, 3, h, w)), 0.0)
    x[0, 1] = 0.5  # every window of a plane holds one value
    x[1, 2, :kh, :kw] = -np.inf
    if layout == "channels_last":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    ho, wo = h // kh, w // kw
    geom = {"kernel": (kh, kw), "stride": (kh, kw), "dilation": (1, 1), "padding": (0, 0, 0, 0),
            "out": (ho, wo), "pool_pad": (0, 0)}
    g = rng.standard_normal((2, 3, ho, wo))
    want = _scatter_general(g, _argmax_taps(x, geom), x.shape, geom)
    got = _max_pool_tiled_backward(x, g, geom)
    assert got is not None
    np.testing.assert_array_equal(got, want)
    bad = g.copy()
    bad[0, 0, 0, 0] = np.inf
    assert _max_pool_tiled_backward(x, bad, geom) is None
    xn = x.copy()
    xn[1, 1, 0, 0] = np.nan
    assert _max_pool_tiled_backward(xn, g, geom) is None


async def test_max_pool2d_and_relu_slices_fd_and_nan(rng: np.random.Generator, monkeypatch: Any, torch_ref) -> None:
    """max_pool2d(x, 2) (forward and the tiling backward) and relu (forward and backward) cut into slices on
    two lanes (every kernel counted as big enough) equal one slice bit for bit; the pool's backward matches
    finite differences (float64) and, for a NaN maximum, PyTorch."""
    from asyncgrad.devices import _blas
    from asyncgrad.ops import _conv, _slices

    x = rng.standard_normal((5, 3, 6, 7))
    g = rng.standard_normal((5, 3, 3, 3))
    _blas.pin_spare_cores(2)
    try:
        with trio.fail_after(T):
            got = []
            for lanes, split_min in ((1, 1 << 40), (2, 1)):
                monkeypatch.setattr(_conv, "SPLIT_MIN_ELEMENTS", split_min)
                monkeypatch.setattr(_slices, "SPLIT_MIN_ELEMENTS", split_min)
                async with ag.open_runtime(lanes=lanes) as rt:
                    while not all(lane._idle for lane in rt.devices["cpu"]._lanes):
                        await trio.sleep(0.001)
                    xt = ag.tensor(x, requires_grad=True)
                    y = ag.max_pool2d(ag.relu(xt), 2)
                    (gx,) = await ag.grad((y * ag.tensor(g)).sum(), [xt])
                    got.append(y.numpy().copy())
                    got.append(gx.numpy().copy())
                    if lanes == 2:
                        await ag.autograd.gradcheck(lambda x: ag.max_pool2d(x, 2), [x], eps=1e-6, atol=1e-7,
                                                    rtol=1e-5, seed=4)
                        xn = x.copy()
                        xn[1, 0, 2, 3] = np.nan
                        await vs_torch(torch_ref, "max_pool2d_nan", lambda x: ag.max_pool2d(x, 2),
                                       lambda torch, x: torch.nn.functional.max_pool2d(x, 2), xn)
    finally:
        _blas.pin_spare_cores(None)
    assert got[0].tobytes() == got[2].tobytes() and got[1].tobytes() == got[3].tobytes()
    ty = torch_ref("relu_max_pool2d",
                   lambda torch: torch.nn.functional.max_pool2d(torch.nn.functional.relu(torch.tensor(x)), 2), x=x)
    np.testing.assert_array_equal(got[0], ty)


async def test_max_pool2d_tiling_grad_vs_torch(rt: Any, rng: np.random.Generator, torch_ref) -> None:
    with trio.fail_after(T):
        x = rng.standard_normal((2, 3, 9, 8))
        await vs_torch(torch_ref, "max_pool2d", lambda x: ag.max_pool2d(x, 2),
                       lambda torch, x: torch.nn.functional.max_pool2d(x, 2), x)


async def test_layer_norm_backward_fd_and_torch(rt: Any, rng: np.random.Generator, torch_ref) -> None:
    with trio.fail_after(T):
        x, w, b = rng.standard_normal((3, 4, 5)), rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
        fn = lambda x, w, b: ag.layer_norm(x, (4, 5), w, b)  # noqa: E731
        await ag.autograd.gradcheck(fn, [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=5)
        await vs_torch(torch_ref, "affine", fn, lambda torch, x, w, b: torch.nn.functional.layer_norm(x, (4, 5), w, b),
                       x, w, b)
        await vs_torch(torch_ref, "plain", lambda x: ag.layer_norm(x, (5,)),
                       lambda torch, x: torch.nn.functional.layer_norm(x, (5,)), x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
async def test_layer_norm_backward_from_saved_statistics_is_bitwise_the_recomputed_one(
    dtype: Any, rt: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncgrad.ops import _nn

    async def grads() -> list[np.ndarray]:
        x = ag.tensor(rng_x, requires_grad=True)
        w, b = ag.tensor(rng_w, requires_grad=True), ag.tensor(rng_b, requires_grad=True)
        y = ag.layer_norm(x, (32,), w, b)
        gs = await ag.grad((y * ag.tensor(wy)).sum(), [x, w, b])
        return [y.numpy().copy(), *(g.numpy() for g in gs)]

    with trio.fail_after(T):
        rng_x = rng.standard_normal((16, 16, 32)).astype(dtype)
        rng_w, rng_b = rng.standard_normal(32).astype(dtype), rng.standard_normal(32).astype(dtype)
        wy = rng.standard_normal((16, 16, 32)).astype(dtype)
        seen: list[Any] = []
        real = _nn._ln_saved
        monkeypatch.setattr(_nn, "_ln_saved", lambda *a: seen.append(r := real(*a)) or r)
        saved = await grads()
        assert seen and all(r is not None for r in seen)  # the rule took the statistics from the forward
        monkeypatch.setattr(_nn, "_ln_saved", lambda *a: None)
        recomputed = await grads()
        for a, b in zip(saved, recomputed):
            assert a.dtype == dtype
            np.testing.assert_array_equal(a, b)


async def test_layer_norm_output_written_in_place_still_has_its_gradient_as_in_torch(
    rt: Any, rng: np.random.Generator, torch_ref
) -> None:
    # PyTorch's layer norm saves its statistics, not its output: a later in-place write to the output is
    # allowed, and the gradient is the one of the values before it
    with trio.fail_after(T):
        x0, w0, wy = rng.standard_normal((6, 8)), rng.standard_normal(8), rng.standard_normal((6, 8))
        x, w = ag.tensor(x0, requires_grad=True), ag.tensor(w0, requires_grad=True)
        y = ag.layer_norm(x, (8,), w)
        z = y + 0.0
        with ag.no_grad():
            y.mul_(3.0)
        gx, gw = await ag.grad((z * ag.tensor(wy)).sum() + y.sum(), [x, w])

        def reference(torch: Any) -> Any:
            tx, tw = torch.tensor(x0, requires_grad=True), torch.tensor(w0, requires_grad=True)
            ty = torch.nn.functional.layer_norm(tx, (8,), tw)
            tz = ty + 0.0
            with torch.no_grad():
                ty.mul_(3.0)
            return torch.autograd.grad((tz * torch.tensor(wy)).sum() + ty.sum(), [tx, tw])

        tgx, tgw = torch_ref("grads", reference, x=x0, w=w0, wy=wy)
        np.testing.assert_allclose(gx.numpy(), tgx, atol=1e-10, rtol=1e-9)
        np.testing.assert_allclose(gw.numpy(), tgw, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("case", ["causal", "float_mask", "bool_mask"])
async def test_sdpa_in_place_softmax_vs_torch(case: str, rt: Any, rng: np.random.Generator, torch_ref) -> None:
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

        def t(torch: Any, q: Any, k: Any, v: Any) -> Any:
            if case == "causal":
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            m = torch.tensor(fm) if case == "float_mask" else torch.tensor(bm)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

        await vs_torch(_with_inputs(torch_ref, fm=fm, bm=bm), "sdpa", a, t, q, k, v)


async def test_linear_leading_dims_fd_and_float32(rt: Any, rng: np.random.Generator, torch_ref) -> None:
    with trio.fail_after(T):
        x, w, b = rng.standard_normal((3, 2, 4)), rng.standard_normal((5, 4)), rng.standard_normal(5)
        await ag.autograd.gradcheck(ag.nn.functional.linear, [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=2)
        xt = ag.tensor(x[:, :, ::-1].astype(np.float32), requires_grad=True)  # a non-contiguous input too
        wt = ag.tensor(w[:, ::-1].astype(np.float32), requires_grad=True)
        y = ag.nn.functional.linear(xt, wt)
        gx, gw = await ag.grad(y.sum(), [xt, wt])

        def reference(torch: Any) -> Any:
            txx = torch.tensor(x[:, :, ::-1].astype(np.float32), requires_grad=True)
            tww = torch.tensor(w[:, ::-1].astype(np.float32), requires_grad=True)
            ty = torch.nn.functional.linear(txx, tww)
            ty.sum().backward()
            return ty.detach(), txx.grad, tww.grad

        ty, tgx, tgw = torch_ref("linear", reference, x=x, w=w)
        assert y.shape == (3, 2, 5) and gx.shape == (3, 2, 4)
        np.testing.assert_allclose(y.numpy(), ty, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gx.numpy(), tgx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gw.numpy(), tgw, rtol=1e-5, atol=1e-5)


async def test_lstm_float32_step_vs_torch(rt: Any, rng: np.random.Generator, torch_ref) -> None:
    with trio.fail_after(T):
        xa = rng.standard_normal((7, 3, 6)).astype(np.float32)

        def reference(torch: Any) -> Any:
            torch.manual_seed(0)
            tm = torch.nn.LSTM(6, 5, 2)
            state = state_from_torch(tm)
            tout, (th, tc) = tm(torch.tensor(xa))
            ((tout * tout).sum() + tc.sum()).backward()
            return {"state": state, "out": tout.detach(), "h": th.detach(), "grads": grads_of(tm)}

        want = torch_ref("lstm", reference, x=xa)
        am = ag.nn.LSTM(6, 5, 2)
        load_state(am, want["state"])
        out, (h, c) = am(ag.tensor(xa))
        loss = (out * out).sum() + c.sum()
        await loss.backward()
        np.testing.assert_allclose(out.numpy(), want["out"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(h.numpy(), want["h"], rtol=1e-5, atol=1e-6)
        for name, p in am.named_parameters():
            np.testing.assert_allclose(p.grad.numpy(), want["grads"][name], rtol=1e-4, atol=1e-5, err_msg=name)
