"""Tensor API details users bring from PyTorch: item assignment, PyTorch's index order, dtype and
``new_*`` helpers, in-place forms of unary ops, ``.data``, and ``numpy()`` as a safe point to write."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from tests._util import set_inline_limit

TIMEOUT = 30


# ---- t[idx] = value -------------------------------------------------------------------------------


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "lanes"])
async def test_setitem_basic_and_advanced(rt: Any, monkeypatch: pytest.MonkeyPatch, inline: bool) -> None:
    set_inline_limit(monkeypatch, 10**9 if inline else -1)
    ref = np.arange(24.0).reshape(2, 3, 4)
    t = ag.tensor(ref)
    t[0] = -1.0
    ref[0] = -1.0
    t[1, :, 2] = ag.tensor([7.0, 8.0, 9.0])
    ref[1, :, 2] = [7.0, 8.0, 9.0]
    t[ag.tensor([1]), 0] = 5.0  # an index tensor
    ref[[1], 0] = 5.0
    t[t > 20] = 0.0  # a bool mask tensor, computed from the tensor itself before the write
    ref[ref > 20] = 0.0
    t[..., 1::2] *= 2.0  # read-modify-write through __getitem__ / __setitem__
    ref[..., 1::2] *= 2.0
    np.testing.assert_array_equal(t.numpy(), ref)


async def test_setitem_uses_pytorchs_index_order(rt: Any) -> None:
    ref = np.zeros((2, 3, 4))
    t = ag.tensor(ref)
    t[1, :, [3, 0]] = ag.tensor(np.arange(6.0).reshape(3, 2))  # PyTorch: the target is (3, 2)
    ref[1][:, [3, 0]] = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(t.numpy(), ref)


async def test_setitem_is_ordered_after_queued_readers(rt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    set_inline_limit(monkeypatch, -1)  # everything queued on the lanes
    t = ag.tensor(np.ones(50_000))
    y = ag.exp(t * 2.0)  # queued, reads t
    t[:] = 0.0  # queued after it on the same stream
    z = t + 1.0
    np.testing.assert_allclose(y.numpy(), np.exp(2.0))
    np.testing.assert_array_equal(z.numpy(), 1.0)


async def test_setitem_on_a_tensor_in_the_graph_is_refused(rt: Any) -> None:
    w = ag.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(RuntimeError, match=r"in-place assignment \(t\[idx\] = value\).*no_grad"):
        w[0] = 3.0
    h = w * 2.0
    with pytest.raises(RuntimeError, match="requires grad"):
        h[0] = 3.0
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])
    with ag.no_grad():
        w[0] = 3.0  # what initialisation code does
    np.testing.assert_array_equal(w.numpy(), [3.0, 2.0])
    assert w.requires_grad and w.is_leaf


async def test_setitem_rejects_float_index_tensors(rt: Any) -> None:
    t = ag.zeros(3)
    with pytest.raises(ValueError, match="setitem: index tensors must be integer or bool, got dtype float32"):
        t[ag.tensor([0.0])] = 1.0


# ---- indexing in PyTorch's order ------------------------------------------------------------------

def _pytorch_index(x: np.ndarray, idx: tuple[Any, ...]) -> np.ndarray:
    """PyTorch's definition, spelled out on numpy: select with the integers, then index the rest."""
    first: list[Any] = []
    rest: list[Any] = []
    for i in idx:
        if isinstance(i, int):
            first.append(i)
        elif i is None:
            rest.append(i)
        elif i is Ellipsis:
            first.append(i)
            rest.append(i)
        else:
            if isinstance(i, list):
                i = np.asarray(i)
            first.extend([slice(None)] * (i.ndim if isinstance(i, np.ndarray) and i.dtype == bool else 1))
            rest.append(i)
    return x[tuple(first)][tuple(rest)]


INDEX_CASES = [
    ((1, slice(None), [3, 0]), (3, 2, 5)),
    ((slice(None), 1, slice(None), [0, 1]), (2, 4, 2)),
    (([0, 1], slice(None), 2), (2, 3, 5)),
    ((1, [0, 2]), (2, 4, 5)),
    ((Ellipsis, 1, [0, 1]), (2, 3, 2)),
    ((None, 0, slice(None), [1]), (1, 3, 1, 5)),
    ((0, slice(None), slice(None), np.array([True, False, True, False, True])), (3, 4, 3)),
    ((1, np.ones((3, 4), bool), 2), (12,)),
]


