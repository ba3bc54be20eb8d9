"""conv1d, conv_transpose1d/2d, group_norm, adaptive pooling and interpolate: finite-difference checks (float64)."""

from __future__ import annotations

import pytest
import trio

import asyncgrad as ag
from asyncgrad import ops


@pytest.mark.parametrize(
    "kw", [{}, {"stride": 2, "padding": 1, "output_padding": 1}, {"dilation": 2, "output_padding": 1, "groups": 2}]
)
async def test_conv_transpose2d_gradcheck(rt, rng, kw) -> None:
    x = rng.standard_normal((2, 4, 3, 3))
    w = rng.standard_normal((4, 3, 2, 3))
    b = rng.standard_normal(3 * kw.get("groups", 1))
    with trio.fail_after(60):
        assert await ag.autograd.gradcheck(lambda x, w, b: ops.conv_transpose2d(x, w, b, **kw), [x, w, b])


async def test_conv_transpose2d_second_derivative(rt, rng) -> None:
    x = rng.standard_normal((1, 2, 3, 3))
    w = rng.standard_normal((2, 2, 2, 2))
    with trio.fail_after(60):
        assert await ag.autograd.gradgradcheck(lambda x, w: ops.conv_transpose2d(x, w, stride=2) ** 2, [x, w])


async def test_conv1d_and_transpose1d_gradcheck(rt, rng) -> None:
    x = rng.standard_normal((2, 4, 7))
    w = rng.standard_normal((6, 2, 3))
    b = rng.standard_normal(6)
    wt = rng.standard_normal((4, 3, 3))
    with trio.fail_after(60):
        assert await ag.autograd.gradcheck(
            lambda x, w, b: ops.conv1d(x, w, b, stride=2, padding=1, groups=2), [x, w, b]
        )
        assert await ag.autograd.gradcheck(lambda x, w: ops.conv_transpose1d(x, w, stride=2, output_padding=1), [x, wt])


async def test_conv1d_forms_keep_the_2d_signature_and_name_themselves_in_errors(rt, rng) -> None:
    import inspect

    assert inspect.signature(ops.conv1d) == inspect.signature(ops.conv2d)
    assert inspect.signature(ops.conv_transpose1d) == inspect.signature(ops.conv_transpose2d)
    assert ops.conv1d.__name__ == "conv1d" and "conv1d" in ops.conv1d.__doc__
    x = ag.tensor(rng.standard_normal((2, 4, 7)))
    w = ag.tensor(rng.standard_normal((6, 4, 3)))
    # keyword and positional geometry give the same result; "same" padding keeps the length
    want = ops.conv1d(x, w, None, 1, 1).numpy()
    assert (ops.conv1d(x, w, padding=1).numpy() == want).all()
    assert (ops.conv1d(x, w, padding="same").numpy() == want).all()
    with pytest.raises(ag.OpError, match=r"conv1d: expected input \(N, C, L\) or \(C, L\).*\(2, 4, 7, 1\)"):
        ops.conv1d(x.reshape(2, 4, 7, 1), w)
    with pytest.raises(ag.OpError, match="conv_transpose1d: padding must be an int or a tuple of 1 ints"):
        ops.conv_transpose1d(x, ag.tensor(rng.standard_normal((4, 3, 3))), padding="same")
    with pytest.raises(TypeError, match=r"conv1d: .*dilatio"):
        ops.conv1d(x, w, dilatio=2)
    with pytest.raises(TypeError, match="conv_transpose1d: input and weight must be Tensors"):
        ops.conv_transpose1d(x.numpy(), w)


async def test_group_norm_gradcheck(rt, rng) -> None:
    x = rng.standard_normal((2, 6, 3, 2))
    w = rng.standard_normal(6)
    b = rng.standard_normal(6)
    with trio.fail_after(60):
        assert await ag.autograd.gradcheck(lambda x, w, b: ops.group_norm(x, 3, w, b, eps=1e-3), [x, w, b])


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: ops.adaptive_avg_pool2d(x, (2, 3)),
        lambda x: ops.adaptive_avg_pool1d(x.reshape(2, 15, 4), 3),
        lambda x: ops.interpolate(x, scale_factor=2, mode="bilinear"),
        lambda x: ops.interpolate(x, size=(7, 3), mode="bilinear", align_corners=True),
        lambda x: ops.interpolate(x, scale_factor=1.5, mode="nearest"),
        lambda x: ops.interpolate(x, size=(4, 6), mode="area"),
    ],
)
async def test_resampling_gradcheck(rt, rng, fn) -> None:
    x = rng.standard_normal((2, 3, 5, 4))
    with trio.fail_after(60):
        assert await ag.autograd.gradcheck(fn, [x])
