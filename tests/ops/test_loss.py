"""The loss ops (``ops/_loss.py``): cross_entropy, nll_loss, mse_loss, binary_cross_entropy_with_logits;
gradients against central finite differences in float64, values and gradients against PyTorch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import INDEX_ERRORS, vs_torch


def _with_inputs(torch_ref: Any, **consts: Any) -> Any:
    """``torch_ref`` that also records ``consts`` (targets, weights, options the torch side closes over) as
    the case's inputs: ``vs_torch`` records only the tensors it differentiates."""
    return lambda key, fn, **inputs: torch_ref(key, fn, **inputs, **consts)

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
async def test_cross_entropy(kw: Any, shape: Any, rng: np.random.Generator, torch_ref) -> None:
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
        await vs_torch(
            _with_inputs(torch_ref, t=t, w=wv, kw=kw),
            "cross_entropy",
            lambda x: ag.cross_entropy(x, ag.tensor(t), aw, **kw),
            lambda torch, x: torch.nn.functional.cross_entropy(
                x, torch.tensor(t), None if wv is None else torch.tensor(wv), **kw
            ),
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


async def test_a_loss_written_in_place_keeps_its_gradient_as_in_torch(rng: np.random.Generator, torch_ref) -> None:
    """The rule reads the softmax beside the loss, not the loss: scaling the loss in place (outside the graph)
    before its backward is allowed, as in PyTorch, and the gradient is the cross-entropy's own."""
    x0, t0 = rng.standard_normal((8, 5)), rng.integers(0, 5, 8)
    async with ag.open_runtime():
        x = ag.tensor(x0, requires_grad=True)
        loss = ag.cross_entropy(x, ag.tensor(t0))
        with ag.no_grad():
            loss.mul_(3.0)
        await loss.backward()

        def reference(torch: Any) -> Any:
            tx = torch.tensor(x0, requires_grad=True)
            tl = torch.nn.functional.cross_entropy(tx, torch.tensor(t0))
            with torch.no_grad():
                tl.mul_(3.0)
            tl.backward()
            return tl.item(), tx.grad

        tloss, tgrad = torch_ref("in_place_loss", reference, x=x0, t=t0)
        np.testing.assert_allclose(loss.item(), tloss, rtol=1e-12)
        np.testing.assert_allclose(x.grad.numpy(), tgrad, rtol=1e-10, atol=1e-12)


async def test_a_big_batch_cross_entropy_runs_in_row_slices_with_the_same_values_on_one_or_two_lanes(
    rng: np.random.Generator,
) -> None:
    """Over `SPLIT_MIN_ELEMENTS` logits the fast path runs its rows as slices (an idle lane helps): the
    loss and gradient are the same bits whoever ran them, and match float64 within float32 rounding."""
    from asyncgrad.ops._slices import SPLIT_MIN_ELEMENTS

    n, c = 260, 4100  # c > 4096: row sums take numpy's path; >= SPLIT_MIN_ELEMENTS logits in all
    assert n * c >= SPLIT_MIN_ELEMENTS
    x = (3 * rng.standard_normal((n, c))).astype(np.float32)
    t = rng.integers(0, c, n)
    got = []
    for lanes in (1, 2):
        async with ag.open_runtime(lanes=lanes, blas_threads=1):
            xt = ag.tensor(x, requires_grad=True)
            loss = ag.cross_entropy(xt, ag.tensor(t))
            await loss.backward()
            await ag.current_runtime().synchronize()
            got.append((loss.numpy().copy(), xt.grad.numpy().copy()))
    assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])
    x64 = x.astype(np.float64)
    z = x64 - x64.max(1, keepdims=True)
    lse = np.log(np.exp(z).sum(1))
    ref = (lse - z[np.arange(n), t]).mean()
    p = np.exp(z - lse[:, None])
    p[np.arange(n), t] -= 1
    np.testing.assert_allclose(got[0][0], ref, rtol=1e-5)
    np.testing.assert_allclose(got[0][1], p / n, rtol=1e-4, atol=1e-9)