@pytest.mark.parametrize(("idx", "shape"), INDEX_CASES, ids=[str(i) for i in range(len(INDEX_CASES))])
async def test_getitem_mixing_ints_and_arrays_follows_pytorch(rt: Any, idx: Any, shape: Any) -> None:
    x = np.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    got = ag.tensor(x)[idx]
    want = _pytorch_index(x, idx)
    assert got.shape == want.shape == shape
    np.testing.assert_array_equal(got.numpy(), want)


async def test_getitem_index_order_matches_torch(rt: Any, torch_ref) -> None:
    x = np.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    idxs = [(1, slice(None), [3, 0]), (slice(None), 1, slice(None), [0, 1]), (0, [1, 2], slice(None), 4),
            ([0, 1], 2, slice(None), [1, 3]), (Ellipsis, 2, [0])]

    def reference(torch: Any) -> list[Any]:
        out = []
        for idx in idxs:
            want = torch.from_numpy(x)[tuple(torch.tensor(i) if isinstance(i, list) else i for i in idx)]
            out.append((want.shape, want))
        return out

    wants = torch_ref("getitem", reference, x=x, idxs=[repr(idx) for idx in idxs])
    assert len(wants) == len(idxs)
    for idx, (want_shape, want) in zip(idxs, wants):
        got = ag.tensor(x)[idx].numpy()
        assert got.shape == want_shape == want.shape, idx
        np.testing.assert_array_equal(got, want)


async def test_gradient_through_mixed_index(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(TIMEOUT):
        await ag.autograd.gradcheck(lambda a: a[1, :, [3, 0, 3]] * 2.0, [rng.standard_normal((2, 3, 4))], rtol=1e-4)


# ---- reductions, item, names --------------------------------------------------------------------


async def test_empty_dim_list_reduces_every_dim(rt: Any) -> None:
    x = ag.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    s = x.sum(dim=())
    assert s.shape == () and s.item() == 15.0
    assert x.mean(dim=[]).item() == 2.5
    await s.backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.ones((2, 3)))


async def test_item_of_many_elements_is_a_runtime_error(rt: Any) -> None:
    with pytest.raises(RuntimeError, match=r"a Tensor with 2 elements cannot be converted to a Python scalar"):
        ag.ones(2).item()


async def test_builtin_node_names_follow_pytorch(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    y = (ag.exp(x) * 2.0).sum()
    assert y.grad_fn.name() == "SumBackward0"
    assert y.grad_fn.next_functions[0][0].name() == "MulBackward0"
    assert "grad_fn=<SumBackward0>" in repr(y)


# ---- conversions and new_* -----------------------------------------------------------------------


async def test_dtype_conversions_and_type_as(rt: Any) -> None:
    x = ag.tensor([1.7, -2.2, 0.0])
    assert x.long().dtype == np.int64 and x.long().tolist() == [1, -2, 0]
    assert x.int().dtype == np.int32
    assert x.bool().tolist() == [True, True, False]
    assert x.half().dtype == np.float16
    assert x.type_as(ag.zeros(1, dtype="float64")).dtype == np.float64
    assert x.cpu() is x


async def test_is_contiguous(rt: Any) -> None:
    x = ag.tensor(np.zeros((3, 4)))
    assert x.is_contiguous()
    assert not x.T.is_contiguous()
    assert x.T.contiguous().is_contiguous()


async def test_new_factories_take_dtype_and_device_from_the_tensor(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64")
    z = x.new_zeros(2, 3)
    assert z.shape == (2, 3) and z.dtype == np.float64 and z.device == x.device and z.numpy().sum() == 0
    assert x.new_ones((4,)).tolist() == [1.0] * 4
    f = x.new_full((2,), 7, dtype="int32")
    assert f.dtype == np.int32 and f.tolist() == [7, 7]
    assert x.new_empty(5).shape == (5,)
    n = x.new_tensor([[1, 2]])
    assert n.dtype == np.float64 and n.tolist() == [[1.0, 2.0]]
    r = x.new_zeros(3, requires_grad=True)
    assert r.requires_grad and r.is_leaf


async def test_data_reads_and_swaps_the_value(rt: Any) -> None:
    w = ag.tensor([1.0, 2.0], requires_grad=True)
    d = w.data
    assert not d.requires_grad and d.is_leaf
    d[0] = 9.0  # shares memory, like PyTorch's .data
    np.testing.assert_array_equal(w.numpy(), [9.0, 2.0])
    w.data = ag.tensor([5.0, 6.0, 7.0])
    assert w.shape == (3,) and w.requires_grad and w.is_leaf
    await (w * w).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), [10.0, 12.0, 14.0])


