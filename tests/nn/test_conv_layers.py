"""Conv1d, ConvTranspose1d/2d, GroupNorm, AdaptiveAvgPool1d/2d, Upsample / interpolate against torch (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn import functional as F
from tests._util import (
    ATOL,
    RTOL,
    assert_grads_equal,
    grads_of,
    load_state,
    state_from_torch,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)


def _leaf(rng: np.random.Generator, shape: tuple) -> tuple[ag.Tensor, np.ndarray]:
    """A float64 asyncgrad leaf of standard normal values, and the values (what ``pair`` draws)."""
    x = rng.standard_normal(shape)
    return ag.tensor(x, dtype=ag.float64, requires_grad=True), x


def _torch_state(torch, sd: dict) -> dict:
    return {k: torch.tensor(v) for k, v in sd.items()}


def _init_state(torch_ref, make_tm, spec) -> dict:
    """The state of the torch module ``make_tm(torch)`` builds (its initial weights, from torch's generator)."""
    return torch_ref("init", lambda torch: state_from_torch(make_tm(torch)), spec=spec)


async def _check(torch_ref, am, make_tm, spec, state, ax, x, rng, fwd_kw=None) -> None:
    """``am`` (holding ``state``) against the torch module ``make_tm(torch)`` loaded with ``state``: the output,
    the input's gradient and every parameter's for a random output weighting (drawn from ``rng``)."""
    fwd_kw = fwd_kw or {}
    ay = am(ax, **fwd_kw)
    w = rng.standard_normal(ay.shape)

    def reference(torch):
        tm = make_tm(torch)
        tm.load_state_dict(_torch_state(torch, state))
        tx = torch.tensor(x, requires_grad=True)
        ty = tm(tx, **fwd_kw)
        if tuple(ty.shape) != w.shape:  # the test fails on the shape
            return {"shape": ty.shape}
        (ty * torch.tensor(w)).sum().backward()
        return {"shape": ty.shape, "y": ty.detach(), "x_grad": tx.grad, "grads": grads_of(tm)}

    want = torch_ref("check", reference, spec=spec, state=state, x=x, w=w, fwd_kw=fwd_kw)
    assert ay.shape == want["shape"], (ay.shape, want["shape"])
    np.testing.assert_allclose(ay.numpy(), want["y"], rtol=RTOL, atol=ATOL, err_msg="output")
    await (ay * ag.tensor(w)).sum().backward()
    np.testing.assert_allclose(ax.grad.numpy(), want["x_grad"], rtol=RTOL, atol=ATOL, err_msg="input grad")
    assert_grads_equal(am, want["grads"])


def _keyed(torch_ref, prefix: str):
    """``torch_ref`` whose keys start with ``prefix`` (one test checking several modules)."""
    return lambda key, fn, **inputs: torch_ref(f"{prefix}.{key}", fn, **inputs)


def _mods(torch_ref, name: str, *args, **kw):
    """The asyncgrad module ``nn.<name>`` with the initial state of torch's, how to build torch's, what names
    it (recorded), and that state."""
    spec = {"name": name, "args": args, "kw": kw}

    def make_tm(torch):
        return getattr(torch.nn, name)(*args, **kw).double()

    state = _init_state(torch_ref, make_tm, spec)
    am = getattr(nn, name)(*args, **kw, dtype=ag.float64)
    load_state(am, state)
    return am, make_tm, spec, state


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
async def test_conv1d(rt, rng, kw, torch_ref) -> None:
    with trio.fail_after(30):
        am, make_tm, spec, state = _mods(torch_ref, "Conv1d", 4, 8, 3, **kw)
        ax, x = _leaf(rng, (2, 4, 11))
        await _check(torch_ref, am, make_tm, spec, state, ax, x, rng)


async def test_conv1d_unbatched(rt, rng, torch_ref) -> None:
    with trio.fail_after(30):
        am, make_tm, spec, state = _mods(torch_ref, "Conv1d", 3, 2, 2)
        ax, x = _leaf(rng, (3, 7))
        await _check(torch_ref, am, make_tm, spec, state, ax, x, rng)


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
async def test_conv_transpose2d(rt, rng, kw, torch_ref) -> None:
    with trio.fail_after(30):
        am, make_tm, spec, state = _mods(torch_ref, "ConvTranspose2d", 4, 8, 3, **kw)
        ax, x = _leaf(rng, (2, 4, 5, 6))
        await _check(torch_ref, am, make_tm, spec, state, ax, x, rng)


async def test_conv_transpose_output_size_and_1d(rt, rng, torch_ref) -> None:
    with trio.fail_after(30):
        for i, (name, args, kw, shape, fwd_kw) in enumerate([
            ("ConvTranspose2d", (3, 2, 3), {"stride": 2, "padding": 1}, (1, 3, 4, 4), {"output_size": (8, 8)}),
            ("ConvTranspose1d", (3, 4, 3), {"stride": 2, "padding": 1, "output_padding": 1}, (2, 3, 5), None),
            ("ConvTranspose2d", (3, 2, 2), {}, (3, 4, 4), None),  # unbatched
        ]):
            case_ref = _keyed(torch_ref, str(i))
            am, make_tm, spec, state = _mods(case_ref, name, *args, **kw)
            ax, x = _leaf(rng, shape)
            await _check(case_ref, am, make_tm, spec, state, ax, x, rng, fwd_kw)
            if i == 0:
                with pytest.raises(ValueError, match="valid sizes range from 7 to 8"):
                    am(ax, output_size=(9, 9))


@pytest.mark.parametrize(
    "shape,groups,affine", [((2, 6, 5), 3, True), ((2, 8, 3, 4), 2, True), ((3, 4, 2, 2, 2), 4, False)]
)
async def test_group_norm(rt, rng, shape, groups, affine, torch_ref) -> None:
    with trio.fail_after(30):
        am, make_tm, spec, state = _mods(torch_ref, "GroupNorm", groups, shape[1], affine=affine, eps=1e-4)
        if affine:  # not the ones / zeros they start with
            state = {"weight": rng.standard_normal(shape[1]), "bias": rng.standard_normal(shape[1])}
            am.load_state_dict(state)
        ax, x = _leaf(rng, shape)
        await _check(torch_ref, am, make_tm, spec, state, ax, x, rng)


@pytest.mark.parametrize("out", [1, 3, (2, 5), (None, 4), (7, 6)])
async def test_adaptive_avg_pool2d(rt, rng, out, torch_ref) -> None:
    with trio.fail_after(30):
        am = nn.AdaptiveAvgPool2d(out)
        ax, x = _leaf(rng, (2, 3, 7, 10))
        await _check(torch_ref, am, lambda torch: torch.nn.AdaptiveAvgPool2d(out), {"out": out}, {}, ax, x, rng)


async def test_adaptive_avg_pool1d_and_unbatched(rt, rng, torch_ref) -> None:
    with trio.fail_after(30):
        ax, x = _leaf(rng, (2, 3, 10))
        await _check(_keyed(torch_ref, "1d"), nn.AdaptiveAvgPool1d(4), lambda torch: torch.nn.AdaptiveAvgPool1d(4),
                     "AdaptiveAvgPool1d(4)", {}, ax, x, rng)
        ax, x = _leaf(rng, (3, 9, 5))
        await _check(_keyed(torch_ref, "2d"), nn.AdaptiveAvgPool2d((4, 2)),
                     lambda torch: torch.nn.AdaptiveAvgPool2d((4, 2)), "AdaptiveAvgPool2d((4, 2))", {}, ax, x, rng)


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
async def test_interpolate(rt, rng, shape, kw, torch_ref) -> None:
    with trio.fail_after(30):
        ax, x = _leaf(rng, shape)
        ay = F.interpolate(ax, **kw)
        w = rng.standard_normal(ay.shape)

        def reference(torch):
            tx = torch.tensor(x, requires_grad=True)
            ty = torch.nn.functional.interpolate(tx, **kw)
            if tuple(ty.shape) != w.shape:  # the test fails on the shape
                return ty.shape, None, None
            (ty * torch.tensor(w)).sum().backward()
            return ty.shape, ty.detach(), tx.grad

        tshape, ty, tgx = torch_ref("interpolate", reference, x=x, w=w, kw=kw)
        assert ay.shape == tshape
        np.testing.assert_allclose(ay.numpy(), ty, rtol=RTOL, atol=ATOL)
        await (ay * ag.tensor(w)).sum().backward()
        np.testing.assert_allclose(ax.grad.numpy(), tgx, rtol=RTOL, atol=ATOL)


async def test_upsample_modules(rt, rng, torch_ref) -> None:
    with trio.fail_after(30):
        ax, x = _leaf(rng, (1, 2, 3, 4))
        mods = (
            ("Upsample", {"scale_factor": 2, "mode": "bilinear"}),
            ("Upsample", {"size": (5, 5)}),
            ("UpsamplingNearest2d", {"scale_factor": 3}),
            ("UpsamplingBilinear2d", {"size": (7, 2)}),
        )

        def reference(torch):
            tx = torch.tensor(x, requires_grad=True)
            return [getattr(torch.nn, name)(**kw)(tx).detach() for name, kw in mods]

        want = torch_ref("upsample", reference, x=x, mods=list(mods))
        for (name, kw), ty in zip(mods, want, strict=True):
            am = getattr(nn, name)(**kw)
            np.testing.assert_allclose(am(ax).numpy(), ty, rtol=RTOL, atol=ATOL, err_msg=repr(am))


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


async def test_parameter_shapes_and_init(rt, torch_ref) -> None:
    with trio.fail_after(30):
        for name, args in (("Conv1d", (4, 6, 3)), ("ConvTranspose2d", (4, 6, 3)), ("GroupNorm", (2, 6))):
            am, _, _, state = _mods(_keyed(torch_ref, name), name, *args)
            assert [(k, v.shape) for k, v in am.state_dict().items()] == [
                (k, tuple(v.shape)) for k, v in state.items()
            ]
        ct = nn.ConvTranspose2d(4, 6, 3, groups=2)
        bound = 1 / np.sqrt(3 * 3 * 3)  # fan_in = weight.shape[1] * kH * kW, as torch computes it
        assert np.all(np.abs(ct.bias.numpy()) <= bound)


async def test_on_lanes(rt, rng, monkeypatch, torch_ref) -> None:
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

        def make_tm(torch):
            return build(torch.nn).double()

        state = _init_state(torch_ref, make_tm, "decoder")
        am = build(nn, dtype=ag.float64)
        load_state(am, state)
        ax, x = _leaf(rng, (2, 4, 5, 5))
        await _check(torch_ref, am, make_tm, "decoder", state, ax, x, rng)


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


def _type_name(e: BaseException) -> str:
    """An exception's class as a recordable name: ``builtins.ValueError``."""
    return f"{type(e).__module__}.{type(e).__qualname__}"


def _set_order(msg: str) -> str:
    """A message with PyTorch's printed sets (their order depends on string hashing) sorted."""
    import re

    return re.sub(r"\{([^{}]*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", msg)


@pytest.mark.parametrize("kw", CONV_ARGS, ids=str)
@pytest.mark.parametrize("nd", [1, 2])
def test_conv_constructor_errors_as_torch(nd: int, kw: dict, torch_ref) -> None:
    kw = {"in_channels": 4, "out_channels": 4, "kernel_size": 3, **kw}
    if nd == 1 and isinstance(kw.get("stride"), tuple):
        kw["stride"] = kw["stride"][1:]
    name = f"Conv{nd}d"

    def reference(torch):
        try:
            getattr(torch.nn, name)(**kw)
        except Exception as e:
            # the message with its sets sorted: as printed, their order changes from run to run
            return _type_name(e), _set_order(str(e))
        return None  # did not raise: the test fails

    want = torch_ref("error", reference, name=name, kw=kw)
    assert want is not None, f"torch's {name}(**{kw}) raised nothing"
    with pytest.raises(Exception) as got:
        getattr(nn, name)(**kw)
    assert _type_name(got.value) == want[0]
    assert _set_order(str(got.value)) == want[1]


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
async def test_conv_forward_errors_as_torch(rt: ag.Runtime, nd: int, shape: tuple, kw: dict, torch_ref) -> None:
    """The modules' errors for an input they can't take are PyTorch's (type and words); inputs PyTorch takes
    give its values."""
    shape = shape if nd == 2 else shape[:-1]
    kw = dict(kw)
    if nd == 1 and isinstance(kw.get("padding"), tuple):
        kw["padding"] = kw["padding"][:1]
    x = np.random.default_rng(3).standard_normal(shape)

    def reference(torch):
        tm = getattr(torch.nn, f"Conv{nd}d")(4, 6, 3, dtype=torch.float64, **kw)
        out = {"state": state_from_torch(tm), "error": None, "y": None}
        try:
            out["y"] = tm(torch.from_numpy(x)).detach()
        except RuntimeError as e:
            out["error"] = str(e)
        return out

    want = torch_ref("forward", reference, nd=nd, kw=kw, x=x)
    am = getattr(nn, f"Conv{nd}d")(4, 6, 3, dtype=ag.float64, **kw)
    am.load_state_dict(want["state"])
    if want["error"] is not None:
        with pytest.raises(RuntimeError) as got:
            am(ag.tensor(x))
        assert str(got.value) == want["error"]
        return
    np.testing.assert_allclose(am(ag.tensor(x)).numpy(), want["y"], rtol=1e-10, atol=1e-12)