async def test_cross_entropy_probabilities_and_errors(rng: np.random.Generator, torch_ref) -> None:
    async with ag.open_runtime():
        x = rng.standard_normal((4, 3, 2))
        p = rng.dirichlet(np.ones(3), (4, 2)).transpose(0, 2, 1)
        wv = rng.uniform(0.5, 2, 3)
        for i, kw in enumerate([{}, {"label_smoothing": 0.2, "reduction": "sum"}, {"reduction": "none"}]):
            await ag.autograd.gradcheck(
                lambda x, p, kw=kw: ag.cross_entropy(x, p, ag.tensor(wv), **kw),
                [x, p],
                eps=1e-6,
                atol=1e-7,
                rtol=1e-5,
                seed=7,
            )
            await vs_torch(
                _with_inputs(torch_ref, w=wv, kw=kw),
                f"probabilities{i}",
                lambda x, p, kw=kw: ag.cross_entropy(x, p, ag.tensor(wv), **kw),
                lambda torch, x, p, kw=kw: torch.nn.functional.cross_entropy(x, p, torch.tensor(wv), **kw),
                x,
                p,
            )
        with pytest.raises(INDEX_ERRORS, match="Target 3 is out of bounds"):
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

        def reference(torch: Any) -> Any:
            tz = torch.tensor(z, requires_grad=True)
            tl = torch.nn.functional.cross_entropy(tz, torch.tensor(y))
            tl.backward()
            return tl.item(), tz.grad

        tloss, tgrad = torch_ref("float32_lane", reference, z=z, y=y)
        assert loss.dtype == np.float32 and zt.grad.dtype == np.float32
        np.testing.assert_allclose(loss.item(), tloss, rtol=1e-5)
        np.testing.assert_allclose(zt.grad.numpy(), tgrad, atol=1e-7)


@pytest.mark.parametrize(
    "kw", [{}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 0, "weight": True}]
)
async def test_nll_loss(kw: Any, rng: np.random.Generator, torch_ref) -> None:
    async with ag.open_runtime():
        x = rng.standard_normal((5, 4, 2))
        t = rng.integers(0, 4, (5, 2))
        kw = dict(kw)
        wv = rng.uniform(0.5, 2, 4) if kw.pop("weight", False) else None
        aw = None if wv is None else ag.tensor(wv)
        await ag.autograd.gradcheck(lambda x: ag.nll_loss(x, t, aw, **kw), [x], eps=1e-6, atol=1e-7, rtol=1e-5, seed=7)
        await vs_torch(
            _with_inputs(torch_ref, t=t, w=wv, kw=kw),
            "nll_loss",
            lambda x: ag.nll_loss(x, ag.tensor(t), aw, **kw),
            lambda torch, x: torch.nn.functional.nll_loss(
                x, torch.tensor(t), None if wv is None else torch.tensor(wv), **kw
            ),
            x,
        )


@pytest.mark.filterwarnings("ignore:size_average and reduce args")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_mse_loss(reduction: str, rng: np.random.Generator, torch_ref) -> None:
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
        await vs_torch(
            torch_ref,
            "weighted",
            lambda x, y, w: ag.mse_loss(x, y, reduction=reduction, weight=w),
            lambda torch, x, y, w: torch.nn.functional.mse_loss(x, y, reduction=reduction, weight=w),
            x,
            y,
            w,
        )
        await vs_torch(
            torch_ref,
            "size_average",
            lambda x, y: ag.mse_loss(x, y, size_average=False),
            lambda torch, x, y: torch.nn.functional.mse_loss(x, y, size_average=False),
            x,
            y,
        )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
async def test_bce_with_logits(reduction: str, rng: np.random.Generator, torch_ref) -> None:
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
        await vs_torch(
            _with_inputs(torch_ref, w=w, pw=pw),
            "bce_with_logits",
            lambda x, t: f(x, t, ag.tensor(w), ag.tensor(pw)),
            lambda torch, x, t: torch.nn.functional.binary_cross_entropy_with_logits(
                x, t, torch.tensor(w), reduction=reduction, pos_weight=torch.tensor(pw)
            ),
            x,
            t,
        )


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


# ---- the pointwise losses' size and dtype checks, against PyTorch's ------------------------------------

