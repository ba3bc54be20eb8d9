"""Gradient and value tests for the nn ops: conv2d, pooling, embedding, layer_norm, dropout, logsumexp,
clamp, gather, index_select, cumsum, einsum, var/std and the losses.

Every op's gradient is checked against central finite differences in float64 (``ag.autograd.gradcheck``
at eps=1e-6, atol=1e-7, rtol=1e-5); second derivatives (``create_graph=True``) against finite differences
of the first gradient along random directions (``ag.autograd.gradgradcheck(directions=2)``). Values and
gradients are compared with PyTorch where it is installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad.devices import KernelError

Fn = Callable[..., Any]

# a bad index raises IndexError from a kernel run inline, or KernelError (naming it) from one run on a lane
_INDEX_ERRORS = (IndexError, KernelError)


# ---- finite-difference helpers (float64) ------------------------------------------------------------


def _copy(a: np.ndarray) -> np.ndarray:
    return np.array(a, dtype=np.float64, order="K", copy=True)  # keeps channels-last / permuted strides


def _weights(shape: tuple[int, ...], seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _channels_last(a: np.ndarray) -> np.ndarray:
    """The same values as ``a`` (N, C, H, W), stored NHWC: a permuted-stride view."""
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


async def _vs_torch(ag_fn: Fn, torch_fn: Fn, *inputs: np.ndarray, atol: float = 1e-10) -> None:
    """Values and gradients (for a random output weighting) against PyTorch, in float64."""
    torch = pytest.importorskip("torch")
    leaves = [ag.tensor(a, dtype=np.float64, requires_grad=True) for a in inputs]
    out = ag_fn(*leaves)
    tl = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inputs]
    tout = torch_fn(*tl)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), atol=atol, rtol=1e-9)
    w = _weights(out.shape)
    grads = await ag.grad((out * ag.tensor(w)).sum(), leaves, allow_unused=True)
    tg = torch.autograd.grad((tout * torch.tensor(w)).sum(), tl, allow_unused=True)
    for i, (g, t) in enumerate(zip(grads, tg)):
        gv = np.zeros(inputs[i].shape) if g is None else g.numpy()
        tv = np.zeros(inputs[i].shape) if t is None else t.numpy()
        np.testing.assert_allclose(gv, tv, atol=atol, rtol=1e-8, err_msg=f"gradient of input {i}")


def _call_method(name: str, args: Any, kw: Any, x: Any) -> Any:
    """``x.name(*args, **kw)``: the same call on an asyncgrad or a torch tensor."""
    return getattr(x, name)(*args, **kw)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# ---- conv2d ------------------------------------------------------------------------------------------

CONV_CASES = [
    # (input shape, weight shape, kwargs)
    ((2, 3, 5, 5), (4, 3, 3, 3), {}),
    ((2, 3, 6, 7), (4, 3, 3, 2), {"stride": 2, "padding": 1}),
    ((1, 4, 7, 7), (6, 2, 3, 3), {"groups": 2, "dilation": 2, "padding": (1, 2)}),
    ((2, 4, 5, 6), (4, 1, 3, 3), {"groups": 4, "stride": (2, 1), "padding": 1}),  # depthwise
    ((1, 2, 6, 6), (3, 2, 2, 3), {"padding": "same", "dilation": (2, 1)}),
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
        x = _channels_last(rng.standard_normal((2, 4, 6, 6)))
        w = _channels_last(rng.standard_normal((6, 2, 3, 3)))
        kw = {"groups": 2, "dilation": (1, 2), "padding": 2, "stride": (1, 2)}
        fx, fw = ag.from_numpy(_copy(x)).requires_grad_(), ag.from_numpy(_copy(w)).requires_grad_()
        fy = ag.conv2d(fx, fw, None, **kw)
        gx, gw = await ag.grad((fy * ag.from_numpy(_weights(fy.shape))).sum(), [fx, fw])
        await ag.autograd.gradcheck(
            lambda x, w: ag.conv2d(x, w, None, **kw), [x, w], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
        )
        # the layout contract: gradients come back with the parameters' (channels-last) strides
        xt = ag.from_numpy(_copy(x)).requires_grad_()
        wt = ag.from_numpy(_copy(w)).requires_grad_()
        y = ag.conv2d(xt, wt, None, **kw)
        assert y.numpy().strides[1] == 8  # channels-last in, channels-last out
        await (y * ag.from_numpy(_weights(y.shape))).sum().backward()
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
            (_channels_last(x), w),
            (x, _channels_last(w)),
            (_channels_last(x), _channels_last(w)),
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
async def test_conv2d_vs_torch(xs: Any, ws: Any, kw: Any, rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x, w, b = rng.standard_normal((3, *xs[1:])), rng.standard_normal(ws), rng.standard_normal(ws[0])
        await _vs_torch(
            lambda x, w, b: ag.conv2d(x, w, b, **kw),
            lambda x, w, b: torch.nn.functional.conv2d(x, w, b, **kw),
            x,
            w,
            b,
        )


# ---- pooling ----------------------------------------------------------------------------------------

POOL_CASES = [
    (2, None, 0, 1, False),
    ((3, 2), (2, 1), (1, 1), 1, False),
    (3, 2, 1, 1, True),
    (2, 2, 0, 2, False),
    (3, 3, 1, 1, True),
]


@pytest.mark.parametrize("k,s,p,d,ceil", POOL_CASES)
async def test_max_pool2d(k: Any, s: Any, p: Any, d: Any, ceil: bool, rng: np.random.Generator) -> None:
    async with ag.open_runtime():
        x = rng.permutation(2 * 3 * 7 * 8).reshape(2, 3, 7, 8) / 10.0  # no ties: FD is exact away from kinks

        def f(x: Any) -> Any:
            return ag.max_pool2d(x, k, s, p, d, ceil)

        await ag.autograd.gradcheck(f, [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await ag.autograd.gradcheck(f, [_channels_last(x)], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        torch = pytest.importorskip("torch")
        await _vs_torch(f, lambda x: torch.nn.functional.max_pool2d(x, k, s, p, d, ceil), x)
        _, idx = ag.max_pool2d(ag.tensor(x), k, s, p, d, ceil, return_indices=True)
        _, tidx = torch.nn.functional.max_pool2d(torch.tensor(x), k, s, p, d, ceil, return_indices=True)
        np.testing.assert_array_equal(idx.numpy(), tidx.numpy())


async def test_max_pool2d_ties_and_unbatched() -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x = np.zeros((2, 4, 4))
        x[:, 1:3, 1:3] = 1.0  # every 3x3 window holds ties: the gradient goes to the first max, like PyTorch
        await _vs_torch(
            lambda x: ag.max_pool2d(x, 3, 1), lambda x: torch.nn.functional.max_pool2d(x, 3, 1), x
        )
        # NaNs propagate, and their gradient goes where PyTorch sends it
        y = np.arange(32.0).reshape(2, 4, 4)
        y[0, 0, 0] = y[0, 1, 1] = y[1, 2, 3] = np.nan
        await _vs_torch(
            lambda x: ag.max_pool2d(x, 2, 1), lambda x: torch.nn.functional.max_pool2d(x, 2, 1), y
        )


AVG_CASES = [
    (2, None, 0, False, True, None),
    (3, 2, 1, False, True, None),
    (3, 2, 1, True, False, None),
    ((3, 2), (2, 3), (1, 1), True, True, None),
    (3, 2, 1, False, True, 4),
]


@pytest.mark.parametrize("k,s,p,ceil,cip,div", AVG_CASES)
async def test_avg_pool2d(
    k: Any, s: Any, p: Any, ceil: bool, cip: bool, div: Any, rng: np.random.Generator
) -> None:
    async with ag.open_runtime():
        x = rng.standard_normal((2, 3, 7, 8))

        def f(x: Any) -> Any:
            return ag.avg_pool2d(x, k, s, p, ceil, cip, div)

        await ag.autograd.gradcheck(f, [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await ag.autograd.gradcheck(f, [_channels_last(x)], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        torch = pytest.importorskip("torch")
        await _vs_torch(f, lambda x: torch.nn.functional.avg_pool2d(x, k, s, p, ceil, cip, div), x)


async def test_pool_layout_and_errors(rng: np.random.Generator) -> None:
    async with ag.open_runtime():
        x = ag.from_numpy(_channels_last(rng.standard_normal((4, 16, 10, 10)))).requires_grad_()
        y = ag.max_pool2d(x, 2) + ag.avg_pool2d(x, 2)
        await y.sum().backward()
        assert x.grad.numpy().strides == x.numpy().strides
        with pytest.raises(ag.OpError, match="half of effective kernel"):
            ag.max_pool2d(x, 2, padding=2)


# ---- embedding ----------------------------------------------------------------------------------------


async def test_embedding(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        w = rng.standard_normal((6, 3))
        idx = np.array([[0, 2, 2], [5, 1, 2]])
        await ag.autograd.gradcheck(lambda w: ag.embedding(idx, w), [w], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        # padding_idx and scale_grad_by_freq change the gradient on purpose (no longer the true one)
        for kw in [
            {},
            {"padding_idx": 2},
            {"scale_grad_by_freq": True},
            {"padding_idx": 5, "scale_grad_by_freq": True},
        ]:
            await _vs_torch(
                lambda w, kw=kw: ag.embedding(ag.tensor(idx), w, **kw),
                lambda w, kw=kw: torch.nn.functional.embedding(torch.tensor(idx), w, **kw),
                w,
            )
        # max_norm renormalises the looked-up rows in place, like PyTorch
        wa, wt = ag.tensor(w * 3), torch.tensor(w * 3)
        out = ag.embedding(idx, wa, max_norm=1.5)
        tout = torch.nn.functional.embedding(torch.tensor(idx), wt, max_norm=1.5)
        np.testing.assert_allclose(out.numpy(), tout.numpy(), rtol=1e-12)
        np.testing.assert_allclose(wa.numpy(), wt.numpy(), rtol=1e-12)
        with pytest.raises(_INDEX_ERRORS, match="out of range"):
            ag.embedding(np.array([6]), ag.tensor(w)).numpy()


# ---- layer_norm --------------------------------------------------------------------------------------


async def test_layer_norm(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.standard_normal((3, 2, 5))
        w, b = rng.standard_normal(5), rng.standard_normal(5)
        await ag.autograd.gradcheck(
            lambda x, w, b: ag.layer_norm(x, (5,), w, b), [x, w, b], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
        )
        w2, b2 = rng.standard_normal((2, 5)), rng.standard_normal((2, 5))
        await ag.autograd.gradcheck(
            lambda x, w, b: ag.layer_norm(x, (2, 5), w, b, eps=1e-3),
            [x, w2, b2],
            eps=1e-6,
            atol=1e-7,
            rtol=1e-5,
            seed=7,
        )
        await ag.autograd.gradcheck(lambda x: ag.layer_norm(x, 5), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await _vs_torch(
            lambda x, w, b: ag.layer_norm(x, (2, 5), w, b),
            lambda x, w, b: torch.nn.functional.layer_norm(x, (2, 5), w, b),
            x,
            w2,
            b2,
        )
        big = rng.standard_normal((64, 128)).astype(np.float32)  # float32, on a lane
        out = ag.layer_norm(ag.tensor(big), (128,))
        ref = torch.nn.functional.layer_norm(torch.tensor(big), (128,))
        assert out.dtype == np.float32
        np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=1e-5)


# ---- dropout ---------------------------------------------------------------------------------------------


async def test_dropout(rng: np.random.Generator) -> None:
    async with ag.open_runtime():
        x = ag.ones(200, 300, dtype=np.float64, requires_grad=True)
        y1 = ag.dropout(x, 0.3, generator=np.random.default_rng(5))
        y2 = ag.dropout(x, 0.3, generator=np.random.default_rng(5))
        y3 = ag.dropout(x, 0.3, generator=np.random.default_rng(6))
        np.testing.assert_array_equal(y1.numpy(), y2.numpy())  # deterministic for a given generator
        assert not np.array_equal(y1.numpy(), y3.numpy())
        kept = y1.numpy() != 0
        assert abs(kept.mean() - 0.7) < 0.01
        np.testing.assert_allclose(y1.numpy()[kept], 1 / 0.7)
        await y1.sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), y1.numpy())  # gradient = the same mask, scaled
        assert ag.dropout(x, 0.3, training=False) is x
        assert not ag.dropout(x, 1.0).numpy().any()
        with pytest.raises(ValueError, match="between 0 and 1"):
            ag.dropout(x, 1.5)
        # a fixed seed makes it a deterministic function: FD applies
        xs = rng.standard_normal((4, 5))
        await ag.autograd.gradcheck(
            lambda x: ag.dropout(x, 0.4, generator=np.random.default_rng(3)),
            [xs],
            eps=1e-6,
            atol=1e-7,
            rtol=1e-5,
            seed=7,
        )
        ag.manual_seed(9)
        d1 = ag.dropout(x, 0.5).numpy()
        ag.manual_seed(9)
        np.testing.assert_array_equal(d1, ag.dropout(x, 0.5).numpy())


# ---- logsumexp, clamp, gather, index_select, cumsum, einsum, var/std ---------------------------------------


async def test_logsumexp(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.standard_normal((3, 4, 5))
        for dim, keep in [(1, False), ((0, 2), True), (-1, True)]:
            await ag.autograd.gradcheck(
                lambda x, d=dim, k=keep: ag.logsumexp(x, d, k), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
            )
            await _vs_torch(
                lambda x, d=dim, k=keep: ag.logsumexp(x, d, k),
                lambda x, d=dim, k=keep: torch.logsumexp(x, d, k),
                x,
            )
        big = ag.tensor(np.array([[1000.0, 1000.0], [-1000.0, -np.inf]]))
        np.testing.assert_allclose(ag.logsumexp(big, 1).numpy(), [1000 + np.log(2), -1000])


async def test_clamp(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.uniform(-2, 2, (4, 5))
        x[np.abs(np.abs(x) - 0.5) < 0.01] = 1.0  # keep FD away from the kinks
        await ag.autograd.gradcheck(lambda x: ag.clamp(x, -0.5, 0.5), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await ag.autograd.gradcheck(lambda x: x.clamp(min=-0.5), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await ag.autograd.gradcheck(lambda x: ag.clip(x, max=0.5), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        lo = rng.uniform(-1.5, 0, (1, 5))
        hi = rng.uniform(0, 1.5, (4, 1))
        hi[0, 0] = -1.7  # a row where max < min: the result is max everywhere
        for a, b in [(lo, hi), (lo, None), (None, hi)]:
            ins = [x] + [v for v in (a, b) if v is not None]

            def f(x: Any, *bounds: Any, a: Any = a, b: Any = b, mod: Any = ag) -> Any:
                it = iter(bounds)
                return mod.clamp(x, None if a is None else next(it), None if b is None else next(it))

            await ag.autograd.gradcheck(f, ins, eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
            await _vs_torch(f, lambda *t, f=f: f(*t, mod=torch), *ins)


async def test_gather_and_index_select(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.standard_normal((4, 5, 3))
        idx = rng.integers(0, 5, (3, 6, 2))  # smaller than x in the other dims; repeats
        await ag.autograd.gradcheck(lambda x: ag.gather(x, 1, idx), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await _vs_torch(lambda x: x.gather(1, ag.tensor(idx)), lambda x: x.gather(1, torch.tensor(idx)), x)
        sel = np.array([2, 0, 2, 1])
        for dim in (0, 1, -1):
            await ag.autograd.gradcheck(
                lambda x, d=dim: ag.index_select(x, d, sel % x.shape[d]), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
            )
            await _vs_torch(
                lambda x, d=dim: x.index_select(d, ag.tensor(sel % x.shape[d])),
                lambda x, d=dim: x.index_select(d, torch.tensor(sel % x.shape[d])),
                x,
            )
        with pytest.raises(_INDEX_ERRORS, match="out of bounds"):
            ag.gather(ag.tensor(x), 0, np.full((1, 1, 1), 9)).numpy()


async def test_cumsum(rng: np.random.Generator) -> None:
    pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.standard_normal((3, 4, 2))
        for dim in (0, 1, -1):
            await ag.autograd.gradcheck(lambda x, d=dim: ag.cumsum(x, d), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
            await _vs_torch(lambda x, d=dim: x.cumsum(d), lambda x, d=dim: x.cumsum(d), x)
        i = ag.tensor(np.array([1, 2, 3], dtype=np.int32)).cumsum(0)
        assert i.dtype == np.int64 and i.numpy().tolist() == [1, 3, 6]


EINSUM_CASES = [
    ("ij,jk->ik", [(3, 4), (4, 2)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk", [(2, 3, 4), (4, 2)]),
    ("ii->i", [(4, 4)]),
    ("ij->", [(3, 4)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij,ij,ij->i", [(3, 4), (3, 4), (3, 4)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("iij,k->jk", [(3, 3, 2), (2,)]),
    ("ij,jk", [(2, 3), (3, 4)]),
    ("ji", [(2, 3)]),
]


@pytest.mark.parametrize("eq,shapes", EINSUM_CASES)
async def test_einsum(eq: str, shapes: Any, rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        ins = [rng.standard_normal(s) for s in shapes]
        await ag.autograd.gradcheck(lambda *t: ag.einsum(eq, *t), ins, eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await _vs_torch(lambda *t: ag.einsum(eq, *t), lambda *t: torch.einsum(eq, *t), *ins)


async def test_var_std(rng: np.random.Generator) -> None:
    pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.standard_normal((3, 4, 5))
        for args, kw in [
            ((), {}),
            ((1,), {}),
            (((0, 2),), {"keepdim": True}),
            ((1,), {"correction": 0}),
            ((2,), {"unbiased": False}),
            ((), {"correction": 2}),
        ]:
            var = functools.partial(_call_method, "var", args, kw)
            std = functools.partial(_call_method, "std", args, kw)
            await ag.autograd.gradcheck(var, [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
            await ag.autograd.gradcheck(std, [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
            await _vs_torch(var, var, x)
            await _vs_torch(std, std, x)
        np.testing.assert_allclose(ag.var(ag.tensor(x), False).item(), x.var())


# ---- losses -------------------------------------------------------------------------------------------

CE_CASES = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.2},
    {"ignore_index": 1},
    {"weight": True},
    {"weight": True, "ignore_index": 2, "label_smoothing": 0.15},
    {"weight": True, "ignore_index": 2, "label_smoothing": 0.1, "reduction": "none"},
    {"weight": True, "label_smoothing": 0.3, "reduction": "sum"},
]


@pytest.mark.parametrize("kw", CE_CASES)
@pytest.mark.parametrize("shape", [(5, 4), (3, 4, 2, 3), (4,)])
async def test_cross_entropy(kw: Any, shape: Any, rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.standard_normal(shape)
        c = shape[1] if len(shape) > 1 else shape[0]
        t = rng.integers(0, c, (shape[0], *shape[2:]) if len(shape) > 1 else ())
        if t.ndim:
            t.flat[0] = 2  # make ignore_index=2 hit
        kw = dict(kw)
        wv = rng.uniform(0.5, 2.0, c) if kw.pop("weight", False) else None
        aw = None if wv is None else ag.tensor(wv)
        await ag.autograd.gradcheck(
            lambda x: ag.cross_entropy(x, t, aw, **kw), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
        )
        tw = None if wv is None else torch.tensor(wv)
        await _vs_torch(
            lambda x: ag.cross_entropy(x, ag.tensor(t), aw, **kw),
            lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(t), tw, **kw),
            x,
        )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
async def test_cross_entropy_fast_path_matches_the_general_one(dtype: str, rng: np.random.Generator) -> None:
    """Plain (N, C) class-index CE keeps the forward's softmax for the backward; class weights of one take
    the general path: both give the same loss and gradients, also for a second backward of one graph."""
    from asyncgrad.ops._loss import _ce_softmax

    async with ag.open_runtime():
        x = rng.standard_normal((64, 10)).astype(dtype)
        t = ag.tensor(rng.integers(0, 10, 64))
        res = []
        for w in (None, ag.ones(10, dtype=dtype)):
            xt = ag.tensor(x, requires_grad=True)
            loss = ag.cross_entropy(xt, t, w)
            assert (_ce_softmax(loss.numpy(), x) is not None) == (w is None)
            await loss.backward(retain_graph=True)
            g1 = xt.grad.numpy().copy()
            await loss.backward()
            np.testing.assert_allclose(xt.grad.numpy(), 2 * g1, rtol=1e-6)
            res.append((loss.item(), g1))
        tol = 1e-6 if dtype == "float32" else 1e-12
        np.testing.assert_allclose(res[0][0], res[1][0], rtol=tol)
        np.testing.assert_allclose(res[0][1], res[1][1], rtol=tol, atol=tol)


async def test_cross_entropy_probabilities_and_errors(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.standard_normal((4, 3, 2))
        p = rng.dirichlet(np.ones(3), (4, 2)).transpose(0, 2, 1)
        wv = rng.uniform(0.5, 2, 3)
        for kw in [{}, {"label_smoothing": 0.2, "reduction": "sum"}, {"reduction": "none"}]:
            await ag.autograd.gradcheck(
                lambda x, p, kw=kw: ag.cross_entropy(x, p, ag.tensor(wv), **kw),
                [x, p],
                eps=1e-6,
                atol=1e-7,
                rtol=1e-5,
                seed=7,
            )
            await _vs_torch(
                lambda x, p, kw=kw: ag.cross_entropy(x, p, ag.tensor(wv), **kw),
                lambda x, p, kw=kw: torch.nn.functional.cross_entropy(x, p, torch.tensor(wv), **kw),
                x,
                p,
            )
        with pytest.raises(_INDEX_ERRORS, match="Target 3 is out of bounds"):
            ag.cross_entropy(ag.tensor(x[:, :, 0]), np.array([0, 1, 3, 0])).item()
        with pytest.raises(ag.OpError, match="target of shape"):
            ag.cross_entropy(ag.tensor(x[:, :, 0]), np.array([0, 1]))
        # every target ignored: the mean is 0/0, as in PyTorch
        assert np.isnan(ag.cross_entropy(ag.tensor(x[:, :, 0]), np.full(4, -100)).item())
        # float32 logits on a lane (W1's case: 128 x 10, mean)
        z = rng.standard_normal((512, 10)).astype(np.float32)
        y = rng.integers(0, 10, 512)
        zt = ag.tensor(z, requires_grad=True)
        loss = ag.cross_entropy(zt, y)
        await loss.backward()
        tz = torch.tensor(z, requires_grad=True)
        tl = torch.nn.functional.cross_entropy(tz, torch.tensor(y))
        tl.backward()
        assert loss.dtype == np.float32 and zt.grad.dtype == np.float32
        np.testing.assert_allclose(loss.item(), tl.item(), rtol=1e-5)
        np.testing.assert_allclose(zt.grad.numpy(), tz.grad.numpy(), atol=1e-7)


@pytest.mark.parametrize(
    "kw", [{}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 0, "weight": True}]
)
async def test_nll_loss(kw: Any, rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.standard_normal((5, 4, 2))
        t = rng.integers(0, 4, (5, 2))
        kw = dict(kw)
        wv = rng.uniform(0.5, 2, 4) if kw.pop("weight", False) else None
        aw, tw = (None, None) if wv is None else (ag.tensor(wv), torch.tensor(wv))
        await ag.autograd.gradcheck(lambda x: ag.nll_loss(x, t, aw, **kw), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await _vs_torch(
            lambda x: ag.nll_loss(x, ag.tensor(t), aw, **kw),
            lambda x: torch.nn.functional.nll_loss(x, torch.tensor(t), tw, **kw),
            x,
        )


@pytest.mark.filterwarnings("ignore:size_average and reduce args")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_mse_loss(reduction: str, rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x, y, w = rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.uniform(0.1, 1, (3, 4))
        await ag.autograd.gradcheck(
            lambda x, y: ag.mse_loss(x, y, reduction=reduction), [x, y], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7
        )
        await ag.autograd.gradcheck(
            lambda x, y, w: ag.mse_loss(x, y, reduction=reduction, weight=w),
            [x, y, w],
            eps=1e-6,
            atol=1e-7,
            rtol=1e-5,
            seed=7,
        )
        await _vs_torch(
            lambda x, y, w: ag.mse_loss(x, y, reduction=reduction, weight=w),
            lambda x, y, w: torch.nn.functional.mse_loss(x, y, reduction=reduction, weight=w),
            x,
            y,
            w,
        )
        await _vs_torch(
            lambda x, y: ag.mse_loss(x, y, size_average=False),
            lambda x, y: torch.nn.functional.mse_loss(x, y, size_average=False),
            x,
            y,
        )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_bce_with_logits(reduction: str, rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    async with ag.open_runtime():
        x = rng.standard_normal((4, 3)) * 3
        x[0, 0] = 40.0  # large logits stay finite
        x[0, 1] = -40.0
        t = rng.uniform(0, 1, (4, 3))
        w, pw = rng.uniform(0.5, 2, (4, 1)), rng.uniform(0.5, 3, 3)

        def f(x: Any, t: Any, w: Any, pw: Any) -> Any:
            return ag.binary_cross_entropy_with_logits(x, t, w, reduction=reduction, pos_weight=pw)

        await ag.autograd.gradcheck(f, [x, t, w, pw], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await ag.autograd.gradcheck(
            lambda x: ag.binary_cross_entropy_with_logits(x, t, reduction=reduction),
            [x],
            eps=1e-6,
            atol=1e-7,
            rtol=1e-5,
            seed=7,
        )
        # PyTorch gives no gradients for weight and pos_weight: compare with them as constants
        await _vs_torch(
            lambda x, t: f(x, t, ag.tensor(w), ag.tensor(pw)),
            lambda x, t: torch.nn.functional.binary_cross_entropy_with_logits(
                x, t, torch.tensor(w), reduction=reduction, pos_weight=torch.tensor(pw)
            ),
            x,
            t,
        )


# ---- second derivatives (create_graph=True) ------------------------------------------------------------


def _second_cases(rng: np.random.Generator) -> dict[str, tuple[Fn, list[np.ndarray]]]:
    x4 = rng.standard_normal((2, 4, 5, 5))
    w4 = rng.standard_normal((4, 2, 3, 3))
    pool_x = rng.permutation(2 * 3 * 7 * 8).reshape(2, 3, 7, 8) / 10.0
    x3 = rng.standard_normal((3, 4, 5))
    t = rng.integers(0, 4, (3, 5))
    t[0, 0] = 2
    cw = rng.uniform(0.5, 2, 4)
    gidx = rng.integers(0, 4, (3, 6, 2))
    return {
        # the tanh makes the loss non-quadratic, so every adjoint op of conv2d is exercised
        "conv2d": (
            lambda x, w, b: ag.tanh(ag.conv2d(x, w, b, stride=2, padding=1, groups=2)),
            [x4, w4, rng.standard_normal(4)],
        ),
        "conv2d_channels_last": (
            lambda x, w: ag.tanh(ag.conv2d(x, w, None, dilation=2, padding=2, groups=2)),
            [_channels_last(x4), w4],
        ),
        "max_pool2d": (lambda x: ag.max_pool2d(x, 3, 2, 1, 1, True) ** 2, [pool_x]),
        "avg_pool2d": (lambda x: ag.tanh(ag.avg_pool2d(x, 3, 2, 1, True, False)), [pool_x]),
        "embedding": (
            lambda w: ag.embedding(np.array([[0, 2, 2], [5, 1, 2]]), w) ** 3,
            [rng.standard_normal((6, 3))],
        ),
        "layer_norm": (
            lambda x, w, b: ag.layer_norm(x, (5,), w, b),
            [x3, rng.standard_normal(5), rng.standard_normal(5)],
        ),
        "dropout": (lambda x: ag.dropout(x, 0.4, generator=np.random.default_rng(3)) ** 2, [x3]),
        "logsumexp": (lambda x: x.logsumexp(1), [x3]),
        "clamp": (lambda x: ag.clamp(x, -0.5, 0.5) ** 2, [x3]),
        "gather": (lambda x: ag.gather(x, 1, ag.tensor(gidx)) ** 2, [x3]),
        "index_select": (lambda x: ag.index_select(x, 1, np.array([2, 0, 2])) ** 2, [x3]),
        "cumsum": (lambda x: ag.cumsum(x, 1) ** 2, [x3]),
        "einsum": (lambda a, b: ag.einsum("bij,bjk->bik", a, b) ** 2, [x3, rng.standard_normal((3, 5, 2))]),
        "einsum_diag": (lambda a: ag.einsum("iij->j", a) ** 2, [rng.standard_normal((3, 3, 2))]),
        "var": (lambda x: ag.var(x, 1), [x3]),
        "std": (lambda x: ag.std(x, (0, 2), correction=0), [x3]),
        "cross_entropy": (
            lambda x: ag.cross_entropy(x, t, ag.tensor(cw), ignore_index=2, label_smoothing=0.1),
            [x3[:, :4]],
        ),
        "cross_entropy_none": (lambda x: ag.cross_entropy(x, t, reduction="none"), [x3[:, :4]]),
        "nll_loss": (lambda x: ag.nll_loss(ag.log_softmax(x, 1), t, ag.tensor(cw)), [x3[:, :4]]),
        "mse_loss": (lambda x, y: ag.tanh(ag.mse_loss(x, y)), [x3, rng.standard_normal((3, 4, 5))]),
        "bce_with_logits": (
            lambda x, t, w, pw: ag.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw),
            [x3, rng.uniform(0, 1, (3, 4, 5)), rng.uniform(0.5, 2, (4, 1)), rng.uniform(0.5, 3, 5)],
        ),
    }


@pytest.mark.parametrize("name", sorted(_second_cases(np.random.default_rng(0))))
async def test_second_derivatives(name: str) -> None:
    async with ag.open_runtime():
        fn, ins = _second_cases(np.random.default_rng(42))[name]
        await ag.autograd.gradgradcheck(fn, ins, directions=2, eps=1e-5, atol=1e-6, rtol=1e-4, seed=7)


@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
async def test_all_targets_ignored_gives_nan_loss_and_zero_gradient(rt: Any, loss: str) -> None:
    """A fully padded batch: the mean over no targets is NaN (0/0), but the gradient is 0, as in PyTorch,
    so one such batch cannot put NaN into the parameters."""
    x = ag.tensor(np.random.default_rng(0).standard_normal((2, 3)), requires_grad=True)
    t = ag.tensor([-100, -100])
    out = getattr(ag, loss)(x, t)
    assert np.isnan(out.item())
    await out.backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros((2, 3)))


async def test_embedding_rejects_negative_indices(rt: Any) -> None:
    w = ag.tensor(np.ones((4, 2)))
    with pytest.raises(IndexError, match=r"embedding: index out of range in self: indices must be in \[0, 4\)"):
        ag.embedding(ag.tensor([0, -1]), w).numpy()


async def test_matmul_of_mixed_dtypes_is_an_error(rt: Any) -> None:
    a, b = ag.ones(2, 3, dtype="float32"), ag.ones(3, 2, dtype="float64")
    with pytest.raises(ValueError, match=r"matmul: expected both operands to have the same dtype, got float32"):
        a @ b
