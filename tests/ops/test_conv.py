"""The conv ops (``ops/_conv.py``): conv2d and max/avg pooling, values against PyTorch, gradients against
central finite differences in float64 (``ag.autograd.gradcheck``), channels-last layouts and errors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import channels_last, output_weights, vs_torch

# ---- helpers ----------------------------------------------------------------------------------------------


def _copy(a: np.ndarray) -> np.ndarray:
    return np.array(a, dtype=np.float64, order="K", copy=True)  # keeps channels-last / permuted strides


# ---- conv2d ------------------------------------------------------------------------------------------

CONV_CASES = [
    # (input shape, weight shape, kwargs)
    ((2, 3, 5, 5), (4, 3, 3, 3), {}),
    ((2, 3, 6, 7), (4, 3, 3, 2), {"stride": 2, "padding": 1}),
    ((1, 4, 7, 7), (6, 2, 3, 3), {"groups": 2, "dilation": 2, "padding": (1, 2)}),
    ((2, 4, 5, 6), (4, 1, 3, 3), {"groups": 4, "stride": (2, 1), "padding": 1}),  # depthwise
    ((1, 2, 6, 6), (3, 2, 2, 3), {"padding": "same", "dilation": (2, 1)}),
]


# ---- pooling ----------------------------------------------------------------------------------------

POOL_CASES = [
    (2, None, 0, 1, False),
    ((3, 2), (2, 1), (1, 1), 1, False),
    (3, 2, 1, 1, True),
    (2, 2, 0, 2, False),
    (3, 3, 1, 1, True),
]


AVG_CASES = [
    (2, None, 0, False, True, None),
    (3, 2, 1, False, True, None),
    (3, 2, 1, True, False, None),
    ((3, 2), (2, 3), (1, 1), True, True, None),
    (3, 2, 1, False, True, 4),
]


@pytest.mark.parametrize("xs,ws,kw", CONV_CASES)
async def test_conv2d_grad_fd(xs: Any, ws: Any, kw: Any, rng: np.random.Generator) -> None:
    async with ag.open_runtime():
        x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
        await ag.autograd.gradcheck(
            lambda x, w, b: ag.conv2d(x, w, b, **kw), [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
        )


async def test_conv2d_channels_last_grad_fd_and_layout(rng: np.random.Generator) -> None:
    async with ag.open_runtime():
        x = channels_last(rng.standard_normal((2, 4, 6, 6)))
        w = channels_last(rng.standard_normal((6, 2, 3, 3)))
        kw = {"groups": 2, "dilation": (1, 2), "padding": 2, "stride": (1, 2)}
        fx, fw = ag.from_numpy(_copy(x)).requires_grad_(), ag.from_numpy(_copy(w)).requires_grad_()
        fy = ag.conv2d(fx, fw, None, **kw)
        gx, gw = await ag.grad((fy * ag.from_numpy(output_weights(fy.shape))).sum(), [fx, fw])
        await ag.autograd.gradcheck(
            lambda x, w: ag.conv2d(x, w, None, **kw), [x, w], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
        )
        # the layout contract: gradients come back with the parameters' (channels-last) strides
        xt = ag.from_numpy(_copy(x)).requires_grad_()
        wt = ag.from_numpy(_copy(w)).requires_grad_()
        y = ag.conv2d(xt, wt, None, **kw)
        assert y.numpy().strides[1] == 8  # channels-last in, channels-last out
        await (y * ag.from_numpy(output_weights(y.shape))).sum().backward()
        assert xt.grad.numpy().strides == xt.numpy().strides
        assert wt.grad.numpy().strides == wt.numpy().strides
        np.testing.assert_allclose(xt.grad.numpy(), gx.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(wt.grad.numpy(), gw.numpy(), rtol=1e-12, atol=1e-12)
        # same values as the NCHW computation
        y2 = ag.conv2d(ag.tensor(np.ascontiguousarray(x)), ag.tensor(np.ascontiguousarray(w)), None, **kw)
        np.testing.assert_allclose(y.numpy(), y2.numpy(), rtol=1e-12, atol=1e-12)


async def test_conv2d_mixed_layouts_and_big_batch(rng: np.random.Generator) -> None:
    async with ag.open_runtime():
        # kernels large enough to run on the worker lanes; NCHW weights with channels-last input and back
        x = rng.standard_normal((16, 3, 12, 12))
        w = rng.standard_normal((8, 3, 3, 3))
        ref = None
        for xl, wl in [
            (x, w),
            (channels_last(x), w),
            (x, channels_last(w)),
            (channels_last(x), channels_last(w)),
        ]:
            xt = ag.from_numpy(_copy(xl)).requires_grad_()
            wt = ag.from_numpy(_copy(wl)).requires_grad_()
            y = ag.conv2d(xt, wt, padding=1)
            await (y * y).sum().backward()
            assert xt.grad.numpy().strides == xt.numpy().strides
            assert wt.grad.numpy().strides == wt.numpy().strides
            got = (y.numpy(), xt.grad.numpy(), wt.grad.numpy())
            if ref is None:
                ref = got
            for a, b in zip(got, ref):
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


async def test_conv2d_unbatched_and_errors(rng: np.random.Generator) -> None:
    async with ag.open_runtime():
        x, w = rng.standard_normal((3, 5, 5)), rng.standard_normal((2, 3, 3, 3))
        await ag.autograd.gradcheck(
            lambda x, w: ag.conv2d(x, w, padding=1), [x, w], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
        )
        with pytest.raises(ag.OpError, match="channels"):
            ag.conv2d(ag.tensor(rng.standard_normal((1, 4, 5, 5))), ag.tensor(w))
        with pytest.raises(ag.OpError, match="divisible by groups"):
            ag.conv2d(ag.tensor(rng.standard_normal((1, 3, 5, 5))), ag.tensor(w), groups=2)
        with pytest.raises(ag.OpError, match="smaller than"):
            ag.conv2d(ag.tensor(rng.standard_normal((1, 3, 2, 2))), ag.tensor(w))


@pytest.mark.parametrize("xs,ws,kw", CONV_CASES)
async def test_conv2d_vs_torch(xs: Any, ws: Any, kw: Any, rng: np.random.Generator, torch_ref) -> None:
    async with ag.open_runtime():
        x, w, b = rng.standard_normal((3, *xs[1:])), rng.standard_normal(ws), rng.standard_normal(ws[0])
        await vs_torch(
            torch_ref,
            "conv2d",
            lambda x, w, b: ag.conv2d(x, w, b, **kw),
            lambda torch, x, w, b: torch.nn.functional.conv2d(x, w, b, **kw),
            x,
            w,
            b,
        )


@pytest.mark.parametrize("k,s,p,d,ceil", POOL_CASES)
async def test_max_pool2d(
    k: Any, s: Any, p: Any, d: Any, ceil: bool, rng: np.random.Generator, torch_ref
) -> None:
    async with ag.open_runtime():
        x = rng.permutation(2 * 3 * 7 * 8).reshape(2, 3, 7, 8) / 10.0  # no ties: FD is exact away from kinks

        def f(x: Any) -> Any:
            return ag.max_pool2d(x, k, s, p, d, ceil)

        await ag.autograd.gradcheck(f, [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await ag.autograd.gradcheck(f, [channels_last(x)], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await vs_torch(
            torch_ref, "max_pool2d", f, lambda torch, x: torch.nn.functional.max_pool2d(x, k, s, p, d, ceil), x
        )
        _, idx = ag.max_pool2d(ag.tensor(x), k, s, p, d, ceil, return_indices=True)

        def indices(torch: Any) -> Any:
            return torch.nn.functional.max_pool2d(torch.tensor(x), k, s, p, d, ceil, return_indices=True)[1]

        tidx = torch_ref("max_pool2d_indices", indices, x=x)
        np.testing.assert_array_equal(idx.numpy(), tidx)


async def test_max_pool2d_ties_and_unbatched(torch_ref) -> None:
    async with ag.open_runtime():
        x = np.zeros((2, 4, 4))
        x[:, 1:3, 1:3] = 1.0  # every 3x3 window holds ties: the gradient goes to the first max, like PyTorch
        await vs_torch(
            torch_ref,
            "ties",
            lambda x: ag.max_pool2d(x, 3, 1),
            lambda torch, x: torch.nn.functional.max_pool2d(x, 3, 1),
            x,
        )
        # NaNs propagate, and their gradient goes where PyTorch sends it
        y = np.arange(32.0).reshape(2, 4, 4)
        y[0, 0, 0] = y[0, 1, 1] = y[1, 2, 3] = np.nan
        await vs_torch(
            torch_ref,
            "nan",
            lambda x: ag.max_pool2d(x, 2, 1),
            lambda torch, x: torch.nn.functional.max_pool2d(x, 2, 1),
            y,
        )


@pytest.mark.parametrize("k,s,p,ceil,cip,div", AVG_CASES)
async def test_avg_pool2d(
    k: Any, s: Any, p: Any, ceil: bool, cip: bool, div: Any, rng: np.random.Generator, torch_ref
) -> None:
    async with ag.open_runtime():
        x = rng.standard_normal((2, 3, 7, 8))

        def f(x: Any) -> Any:
            return ag.avg_pool2d(x, k, s, p, ceil, cip, div)

        await ag.autograd.gradcheck(f, [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await ag.autograd.gradcheck(f, [channels_last(x)], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await vs_torch(
            torch_ref, "avg_pool2d", f, lambda torch, x: torch.nn.functional.avg_pool2d(x, k, s, p, ceil, cip, div), x
        )


async def test_pool_layout_and_errors(rng: np.random.Generator) -> None:
    async with ag.open_runtime():
        x = ag.from_numpy(channels_last(rng.standard_normal((4, 16, 10, 10)))).requires_grad_()
        y = ag.max_pool2d(x, 2) + ag.avg_pool2d(x, 2)
        await y.sum().backward()
        assert x.grad.numpy().strides == x.numpy().strides
        with pytest.raises(ag.OpError, match="half of effective kernel"):
            ag.max_pool2d(x, 2, padding=2)
