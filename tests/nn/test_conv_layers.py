"""Conv1d, ConvTranspose1d/2d, GroupNorm, AdaptiveAvgPool1d/2d, Upsample / interpolate against torch (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn import functional as F
from tests._util import (
    assert_close,
    assert_grads_match,
    load_from_torch,
    pair,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)

torch = pytest.importorskip("torch")


async def _check(am, tm, ax, tx, rng, fwd_kw=None) -> None:
    fwd_kw = fwd_kw or {}
    ay = am(ax, **fwd_kw)
    ty = tm(tx, **fwd_kw)
    assert ay.shape == tuple(ty.shape), (ay.shape, ty.shape)
    assert_close(ay, ty, "output")
    w = rng.standard_normal(tuple(ty.shape))
    await (ay * ag.tensor(w)).sum().backward()
    (ty * torch.tensor(w)).sum().backward()
    assert_close(ax.grad, tx.grad, "input grad")
    assert_grads_match(am, tm)


def _mods(name: str, *args, **kw):
    tm = getattr(torch.nn, name)(*args, **kw).double()
    am = getattr(nn, name)(*args, **kw, dtype=ag.float64)
    load_from_torch(am, tm)
    return am, tm


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"stride": 2, "padding": 1},
        {"dilation": 2, "padding": "same"},
        {"groups": 2, "padding": "valid", "bias": False},
        {"groups": 4, "stride": 3},
    ],
)
async def test_conv1d(rt, rng, kw) -> None:
    with trio.fail_after(30):
        am, tm = _mods("Conv1d", 4, 8, 3, **kw)
        ax, tx = pair(rng, (2, 4, 11), torch)
        await _check(am, tm, ax, tx, rng)


async def test_conv1d_unbatched(rt, rng) -> None:
    with trio.fail_after(30):
        am, tm = _mods("Conv1d", 3, 2, 2)
        ax, tx = pair(rng, (3, 7), torch)
        await _check(am, tm, ax, tx, rng)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"stride": 2},
        {"stride": 2, "padding": 1, "output_padding": 1},
        {"stride": (2, 3), "padding": (1, 0), "output_padding": (0, 2), "dilation": (1, 2)},
        {"groups": 2, "stride": 2, "bias": False},
        {"groups": 4, "dilation": 2, "output_padding": 1, "stride": 1},
    ],
)
async def test_conv_transpose2d(rt, rng, kw) -> None:
    with trio.fail_after(30):
        am, tm = _mods("ConvTranspose2d", 4, 8, 3, **kw)
        ax, tx = pair(rng, (2, 4, 5, 6), torch)
        await _check(am, tm, ax, tx, rng)


async def test_conv_transpose_output_size_and_1d(rt, rng) -> None:
    with trio.fail_after(30):
        am, tm = _mods("ConvTranspose2d", 3, 2, 3, stride=2, padding=1)
        ax, tx = pair(rng, (1, 3, 4, 4), torch)
        await _check(am, tm, ax, tx, rng, {"output_size": (8, 8)})
        with pytest.raises(ValueError, match="valid sizes range from 7 to 8"):
            am(ax, output_size=(9, 9))
        am, tm = _mods("ConvTranspose1d", 3, 4, 3, stride=2, padding=1, output_padding=1)
        ax, tx = pair(rng, (2, 3, 5), torch)
        await _check(am, tm, ax, tx, rng)
        am, tm = _mods("ConvTranspose2d", 3, 2, 2)
        ax, tx = pair(rng, (3, 4, 4), torch)  # unbatched
        await _check(am, tm, ax, tx, rng)


@pytest.mark.parametrize(
    "shape,groups,affine", [((2, 6, 5), 3, True), ((2, 8, 3, 4), 2, True), ((3, 4, 2, 2, 2), 4, False)]
)
async def test_group_norm(rt, rng, shape, groups, affine) -> None:
    with trio.fail_after(30):
        am, tm = _mods("GroupNorm", groups, shape[1], affine=affine, eps=1e-4)
        if affine:  # not the ones / zeros they start with
            sd = {"weight": rng.standard_normal(shape[1]), "bias": rng.standard_normal(shape[1])}
            tm.load_state_dict({k: torch.tensor(v) for k, v in sd.items()})
            am.load_state_dict(sd)
        ax, tx = pair(rng, shape, torch)
        await _check(am, tm, ax, tx, rng)


@pytest.mark.parametrize("out", [1, 3, (2, 5), (None, 4), (7, 6)])
async def test_adaptive_avg_pool2d(rt, rng, out) -> None:
    with trio.fail_after(30):
        tm, am = torch.nn.AdaptiveAvgPool2d(out), nn.AdaptiveAvgPool2d(out)
        ax, tx = pair(rng, (2, 3, 7, 10), torch)
        await _check(am, tm, ax, tx, rng)


async def test_adaptive_avg_pool1d_and_unbatched(rt, rng) -> None:
    with trio.fail_after(30):
        ax, tx = pair(rng, (2, 3, 10), torch)
        await _check(nn.AdaptiveAvgPool1d(4), torch.nn.AdaptiveAvgPool1d(4), ax, tx, rng)
        ax, tx = pair(rng, (3, 9, 5), torch)
        await _check(nn.AdaptiveAvgPool2d((4, 2)), torch.nn.AdaptiveAvgPool2d((4, 2)), ax, tx, rng)


INTERP = [
    ((2, 3, 5, 7), {"scale_factor": 2, "mode": "nearest"}),
    ((2, 3, 5, 7), {"size": (8, 3), "mode": "nearest"}),
    ((2, 3, 5, 7), {"scale_factor": 1.7, "mode": "nearest"}),
    ((2, 3, 5, 7), {"size": (9, 11), "mode": "nearest-exact"}),
    ((2, 3, 5, 7), {"scale_factor": 2, "mode": "bilinear", "align_corners": False}),
    ((2, 3, 5, 7), {"scale_factor": 2, "mode": "bilinear", "align_corners": True}),
    ((2, 3, 5, 7), {"size": (3, 12), "mode": "bilinear"}),
    ((2, 3, 5, 7), {"scale_factor": (1.5, 0.6), "mode": "bilinear", "recompute_scale_factor": True}),
    ((2, 3, 5, 7), {"scale_factor": 2.3, "mode": "bilinear"}),
    ((2, 3, 6), {"size": 10, "mode": "linear", "align_corners": True}),
    ((2, 3, 6), {"scale_factor": 3, "mode": "nearest"}),
    ((1, 2, 3, 4, 5), {"scale_factor": 2, "mode": "trilinear"}),
    ((2, 3, 8, 6), {"size": (3, 4), "mode": "area"}),
]


@pytest.mark.parametrize("shape,kw", INTERP)
async def test_interpolate(rt, rng, shape, kw) -> None:
    with trio.fail_after(30):
        ax, tx = pair(rng, shape, torch)
        ay = F.interpolate(ax, **kw)
        ty = torch.nn.functional.interpolate(tx, **kw)
        assert ay.shape == tuple(ty.shape)
        assert_close(ay, ty)
        w = rng.standard_normal(tuple(ty.shape))
        await (ay * ag.tensor(w)).sum().backward()
        (ty * torch.tensor(w)).sum().backward()
        assert_close(ax.grad, tx.grad)


async def test_upsample_modules(rt, rng) -> None:
    with trio.fail_after(30):
        ax, tx = pair(rng, (1, 2, 3, 4), torch)
        for am, tm in (
            (nn.Upsample(scale_factor=2, mode="bilinear"), torch.nn.Upsample(scale_factor=2, mode="bilinear")),
            (nn.Upsample(size=(5, 5)), torch.nn.Upsample(size=(5, 5))),
            (nn.UpsamplingNearest2d(scale_factor=3), torch.nn.UpsamplingNearest2d(scale_factor=3)),
            (nn.UpsamplingBilinear2d(size=(7, 2)), torch.nn.UpsamplingBilinear2d(size=(7, 2))),
        ):
            assert_close(am(ax), tm(tx), repr(am))


async def test_bad_arguments(rt) -> None:
    with trio.fail_after(30):
        x = ag.zeros((1, 4, 5, 5), dtype=ag.float64)
        with pytest.raises(ValueError, match="only one of size or scale_factor"):
            F.interpolate(x)
        with pytest.raises(ValueError, match="align_corners option can only be set"):
            F.interpolate(x, scale_factor=2, align_corners=True)
        with pytest.raises(NotImplementedError, match="bicubic"):
            F.interpolate(x, scale_factor=2, mode="bicubic")
        with pytest.raises(NotImplementedError, match="needs a 3-d input"):
            F.interpolate(x, scale_factor=2, mode="linear")
        with pytest.raises(ag.OpError, match="divisible by num_groups"):
            F.group_norm(x, 3)
        with pytest.raises(ValueError, match="divisible by num_groups"):
            nn.GroupNorm(3, 4)
        with pytest.raises(ag.OpError, match="has 4 channels but weight"):
            F.conv_transpose2d(x, ag.zeros((3, 2, 3, 3), dtype=ag.float64))
        with pytest.raises(ag.OpError, match="output padding must be smaller"):
            F.conv_transpose2d(x, ag.zeros((4, 2, 3, 3), dtype=ag.float64), output_padding=1)
        with pytest.raises(ValueError, match="in_channels must be divisible by groups"):
            nn.ConvTranspose2d(3, 4, 2, groups=2)
        with pytest.raises(ag.OpError, match="3-d weight"):
            F.conv1d(ag.zeros((1, 4, 5)), ag.zeros((2, 4, 3, 3)))
        with pytest.raises(ValueError, match="padding='same' is not supported for strided"):
            nn.Conv1d(2, 2, 3, stride=2, padding="same")
        with pytest.raises(ag.OpError, match="output_size"):
            F.adaptive_avg_pool2d(x, (1, 2, 3))


async def test_parameter_shapes_and_init(rt) -> None:
    with trio.fail_after(30):
        for name, args in (("Conv1d", (4, 6, 3)), ("ConvTranspose2d", (4, 6, 3)), ("GroupNorm", (2, 6))):
            am, tm = _mods(name, *args)
            assert [(k, v.shape) for k, v in am.state_dict().items()] == [
                (k, tuple(v.shape)) for k, v in tm.state_dict().items()
            ]
        ct = nn.ConvTranspose2d(4, 6, 3, groups=2)
        bound = 1 / np.sqrt(3 * 3 * 3)  # fan_in = weight.shape[1] * kH * kW, as torch computes it
        assert np.all(np.abs(ct.bias.numpy()) <= bound)


async def test_on_lanes(rt, rng, monkeypatch) -> None:
    """Every kernel queued on the lanes: a small decoder (ConvTranspose2d, GroupNorm, Upsample, adaptive
    pooling, Conv1d over the rows) matches torch in values and every gradient."""
    from tests._util import set_inline_limit

    set_inline_limit(monkeypatch, -1)

    def build(nn_, **kw):
        class Net(nn_.Module):
            def __init__(self):
                super().__init__()
                self.up = nn_.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, **kw)
                self.gn = nn_.GroupNorm(3, 6, **kw)
                self.rs = nn_.Upsample(scale_factor=1.5, mode="bilinear")
                self.pool = nn_.AdaptiveAvgPool2d((3, 5))
                self.c1 = nn_.Conv1d(6, 2, 3, padding=1, **kw)

            def forward(self, x):
                y = self.pool(self.rs(self.gn(self.up(x))))
                return self.c1(y.reshape(y.shape[0], 6, 15))

        return Net()

    with trio.fail_after(60):
        tm = build(torch.nn).double()
        am = build(nn, dtype=ag.float64)
        load_from_torch(am, tm)
        ax, tx = pair(rng, (2, 4, 5, 5), torch)
        await _check(am, tm, ax, tx, rng)


CONV_ARGS = [
    {"padding": "full"},
    {"padding": "same", "stride": 2},
    {"padding": "same", "stride": (1, 2)},
    {"groups": 3},
    {"groups": 0},
    {"groups": -1},
    {"out_channels": 6, "groups": 4},
    {"in_channels": 6, "groups": 4},
    {"padding_mode": "bogus"},
]


def _set_order(msg: str) -> str:
    """A message with PyTorch's printed sets (their order depends on string hashing) sorted."""
    import re

    return re.sub(r"\{([^{}]*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", msg)


