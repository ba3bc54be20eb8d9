"""Backward passes (``autograd/_engine.py``, ``autograd/_api.py``): retain_graph, create_graph, inputs=,
allow_unused, grad modes scoped per trio task, and the leaf / graph attributes (detach, requires_grad_,
is_leaf, grad_fn).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from tests._util import leaf

TIMEOUT = 20


# ---- retain_graph, create_graph, inputs=, ag.grad ----------------------------------------------------------


async def test_retain_graph_second_backward_sums_into_grad(rt: Any) -> None:
    x = leaf([1.0, 2.0, 3.0])
    loss = (x * x).sum()
    with trio.fail_after(TIMEOUT):
        await loss.backward(retain_graph=True)
        np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0, 6.0])
        await loss.backward(retain_graph=True)
        await loss.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [6.0, 12.0, 18.0])


async def test_separate_graphs_accumulate(rt: Any) -> None:
    x = leaf([1.0, 2.0])
    with trio.fail_after(TIMEOUT):
        await (x * 3.0).sum().backward()
        await (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [5.0, 7.0])


async def test_shared_subexpression_gradients_add_up(rt: Any) -> None:
    x = leaf([1.0, -2.0])
    y = x * 3.0
    z = y * y + y + ag.exp(y) * 0.0  # y feeds three nodes
    with trio.fail_after(TIMEOUT):
        await z.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 3.0 * (2 * 3.0 * np.array([1.0, -2.0]) + 1.0))


async def test_create_graph_grad_of_grad_of_cube(rt: Any) -> None:
    xs = np.array([-1.5, 0.5, 2.0])
    x = leaf(xs)
    y = (x**3).sum()
    with trio.fail_after(TIMEOUT):
        (g1,) = await ag.grad(y, [x], create_graph=True)
        np.testing.assert_allclose(g1.numpy(), 3 * xs**2)
        assert g1.requires_grad and g1.grad_fn is not None
        (g2,) = await ag.grad(g1.sum(), [x], create_graph=True)
        np.testing.assert_allclose(g2.numpy(), 6 * xs)
        (g3,) = await ag.grad(g2.sum(), [x])
        np.testing.assert_allclose(g3.numpy(), [6.0, 6.0, 6.0])
        assert not g3.requires_grad
    assert x.grad is None  # ag.grad never touches .grad


async def test_create_graph_backward_then_backward_through_grad(rt: Any) -> None:
    xs = np.array([1.0, 2.0])
    x = leaf(xs)
    with trio.fail_after(TIMEOUT):
        await (x**3).sum().backward(create_graph=True)
        g = x.grad
        np.testing.assert_allclose(g.numpy(), 3 * xs**2)
        assert g.requires_grad
        x.grad = None
        await g.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 6 * xs)


async def test_plain_backward_grads_do_not_require_grad(rt: Any) -> None:
    x = leaf([1.0, 2.0])
    with trio.fail_after(TIMEOUT):
        await (x**3).sum().backward()
        (g,) = await ag.grad((x**3).sum(), [x])
    assert not x.grad.requires_grad and x.grad.grad_fn is None
    assert not g.requires_grad and g.grad_fn is None


async def test_inputs_restricts_accumulation(rt: Any) -> None:
    a, b = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    loss = (a * b).sum()
    with trio.fail_after(TIMEOUT):
        await loss.backward(inputs=[a], retain_graph=True)
    np.testing.assert_array_equal(a.grad.numpy(), [3.0, 4.0])
    assert b.grad is None
    with trio.fail_after(TIMEOUT):
        await loss.backward(inputs=b)
    np.testing.assert_array_equal(a.grad.numpy(), [3.0, 4.0])
    np.testing.assert_array_equal(b.grad.numpy(), [1.0, 2.0])


async def test_inputs_may_name_a_non_leaf(rt: Any) -> None:
    a = leaf([1.0, 2.0])
    h = a * 2.0
    loss = (h * h).sum()
    with trio.fail_after(TIMEOUT):
        await loss.backward(inputs=[h])
    np.testing.assert_array_equal(h.grad.numpy(), [4.0, 8.0])
    assert a.grad is None


async def test_grad_returns_without_accumulating(rt: Any) -> None:
    a, b = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    ga, gb = await ag.grad((a * b).sum(), [a, b])
    np.testing.assert_array_equal(ga.numpy(), [3.0, 4.0])
    np.testing.assert_array_equal(gb.numpy(), [1.0, 2.0])
    assert a.grad is None and b.grad is None


async def test_grad_with_allow_unused(rt: Any) -> None:
    a, unused = leaf([1.0, 2.0]), leaf([5.0])
    ga, gu = await ag.grad((a * a).sum(), [a, unused], allow_unused=True)
    np.testing.assert_array_equal(ga.numpy(), [2.0, 4.0])
    assert gu is None


async def test_grad_with_grad_outputs_and_non_leaf_input(rt: Any) -> None:
    a = leaf([1.0, 2.0, 3.0])
    h = a * a
    out = h * 2.0
    gh, ga = await ag.grad(out, [h, a], grad_outputs=[ag.tensor(np.array([1.0, 0.0, -1.0]))])
    np.testing.assert_array_equal(gh.numpy(), [2.0, 0.0, -2.0])
    np.testing.assert_array_equal(ga.numpy(), [4.0, 0.0, -12.0])


async def test_backward_of_several_roots(rt: Any) -> None:
    a = leaf([1.0, 2.0])
    with trio.fail_after(TIMEOUT):
        await ag.backward([(a * 2.0).sum(), (a * a).sum()])
    np.testing.assert_array_equal(a.grad.numpy(), [4.0, 6.0])


async def test_backward_of_a_leaf(rt: Any) -> None:
    a = leaf([1.0, 2.0])
    with trio.fail_after(TIMEOUT):
        await a.backward(ag.tensor(np.array([3.0, 4.0])))
    np.testing.assert_array_equal(a.grad.numpy(), [3.0, 4.0])


# ---- grad modes --------------------------------------------------------------------------------------------


async def test_no_grad_enable_grad_nesting(rt: Any) -> None:
    x = leaf([1.0])
    assert ag.is_grad_enabled()
    with ag.no_grad():
        assert not ag.is_grad_enabled()
        y = x * 2.0
        with ag.enable_grad():
            assert ag.is_grad_enabled()
            z = x * 2.0
        assert not ag.is_grad_enabled()
    assert ag.is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None
    assert z.requires_grad and z.grad_fn is not None


async def test_set_grad_enabled_forms(rt: Any) -> None:
    x = leaf([1.0])
    with ag.set_grad_enabled(False):
        assert not ag.is_grad_enabled()
        assert (x * 2.0).grad_fn is None
    assert ag.is_grad_enabled()
    ag.set_grad_enabled(False)  # a plain call changes this task's mode at once
    try:
        assert not ag.is_grad_enabled()
        assert (x * 2.0).grad_fn is None
    finally:
        ag.set_grad_enabled(True)
    assert ag.is_grad_enabled()
    with ag.set_grad_enabled(True):
        assert (x * 2.0).grad_fn is not None


async def test_grad_mode_decorators(rt: Any) -> None:
    x = leaf([1.0])

    @ag.no_grad()
    def plain() -> ag.Tensor:
        return x * 2.0

    @ag.no_grad()
    async def coro() -> ag.Tensor:
        await trio.lowlevel.checkpoint()
        return x * 2.0

    assert plain().grad_fn is None
    assert (await coro()).grad_fn is None
    assert ag.is_grad_enabled()
    assert (x * 2.0).grad_fn is not None


async def test_grad_mode_is_scoped_per_trio_task(rt: Any) -> None:
    """Two concurrent tasks in different modes, interleaved at every step, never see each other's mode."""
    x = leaf([1.0, 2.0])
    off_set, on_checked, done = trio.Event(), trio.Event(), trio.Event()
    seen: dict[str, Any] = {}

    async def task_off() -> None:
        with ag.no_grad():
            off_set.set()
            await on_checked.wait()  # the other task runs while we sit in no_grad
            seen["off_mode"] = ag.is_grad_enabled()
            seen["off_rg"] = (x * 2.0).requires_grad
        ag.set_grad_enabled(False)  # plain call: lasts for the rest of this task only
        done.set()
        await trio.lowlevel.checkpoint()
        seen["off_after"] = ag.is_grad_enabled()

    async def task_on() -> None:
        await off_set.wait()
        seen["on_mode"] = ag.is_grad_enabled()
        seen["on_rg"] = (x * 2.0).requires_grad
        on_checked.set()
        await done.wait()
        seen["on_after"] = ag.is_grad_enabled()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as n:
            n.start_soon(task_off)
            n.start_soon(task_on)
    assert seen == {
        "off_mode": False,
        "off_rg": False,
        "off_after": False,
        "on_mode": True,
        "on_rg": True,
        "on_after": True,
    }
    assert ag.is_grad_enabled()  # the parent task is untouched as well


