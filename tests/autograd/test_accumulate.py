"""The gradient layout contract (DESIGN.md): `.grad` has its parameter's strides when the parameter is dense
and non-overlapping, else it is C-contiguous; a contract-obeying incoming gradient that nobody else holds is
stolen, otherwise copied; accumulating onto an existing `.grad` is in place and keeps its layout and
identity; under create_graph it is out of place."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag

TIMEOUT = 20


def c_order(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((3, 4))


def fortran(rng: np.random.Generator) -> np.ndarray:
    return np.asfortranarray(rng.standard_normal((3, 4)))


def channels_last(rng: np.random.Generator) -> np.ndarray:
    a = np.empty((2, 5, 6, 3)).transpose(0, 3, 1, 2)  # logical NCHW, memory NHWC
    a[...] = rng.standard_normal(a.shape)
    return a


def permuted_3d(rng: np.random.Generator) -> np.ndarray:
    return np.ascontiguousarray(rng.standard_normal((4, 2, 3))).transpose(1, 2, 0)


def channels_last_n1(rng: np.random.Generator) -> np.ndarray:
    a = np.empty((1, 5, 6, 3)).transpose(0, 3, 1, 2)
    a[...] = rng.standard_normal(a.shape)
    return a


DENSE = [c_order, fortran, channels_last, permuted_3d, channels_last_n1]


def strides_that_matter(a: np.ndarray) -> tuple[int, ...]:
    """Strides of the dims with more than one element (a size-1 dim's stride is meaningless)."""
    return tuple(st for n, st in zip(a.shape, a.strides) if n > 1)


def stats(rt: Any) -> tuple[int, int, int]:
    s = rt.statistics()
    return s.grads_stolen, s.grads_copied, s.grads_accumulated


def param(arr: np.ndarray) -> ag.Tensor:
    return ag.from_numpy(arr).requires_grad_()


def test_the_layouts_are_what_they_claim(rng: np.random.Generator) -> None:
    assert c_order(rng).flags.c_contiguous
    f = fortran(rng)
    assert f.flags.f_contiguous and not f.flags.c_contiguous
    cl = channels_last(rng)
    assert not cl.flags.c_contiguous and not cl.flags.f_contiguous
    assert cl.strides == (720, 8, 144, 24)
    for make in DENSE:
        assert ag.is_dense_nonoverlapping(make(rng))


@pytest.mark.parametrize("make", DENSE, ids=lambda f: f.__name__)
async def test_grad_gets_the_param_strides_when_copied(rt: Any, rng: np.random.Generator, make: Any) -> None:
    """The incoming gradient (p * c with C-ordered c) is C-ordered; `.grad` still gets p's strides."""
    arr = make(rng)
    p = param(arr)
    c = rng.standard_normal(arr.shape)
    with trio.fail_after(TIMEOUT):
        await (p * ag.tensor(c)).sum().backward()
    g = p.grad.numpy()
    assert strides_that_matter(g) == strides_that_matter(arr)
    if make is not channels_last_n1:
        assert g.strides == arr.strides
    np.testing.assert_array_equal(g, c)
    assert p.grad.shape == p.shape and p.grad.dtype == p.dtype


@pytest.mark.parametrize("make", DENSE, ids=lambda f: f.__name__)
async def test_grad_gets_the_param_strides_when_stolen(rt: Any, rng: np.random.Generator, make: Any) -> None:
    """p * p: numpy gives the gradient p's own layout, so it obeys the contract and is stolen."""
    arr = make(rng)
    p = param(arr)
    before = stats(rt)
    with trio.fail_after(TIMEOUT):
        await (p * p).sum().backward()
    after = stats(rt)
    assert strides_that_matter(p.grad.numpy()) == strides_that_matter(arr)
    np.testing.assert_allclose(p.grad.numpy(), 2 * arr, rtol=1e-15)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[:, ::2],
        lambda a: a[::-1],
        lambda a: a[1:, 1:3],
        lambda a: a.T[::2],
        lambda a: np.broadcast_to(a[0], a.shape),
    ],
    ids=["step-2", "reversed", "window", "transposed-step", "broadcast-stride-0"],
)
async def test_non_dense_param_gets_c_contiguous_grad(rt: Any, rng: np.random.Generator, view: Any) -> None:
    arr = view(rng.standard_normal((4, 6)))
    assert not ag.is_dense_nonoverlapping(arr)
    for loss in (lambda p, c: (p * c).sum(), lambda p, c: (p * p * c).sum()):
        p = param(arr)
        c = ag.tensor(rng.standard_normal(arr.shape))
        with trio.fail_after(TIMEOUT):
            await loss(p, c).backward()
        g = p.grad.numpy()
        assert g.flags.c_contiguous
        assert g.shape == arr.shape