@pytest.mark.parametrize("kw", CONV_ARGS, ids=str)
@pytest.mark.parametrize("nd", [1, 2])
def test_conv_constructor_errors_as_torch(nd: int, kw: dict) -> None:
    torch = pytest.importorskip("torch")
    kw = {"in_channels": 4, "out_channels": 4, "kernel_size": 3, **kw}
    if nd == 1 and isinstance(kw.get("stride"), tuple):
        kw["stride"] = kw["stride"][1:]
    name = f"Conv{nd}d"
    with pytest.raises(Exception) as want:
        getattr(torch.nn, name)(**kw)
    with pytest.raises(Exception) as got:
        getattr(nn, name)(**kw)
    assert type(got.value) is type(want.value)
    assert _set_order(str(got.value)) == _set_order(str(want.value))


CONV_INPUTS = [
    ((2, 4, 8, 8, 8), {}),  # too many dims
    ((8,), {}),  # too few
    ((2, 3, 8, 8), {}),  # wrong channels
    ((3, 8, 8), {}),  # wrong channels, unbatched
    ((2, 3, 8, 8), {"groups": 2}),
    ((2, 4, 2, 2), {}),  # smaller than the kernel
    ((2, 4, 4, 4), {"dilation": 2}),  # smaller than the dilated kernel
    ((2, 4, 2, 2), {"padding": (1, 0)}),
    ((2, 4, 2, 2), {"padding": 1}),  # fine once padded
    ((4, 5, 5), {"padding": "same", "dilation": 2}),
]