async def test_backward_inside_no_grad_still_works(rt: Any) -> None:
    x = leaf([1.0, 2.0])
    loss = (x * x).sum()
    with ag.no_grad(), trio.fail_after(TIMEOUT):
        await loss.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0])


# ---- tensor attributes -------------------------------------------------------------------------------------


async def test_detach(rt: Any) -> None:
    x = leaf([1.0, 2.0])
    y = x * 3.0
    d = y.detach()
    assert d.grad_fn is None and not d.requires_grad and d.is_leaf
    assert np.shares_memory(d.numpy(), y.numpy())
    np.testing.assert_array_equal(d.numpy(), [3.0, 6.0])
    z = d * x  # only x carries gradient
    with trio.fail_after(TIMEOUT):
        await z.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 6.0])


async def test_requires_grad_(rt: Any) -> None:
    t = ag.tensor(np.ones(2))
    assert not t.requires_grad
    assert t.requires_grad_() is t
    assert t.requires_grad and t.is_leaf
    t.requires_grad_(False)
    assert not t.requires_grad
    i = ag.tensor(np.array([1, 2]))
    with pytest.raises(RuntimeError):
        i.requires_grad_()
    y = leaf([1.0]) * 2.0
    with pytest.raises(RuntimeError):
        y.requires_grad_(False)
    y.requires_grad_(True)  # allowed, a no-op