@pytest.mark.parametrize("layout", ["F", "C"])
async def test_preset_grad_keeps_layout_identity_and_sums(
    rt: Any, rng: np.random.Generator, layout: str
) -> None:
    """A user-preset `.grad` (here in the other order than the parameter) is accumulated into in place."""
    arr = rng.standard_normal((3, 4)) if layout == "F" else np.asfortranarray(rng.standard_normal((3, 4)))
    p = param(arr)
    start = rng.standard_normal((3, 4))
    buf = np.array(start, order=layout)  # a copy: `start` stays the reference
    preset = ag.from_numpy(buf)
    p.grad = preset
    c = rng.standard_normal((3, 4))
    before = stats(rt)
    with trio.fail_after(TIMEOUT):
        await (p * ag.tensor(c)).sum().backward()
        await (p * ag.tensor(c)).sum().backward()
    assert p.grad is preset
    g = p.grad.numpy()
    assert g.strides == buf.strides
    assert np.shares_memory(g, buf)
    np.testing.assert_allclose(g, start + 2 * c, rtol=1e-15)
    after = stats(rt)
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (0, 0, 2)


async def test_second_backward_accumulates_in_place(rt: Any, rng: np.random.Generator) -> None:
    arr = channels_last(rng)
    p = param(arr)
    c = rng.standard_normal(arr.shape)
    loss = (p * ag.tensor(c)).sum()
    with trio.fail_after(TIMEOUT):
        await loss.backward(retain_graph=True)
        first = p.grad
        addr = first.numpy().ctypes.data
        await loss.backward()
    assert p.grad is first
    assert p.grad.numpy().ctypes.data == addr
    assert p.grad.strides == arr.strides
    np.testing.assert_allclose(p.grad.numpy(), 2 * c, rtol=1e-15)


async def test_stealing_is_observable(rt: Any, rng: np.random.Generator) -> None:
    """The gradient reaching an identity-like op (p + 0) passes to p unchanged: `.grad` is that buffer."""
    p = param(rng.standard_normal((3, 4)))
    y = p + 0.0
    seen: dict[str, int] = {}

    def hook(g: ag.Tensor) -> None:
        seen["addr"] = g.numpy().ctypes.data  # record the address only: hold no reference

    y.register_hook(hook)
    c = ag.tensor(rng.standard_normal((3, 4)))
    before = stats(rt)
    with trio.fail_after(TIMEOUT):
        await (y * c).sum().backward()
    after = stats(rt)
    assert p.grad.numpy().ctypes.data == seen["addr"]
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)


async def test_contract_violating_grad_is_copied(rt: Any, rng: np.random.Generator) -> None:
    """Fortran parameter, C-ordered incoming gradient: copied into a Fortran buffer."""
    arr = fortran(rng)
    p = param(arr)
    y = p + 0.0
    seen: dict[str, Any] = {}

    def hook(g: ag.Tensor) -> None:
        a = g.numpy()
        seen["addr"], seen["c"] = a.ctypes.data, a.flags.c_contiguous

    y.register_hook(hook)
    c = ag.tensor(rng.standard_normal((3, 4)))
    before = stats(rt)
    with trio.fail_after(TIMEOUT):
        await (y * c).sum().backward()
    after = stats(rt)
    assert seen["c"]
    assert p.grad.numpy().ctypes.data != seen["addr"]
    assert p.grad.strides == arr.strides
    np.testing.assert_array_equal(p.grad.numpy(), c.numpy())
    assert (after[0] - before[0], after[1] - before[1]) == (0, 1)