@pytest.mark.parametrize("shape, kw", CONV_INPUTS, ids=str)
@pytest.mark.parametrize("nd", [1, 2])
async def test_conv_forward_errors_as_torch(rt: ag.Runtime, nd: int, shape: tuple, kw: dict) -> None:
    """The modules' errors for an input they can't take are PyTorch's (type and words); inputs PyTorch takes
    give its values."""
    torch = pytest.importorskip("torch")
    shape = shape if nd == 2 else shape[:-1]
    kw = dict(kw)
    if nd == 1 and isinstance(kw.get("padding"), tuple):
        kw["padding"] = kw["padding"][:1]
    tm = getattr(torch.nn, f"Conv{nd}d")(4, 6, 3, dtype=torch.float64, **kw)
    am = getattr(nn, f"Conv{nd}d")(4, 6, 3, dtype=ag.float64, **kw)
    am.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    x = np.random.default_rng(3).standard_normal(shape)
    try:
        want = tm(torch.from_numpy(x)).detach().numpy()
    except RuntimeError as e:
        with pytest.raises(RuntimeError) as got:
            am(ag.tensor(x))
        assert str(got.value) == str(e)
        return
    np.testing.assert_allclose(am(ag.tensor(x)).numpy(), want, rtol=1e-10, atol=1e-12)