async def test_is_leaf_and_grad_fn(rt: Any) -> None:
    a = leaf([1.0, 2.0])
    c = ag.tensor(np.ones(2))
    assert a.is_leaf and a.grad_fn is None
    assert c.is_leaf and c.grad_fn is None
    y = a * c
    assert not y.is_leaf and y.requires_grad
    assert y.grad_fn.name() == "MulBackward0"
    nf = y.grad_fn.next_functions
    assert len(nf) == 2
    assert nf[0][0].name() == "AccumulateGrad" and nf[0][0].variable is a
    assert nf[1] == (None, 0)
    z = ag.exp(y).sum()
    assert z.grad_fn.name() == "SumBackward0"
    assert z.grad_fn.next_functions[0][0].name() == "ExpBackward0"
    w = c * 2.0  # no input requires grad: a leaf, no graph
    assert w.is_leaf and w.grad_fn is None and not w.requires_grad
    with ag.no_grad():
        v = a * 2.0
    assert v.is_leaf and not v.requires_grad


async def test_grad_setter_validates(rt: Any) -> None:
    a = leaf([1.0, 2.0])
    a.grad = ag.tensor(np.array([5.0, 5.0]))
    with trio.fail_after(TIMEOUT):
        await (a * 1.0).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), [6.0, 6.0])
    with pytest.raises(RuntimeError):
        a.grad = ag.tensor(np.ones(3))
    with pytest.raises(RuntimeError):
        a.grad = ag.tensor(np.ones(2, dtype=np.float32))
    a.grad = None
    assert a.grad is None