# ---- in-place forms of unary ops -----------------------------------------------------------------


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "lanes"])
async def test_inplace_unary_ops(rt: Any, monkeypatch: pytest.MonkeyPatch, inline: bool) -> None:
    set_inline_limit(monkeypatch, 10**9 if inline else -1)
    base = np.array([-1.5, 0.25, 2.0])
    cases: list[tuple[str, Any, Any]] = [
        ("exp_", (), np.exp(base)),
        ("log_", (), None),
        ("sqrt_", (), None),
        ("tanh_", (), np.tanh(base)),
        ("abs_", (), np.abs(base)),
        ("neg_", (), -base),
        ("sigmoid_", (), 1 / (1 + np.exp(-base))),
        ("relu_", (), np.maximum(base, 0)),
        ("clamp_", (-1.0, 1.0), np.clip(base, -1.0, 1.0)),
        ("div_", (2.0,), base / 2.0),
        ("pow_", (2.0,), base**2.0),
    ]
    for name, args, want in cases:
        src = np.abs(base) if want is None else base
        want = getattr(np, name[:-1])(src) if want is None else want
        t = ag.tensor(src)
        assert getattr(t, name)(*args) is t
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-12, err_msg=name)


async def test_masked_fill(rt: Any) -> None:
    x = ag.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = x.masked_fill(x < 0, 0.5)
    np.testing.assert_array_equal(y.numpy(), [1.0, 0.5, 3.0])
    await y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [1.0, 0.0, 1.0])
    t = ag.tensor([1.0, -2.0, 3.0])
    t.masked_fill_(t > 2, -1.0)
    np.testing.assert_array_equal(t.numpy(), [1.0, -2.0, -1.0])


async def test_inplace_ops_refuse_a_tensor_in_the_graph(rt: Any) -> None:
    w = ag.tensor([1.0, 2.0], requires_grad=True)
    for call in (lambda: w.exp_(), lambda: w.add_(1.0), lambda: w.mul_(2.0), lambda: w.zero_(),
                 lambda: w.fill_(1.0), lambda: w.copy_(ag.zeros(2)), lambda: w.clamp_(0.0)):
        with pytest.raises(RuntimeError, match=r"in-place .* requires grad while grad mode is on"):
            call()
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])
    with ag.no_grad():
        w.add_(1.0).mul_(2.0)
    np.testing.assert_array_equal(w.numpy(), [4.0, 6.0])


# ---- numpy() is a safe point to write through ------------------------------------------------------


async def test_writes_through_numpy_do_not_race_with_queued_kernels(rt: Any) -> None:
    # big enough to run on the lanes: the kernels reading t are still queued when numpy() returns
    t = ag.tensor(np.ones(2_000_000))
    y = ag.exp(ag.tanh(t * 2.0)) * 3.0
    t.numpy()[:] = 0.0
    np.testing.assert_allclose(y.numpy()[:3], 3.0 * np.exp(np.tanh(2.0)))
    z = t + 1.0  # queued after the write: sees it, as in eager code
    np.testing.assert_array_equal(z.numpy()[:3], 1.0)


# ---- norm ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", ["fro", 2, 1, 3, float("inf"), float("-inf")])
async def test_norm_values_and_gradients(rt: Any, rng: np.random.Generator, p: Any) -> None:
    x = rng.standard_normal((3, 4))
    order = 2 if p == "fro" else p
    got = ag.tensor(x).norm(p)
    np.testing.assert_allclose(got.item(), np.linalg.norm(x.ravel(), order), rtol=1e-12)
    np.testing.assert_allclose(ag.norm(ag.tensor(x), p, dim=1, keepdim=True).numpy(),
                               np.linalg.norm(x, order, axis=1, keepdims=True), rtol=1e-12)
    with trio.fail_after(TIMEOUT):
        await ag.autograd.gradcheck(lambda a: a.norm(p, dim=0), [x], rtol=1e-4)