POINTWISE = [
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "smooth_l1_loss_beta0",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
]
# (input dtype, target dtype, target shape) for a (3, 4) input
TARGETS = [
    ("float32", "float32", (3, 4)),
    ("float32", "float32", (4,)),  # broadcasts: PyTorch warns
    ("float32", "float32", (3, 1)),
    ("float32", "float32", (2, 3, 4)),  # broadcasts to a bigger shape
    ("float32", "float32", (5,)),  # doesn't broadcast: warns, then fails
    ("float32", "float64", (3, 4)),
    ("float64", "float32", (3, 4)),
    ("float32", "int64", (3, 4)),
    ("float32", "bool", (3, 4)),
    ("float16", "float32", (3, 4)),
    ("int64", "float32", (3, 4)),
    ("int64", "int64", (3, 4)),
]


def _torch_shapes(msg: str) -> str:
    """PyTorch's ``torch.Size([3, 4])`` in a message written as our shapes are, ``(3, 4)``."""
    import re

    return re.sub(
        r"torch\.Size\(\[([^\]]*)\]\)", lambda m: repr(tuple(int(v) for v in m.group(1).split(",") if v.strip())), msg
    )


def _pointwise(lib: Any, name: str) -> Any:
    if name == "smooth_l1_loss_beta0":
        return lambda x, t: lib.smooth_l1_loss(x, t, reduction="none", beta=0.0)
    return lambda x, t: getattr(lib, name)(x, t, reduction="none")


def _outcome(fn: Any, x: Any, t: Any) -> tuple[Any, ...]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn(x, t)
            res: tuple[Any, ...] = ("ok", str(out.dtype).removeprefix("torch."), out)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            res = (type(e).__name__, _torch_shapes(str(e)))
    return (*res, [_torch_shapes(str(w.message)) for w in caught])


@pytest.mark.parametrize("case", TARGETS, ids=lambda c: f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}")
@pytest.mark.parametrize("name", POINTWISE)
async def test_pointwise_loss_sizes_and_dtypes_as_torch(rt: Any, name: str, case: Any, torch_ref) -> None:
    """mse/l1/smooth_l1/huber warn as PyTorch does for a target of another size (and raise its error when
    the shapes don't broadcast), the binary cross-entropies raise its errors; each gives PyTorch's result
    dtype for mixed dtypes, or its error (type and message) where it refuses them; the values agree."""
    xdt, tdt, tshape = case
    r = np.random.default_rng(5)
    xv = r.uniform(0.05, 0.95, (3, 4)) if name == "binary_cross_entropy" else r.standard_normal((3, 4)) * 2
    tv = r.uniform(0, 1, tshape) if tdt.startswith("float") else r.integers(0, 2, tshape)
    xv, tv = xv.astype(xdt), tv.astype(tdt)

    def reference(torch: Any) -> Any:
        return _outcome(_pointwise(torch.nn.functional, name), torch.from_numpy(xv), torch.from_numpy(tv))

    want = torch_ref("outcome", reference, x=xv, t=tv)
    got = _outcome(_pointwise(ag.nn.functional, name), ag.tensor(xv), ag.tensor(tv))
    if want[0] == "ok":
        assert got[0] == "ok", got
        assert got[1] == want[1]  # the result dtype
        tol = 1e-3 if "float16" in (xdt, tdt) else 1e-5
        np.testing.assert_allclose(
            got[2].numpy().astype(np.float64), np.asarray(want[2]).astype(np.float64), rtol=tol, atol=tol
        )
        assert got[3] == want[3]  # the warnings
    else:
        assert got == want


async def test_mse_loss_target_forms(rt: Any) -> None:
    """A target that is not a tensor becomes one of the input's dtype (as l1_loss's); weights of another
    size than the input are refused in PyTorch's words; the size warning points at the caller."""
    import warnings

    x = ag.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    out = ag.nn.functional.mse_loss(x, np.ones((2, 3)), reduction="none")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.numpy(), (np.arange(6).reshape(2, 3) - 1.0) ** 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ag.nn.functional.mse_loss(x, 1.0).item() == pytest.approx(np.mean((np.arange(6) - 1.0) ** 2))
    assert [w.filename for w in caught] == [__file__]
    assert "Using a target size (()) that is different to the input size ((2, 3))" in str(caught[0].message)
    for fn in ("mse_loss", "l1_loss", "huber_loss"):
        with pytest.raises(ValueError, match=r"^Weights and input must have the same size\.$"):
            getattr(ag.nn.functional, fn)(x, x, weight=ag.ones(3))