async def test_grad_held_elsewhere_is_copied_not_stolen(rt: Any, rng: np.random.Generator) -> None:
    """A hook keeps the gradient tensor: `.grad` must not alias it, and later accumulation leaves it alone."""
    p = param(rng.standard_normal((3, 4)))
    y = p + 0.0
    held: list[ag.Tensor] = []
    y.register_hook(held.append)
    before = stats(rt)
    with trio.fail_after(TIMEOUT):
        await (y * ag.tensor(rng.standard_normal((3, 4)))).sum().backward()
    after = stats(rt)
    assert (after[0] - before[0], after[1] - before[1]) == (0, 1)
    assert not np.shares_memory(p.grad.numpy(), held[0].numpy())
    snapshot = held[0].numpy().copy()
    with trio.fail_after(TIMEOUT):
        await (p * 3.0).sum().backward()
    np.testing.assert_array_equal(held[0].numpy(), snapshot)


async def test_user_gradient_is_not_stolen(rt: Any, rng: np.random.Generator) -> None:
    """The caller still holds `gradient=`: `.grad` gets a copy, for a leaf and through an op."""
    p = param(rng.standard_normal((3, 4)))
    g = ag.tensor(np.ones((3, 4)))
    with trio.fail_after(TIMEOUT):
        await p.backward(g)
    assert p.grad is not g
    assert not np.shares_memory(p.grad.numpy(), g.numpy())
    q = param(rng.standard_normal((3, 4)))
    with trio.fail_after(TIMEOUT):
        await (q + 0.0).backward(g)
    assert not np.shares_memory(q.grad.numpy(), g.numpy())
    with ag.no_grad():
        p.grad.add_(1.0)
        q.grad.add_(1.0)
    np.testing.assert_array_equal(g.numpy(), np.ones((3, 4)))


async def test_create_graph_accumulates_out_of_place(rt: Any, rng: np.random.Generator) -> None:
    arr = fortran(rng)
    p = param(arr)
    start = np.asfortranarray(rng.standard_normal((3, 4)))
    preset = ag.from_numpy(start.copy(order="K"))
    p.grad = preset
    with trio.fail_after(TIMEOUT):
        await (p * p).sum().backward(create_graph=True)
    assert p.grad is not preset
    np.testing.assert_array_equal(preset.numpy(), start)  # the old .grad is untouched
    np.testing.assert_allclose(p.grad.numpy(), start + 2 * arr, rtol=1e-15)
    assert p.grad.requires_grad and p.grad.grad_fn is not None  # differentiable: grad of grad works
    (gg,) = await ag.grad(p.grad.sum(), [p])
    np.testing.assert_allclose(gg.numpy(), np.full((3, 4), 2.0))


async def test_create_graph_first_grad_is_differentiable_and_obeys_contract(
    rt: Any, rng: np.random.Generator
) -> None:
    arr = channels_last(rng)
    p = param(arr)
    c = ag.tensor(rng.standard_normal(arr.shape))
    with trio.fail_after(TIMEOUT):
        await (p * p * c).sum().backward(create_graph=True)
    assert p.grad.requires_grad
    assert p.grad.strides == arr.strides
    np.testing.assert_allclose(p.grad.numpy(), 2 * arr * c.numpy(), rtol=1e-14)


async def test_first_commit_through_a_new_owner_stays_on_the_gradients_stream(rng: np.random.Generator) -> None:
    """A training's first pass finds its leaves' owner not started yet, so the owner commits in its own
    task. The queued steal-or-copy of a still-computing gradient must go behind that gradient's kernel on
    its stream, not on a stream of the owner's task: no second stream, no cross-stream wait, and the
    gradient is still stolen."""
    n = 96  # outputs above the inline limit: the backward's kernels are queued, the gradient pending
    xa, wa = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    async with ag.open_runtime(lanes=1) as rt:
        w = param(wa.copy())
        x = ag.tensor(xa)
        before = stats(rt)
        with trio.fail_after(TIMEOUT):
            await (x @ w).sum().backward()
            await w.grad.ready()
        after = stats(rt)
        np.testing.assert_allclose(w.grad.numpy(), xa.T @ np.ones((n, n)), rtol=1e-12)
        assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
        assert rt.cpu.pool.created == 1
        assert all(s.statistics().pending == 0 for s in rt.cpu.pool.all_streams())