async def test_norm_gradient_at_zero_is_zero(rt: Any) -> None:
    z = ag.zeros(3, dtype="float64", requires_grad=True)
    await z.norm().backward()
    np.testing.assert_array_equal(z.grad.numpy(), [0.0, 0.0, 0.0])


# ---- // and %, and pow at 0 ------------------------------------------------------------------------


async def test_floor_divide_and_remainder_follow_python(rt: Any) -> None:
    a = ag.tensor([5.0, -5.0, 5.5, -5.5])
    np.testing.assert_array_equal((a // 3).numpy(), [1.0, -2.0, 1.0, -2.0])
    np.testing.assert_array_equal((a % 3).numpy(), [2.0, 1.0, 2.5, 0.5])
    np.testing.assert_array_equal((7 % ag.tensor([3.0, -3.0])).numpy(), [1.0, -2.0])
    np.testing.assert_array_equal((7 // ag.tensor([2, -2])).numpy(), [3, -4])
    i = ag.tensor([5, -5])
    assert (i // 2).dtype == np.int64 and (i // 2).tolist() == [2, -3] and (i % 3).tolist() == [2, 1]
    np.testing.assert_array_equal(ag.remainder(a, -2.0).numpy(), np.remainder([5.0, -5.0, 5.5, -5.5], -2.0))
    np.testing.assert_array_equal(a.floor_divide(2.0).numpy(), [2.0, -3.0, 2.0, -3.0])


async def test_floor_divide_passes_no_gradient(rt: Any) -> None:
    x = ag.tensor([1.5, 2.5], requires_grad=True)
    assert not (x // 2.0).requires_grad
    await ((x // 2.0) * x).sum().backward()  # only the product's own path
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 1.0])


async def test_pow_gradient_at_zero_base_and_zero_exponent(rt: Any) -> None:
    with np.errstate(all="raise"):  # no warnings either
        x = ag.tensor([0.0, 2.0], requires_grad=True)
        await (x**0).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), [0.0, 0.0])
        a = ag.tensor([0.0, 0.0, 3.0], dtype="float64", requires_grad=True)
        b = ag.tensor([0.0, 2.0, 0.0], dtype="float64", requires_grad=True)
        await (a**b).sum().backward()
        np.testing.assert_array_equal(a.grad.numpy(), [0.0, 0.0, 0.0])
        np.testing.assert_array_equal(b.grad.numpy(), [0.0, 0.0, np.log(3.0)])


# ---- factories, dtype names, small helpers ---------------------------------------------------------


async def test_more_factories(rt: Any) -> None:
    x = ag.tensor([[1.0, 2.0]], dtype=ag.float64)
    assert x.dtype == ag.float64 == np.float64
    for f in (ag.empty_like, ag.randn_like, ag.rand_like):
        y = f(x)
        assert y.shape == x.shape and y.dtype == np.float64 and y.device == x.device
    assert ag.full_like(x, 3).tolist() == [[3.0, 3.0]]
    assert 0 <= ag.rand_like(x).numpy().min() and ag.rand_like(x).numpy().max() < 1
    r = ag.randint(3, 7, (100,))
    assert r.dtype == np.int64 and r.shape == (100,) and 3 <= r.numpy().min() and r.numpy().max() < 7
    assert ag.randint(5, (2, 2)).shape == (2, 2)
    n = ag.normal(2.0, 0.5, (4000,), generator=np.random.default_rng(0))
    assert n.dtype == np.float32 and abs(n.numpy().mean() - 2.0) < 0.05 and abs(n.numpy().std() - 0.5) < 0.05
    np.testing.assert_allclose(ag.linspace(0, 1, 5).numpy(), [0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_array_equal(ag.eye(2, 3).numpy(), np.eye(2, 3))
    assert ag.eye(3, requires_grad=True).requires_grad
    assert ag.is_tensor(x) and not ag.is_tensor(np.zeros(1)) and ag.numel(x) == 2
    with ag.inference_mode():
        assert not ag.is_grad_enabled()


async def test_small_tensor_helpers(rt: Any) -> None:
    x = ag.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    assert x.ndimension() == 2 and x.nelement() == 6 and x.element_size() == 8 and x.is_floating_point()
    assert not ag.tensor([1, 2]).is_floating_point()
    assert x.type() == "float64" and x.type(ag.float32).dtype == np.float32
    assert x.t().shape == (3, 2) and ag.tensor([1.0]).t().shape == (1,)
    with pytest.raises(RuntimeError, match="t\\(\\) expects a tensor with <= 2 dims"):
        ag.zeros(1, 2, 3).t()
    assert ag.zeros(3).expand_as(ag.zeros(2, 3)).shape == (2, 3)
    assert x.view_as(ag.zeros(3, 2)).shape == (3, 2)
    y = x.where(x > 2, ag.zeros(2, 3, dtype="float64"))
    np.testing.assert_array_equal(y.numpy(), [[0, 0, 0], [3, 4, 5]])
    await y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [[0, 0, 0], [1, 1, 1]])
    w = ag.zeros(500)
    w.uniform_(-2.0, -1.0, generator=np.random.default_rng(1))
    assert -2.0 <= w.numpy().min() and w.numpy().max() < -1.0
    w.normal_(5.0, 0.1)
    assert abs(w.numpy().mean() - 5.0) < 0.05


async def test_writing_a_value_that_requires_grad_in_place_is_refused(rt: Any) -> None:
    """PyTorch records such a write in the graph; asyncgrad records no in-place op, so it refuses rather
    than drop the value's gradient silently."""
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    out = ag.zeros(2, dtype="float64")
    for call in (lambda: out.__setitem__(0, x[1] * 3.0), lambda: out.__iadd__(x), lambda: out.add_(x),
                 lambda: out.mul_(x), lambda: out.copy_(x)):
        with pytest.raises(RuntimeError, match=r"writes a value that requires grad \(shape .*\) into a tensor outside"):
            call()
    np.testing.assert_array_equal(out.numpy(), [0.0, 0.0])
    out[0] = x[1].detach() * 3.0  # what the message suggests when no gradient should flow
    with ag.no_grad():
        out += x  # and under no_grad nothing is recorded anyway
    np.testing.assert_array_equal(out.numpy(), [7.0, 2.0])


async def test_grad_mode_decorators_as_pytorch(rt: Any) -> None:
    @ag.no_grad
    def f() -> bool:
        return ag.is_grad_enabled()

    @ag.set_grad_enabled(False)
    def g() -> bool:
        return ag.is_grad_enabled()

    assert ag.is_grad_enabled()  # decorating did not switch the mode
    assert not f() and not g() and ag.is_grad_enabled()
    with ag.inference_mode(False):
        assert ag.is_grad_enabled()
    with ag.inference_mode():
        assert not ag.is_grad_enabled()

    @ag.inference_mode
    async def h() -> bool:
        return ag.is_grad_enabled()

    assert not await h() and ag.is_grad_enabled()


# ---- autograd details from PyTorch --------------------------------------------------------------


async def test_grad_materialize_grads_gives_zeros_for_unused_inputs(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    u = ag.tensor([[3.0]], dtype="float64", requires_grad=True)
    gx, gu = await ag.grad((x * x).sum(), [x, u], materialize_grads=True)
    np.testing.assert_array_equal(gx.numpy(), [2.0, 4.0])
    assert gu.shape == (1, 1) and gu.dtype == np.float64 and gu.numpy().sum() == 0
    with pytest.raises(ValueError, match="materialize_grads=True needs allow_unused"):
        ag.grad((x * x).sum(), [x, u], allow_unused=False, materialize_grads=True)


async def test_function_gradient_for_a_non_tensor_input_is_an_error(rt: Any) -> None:
    class Scale(ag.Function):
        @staticmethod
        def forward(ctx: Any, a: Any, k: int) -> Any:
            ctx.k = k
            return a * k

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g * ctx.k, g  # a gradient for the int: PyTorch refuses it

    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    with pytest.raises(RuntimeError, match="ScaleBackward: backward returned a gradient for input 1, but that"):
        await Scale.apply(x, 3).sum().backward()
    assert x.grad is None


async def test_once_differentiable_runs_backward_without_a_graph(rt: Any) -> None:
    class Sq(ag.Function):
        @staticmethod
        def forward(ctx: Any, a: Any) -> Any:
            ctx.save_for_backward(a)
            return a * a

        @staticmethod
        @ag.once_differentiable
        def backward(ctx: Any, g: Any) -> Any:
            (a,) = ctx.saved_tensors
            assert not ag.is_grad_enabled()
            return 2.0 * a * g

    x = ag.tensor([1.0, 3.0], dtype="float64", requires_grad=True)
    (gx,) = await ag.grad(Sq.apply(x).sum(), x, create_graph=True)
    np.testing.assert_array_equal(gx.numpy(), [2.0, 6.0])
    assert not gx.requires_grad


async def test_retain_grad_and_non_leaf_grad_as_pytorch(rt: Any) -> None:
    with pytest.raises(RuntimeError, match="retain_grad\\(\\) on a tensor that does not require grad"):
        ag.ones(2).retain_grad()
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2.0
    await y.sum().backward()
    with pytest.warns(UserWarning, match="reading .grad of a tensor that is not a leaf"):
        assert y.grad is None


async def test_mark_non_differentiable_on_an_input_returned_as_is(rt: Any) -> None:
    class Pass(ag.Function):
        @staticmethod
        def forward(ctx: Any, a: Any) -> Any:
            ctx.mark_non_differentiable(a)
            return a

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g

    x = ag.tensor([1.0, 2.0], requires_grad=True)
    y = Pass.apply(x)
    assert not y.requires_grad and y.grad_fn is None and y is not x


async def test_retained_grad_is_filled_by_grad_too(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    y = x * 2.0
    y.retain_grad()
    (gx,) = await ag.grad((y * y).sum(), x)
    np.testing.assert_array_equal(gx.numpy(), [8.0, 16.0])
    np.testing.assert_array_equal(y.grad.numpy(), [4.0, 8.0])  # as torch.autograd.grad does
    assert x.grad is None


async def test_function_apply_takes_keyword_arguments(rt: Any) -> None:
    class Scale(ag.Function):
        @staticmethod
        def forward(ctx: Any, a: Any, k: float = 2.0) -> Any:
            ctx.k = k
            return a * k

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g * ctx.k, None

    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    await Scale.apply(x, k=3.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0])
    y = Scale.apply(a=x)
    assert y.requires_grad
    np.testing.assert_array_equal(y.numpy(), [2.0, 4.0])
    with pytest.raises(TypeError, match=r"Scale\.apply: the arguments do not fit Scale\.forward"):
        Scale.apply(x, q=1)


class _IncInPlace(ag.Function):
    """Adds 1 to its input in place and returns it (PyTorch's mark_dirty example)."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        x.add_(1)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return g * 3


@pytest.mark.parametrize("inline", [True, False])
async def test_mark_dirty_rebases_the_input_onto_the_function(rt: Any, inline: bool, monkeypatch: Any) -> None:
    if not inline:
        set_inline_limit(monkeypatch, -1)
    a = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    x = a * 2
    y = _IncInPlace.apply(x)
    assert y is x and y.grad_fn.name() == "_IncInPlaceBackward" and y.requires_grad
    np.testing.assert_array_equal(y.numpy(), [3.0, 5.0])
    await (y * y).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), [36.0, 60.0])  # 2y * 3 * 2, as PyTorch gives


async def test_mark_dirty_misuse_raises(rt: Any) -> None:
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        _IncInPlace.apply(ag.tensor([1.0], requires_grad=True))

    class NotReturned(ag.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            x.add_(1)
            ctx.mark_dirty(x)
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g

    with pytest.raises(RuntimeError, match="not returned as output"):
        NotReturned.apply(ag.tensor([1.0], requires_grad=True) * 1)
    b = ag.tensor([1.0, 2.0])
    assert _IncInPlace.apply(b) is b  # nothing requires grad: no node, the input changed in place
    np.testing.assert_array_equal(b.numpy(), [2.0, 3.0])


async def test_mark_dirty_invalidates_what_an_earlier_node_saved(rt: Any) -> None:
    a = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    x = a * 2
    z = (x * x).sum()  # saves x
    _IncInPlace.apply(x)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        await z.backward()
    assert a.grad is None


async def test_inplace_on_an_expanded_tensor_is_refused_as_pytorch_does(rt) -> None:
    e = ag.ones(3).expand(2, 3)
    await e.ready()
    for write in (lambda: e.add_(1), lambda: e.mul_(2), lambda: e.zero_()):
        with pytest.raises(RuntimeError, match="more than one element refers to a single memory location"):
            write()
    assert e.tolist() == [[1.0] * 3] * 2  # nothing was written
    c = e.clone()
    c.add_(1)  # the remedy the message names
    assert c.tolist() == [[2.0] * 3] * 2
