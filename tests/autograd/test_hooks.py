"""Hooks and their handles: order (as PyTorch documents it), replacement of the gradient by a hook's return
value, removal of exactly one hook per handle (two owners on one parameter), handles as context managers,
removed hooks not leaking, and retain_grad on non-leaves."""

from __future__ import annotations

import gc
import weakref
from typing import Any, ClassVar

import numpy as np
import pytest
import trio

import asyncgrad as ag

TIMEOUT = 20


class Double(ag.Function):
    """y = 2x, logging when its backward runs."""

    log: ClassVar[list[Any]] = []

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> ag.Tensor:
        Double.log.append("node")
        return g * 2.0


def leaf(*shape: int, value: float = 1.0) -> ag.Tensor:
    return ag.tensor(np.full(shape, value), requires_grad=True)


async def test_hook_order(rt: Any) -> None:
    """tensor hooks -> node pre-hooks -> node -> node post-hooks; then the leaf's tensor hooks, `.grad`
    set, post-accumulate hooks (seeing the new `.grad`). Each kind in registration order."""
    log: list[Any] = []
    Double.log = log
    x = leaf(3)
    y = Double.apply(x)
    node = y.grad_fn
    y.register_hook(lambda g: log.append("tensor1"))
    node.register_prehook(lambda gs: log.append("pre1"))
    node.register_hook(lambda gi, go: log.append("post1"))
    y.register_hook(lambda g: log.append("tensor2"))
    node.register_prehook(lambda gs: log.append("pre2"))
    node.register_hook(lambda gi, go: log.append("post2"))
    x.register_post_accumulate_grad_hook(lambda t: log.append(("acc1", t.grad.numpy().tolist())))
    x.register_hook(lambda g: log.append(("leaf1", None if x.grad is None else "grad already set")))
    x.register_hook(lambda g: log.append(("leaf2", g.numpy().tolist())))
    x.register_post_accumulate_grad_hook(lambda t: log.append(("acc2", t.grad.numpy().tolist())))
    with trio.fail_after(TIMEOUT):
        await (y * 1.5).sum().backward()
    assert log == [
        "tensor1",
        "tensor2",
        "pre1",
        "pre2",
        "node",
        "post1",
        "post2",
        ("leaf1", None),
        ("leaf2", [3.0, 3.0, 3.0]),
        ("acc1", [3.0, 3.0, 3.0]),
        ("acc2", [3.0, 3.0, 3.0]),
    ]


async def test_post_accumulate_hook_sees_the_accumulated_grad(rt: Any) -> None:
    x = leaf(2)
    seen: list[list[float]] = []
    x.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().tolist()))
    with trio.fail_after(TIMEOUT):
        await (x * 2.0).sum().backward()
        await (x * 3.0).sum().backward()
    assert seen == [[2.0, 2.0], [5.0, 5.0]]


async def test_hook_arguments(rt: Any) -> None:
    x = leaf(2)
    y = x * 3.0
    got: dict[str, Any] = {}
    y.register_hook(lambda g: got.update(tensor=g))  # the hooks return None: gradients unchanged
    y.grad_fn.register_prehook(lambda gs: got.update(pre=gs))
    y.grad_fn.register_hook(lambda gi, go: got.update(post=(gi, go)))
    with trio.fail_after(TIMEOUT):
        await (y * 2.0).sum().backward()
    assert isinstance(got["tensor"], ag.Tensor)
    np.testing.assert_array_equal(got["tensor"].numpy(), [2.0, 2.0])
    assert isinstance(got["pre"], tuple) and len(got["pre"]) == 1
    gi, go = got["post"]
    assert isinstance(gi, tuple) and isinstance(go, tuple)
    np.testing.assert_array_equal(gi[0].numpy(), [6.0, 6.0])  # gradient w.r.t. the node's input x
    np.testing.assert_array_equal(go[0].numpy(), [2.0, 2.0])  # gradient w.r.t. its output y


async def test_leaf_hook_runs_once_on_the_summed_gradient(rt: Any) -> None:
    x = leaf(2)
    seen: list[list[float]] = []
    x.register_hook(lambda g: seen.append(g.numpy().tolist()))
    with trio.fail_after(TIMEOUT):
        await ((x * 2.0).sum() + (x * 3.0).sum() + x.sum()).backward()
    assert seen == [[6.0, 6.0]]


async def test_tensor_hook_return_value_replaces_the_gradient(rt: Any) -> None:
    x = leaf(3)
    y = x * 2.0
    y.register_hook(lambda g: g * 10.0)  # non-leaf: flows on to x
    y.register_hook(lambda g: g + 1.0)  # sees the replaced gradient
    x.register_hook(lambda g: g * 0.5)  # leaf: what lands in .grad
    with trio.fail_after(TIMEOUT):
        await y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [11.0, 11.0, 11.0])


async def test_node_hooks_can_replace_gradients(rt: Any) -> None:
    x = leaf(2)
    y = x * 2.0
    y.grad_fn.register_prehook(lambda gs: (gs[0] * 3.0,))
    y.grad_fn.register_hook(lambda gi, go: (gi[0] + 100.0,))
    with trio.fail_after(TIMEOUT):
        await y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [106.0, 106.0])


async def test_remove_by_handle_with_two_owners(rt: Any) -> None:
    """Two owners (say a reducer and a module) hook the same parameter, even with the same function:
    each handle removes only its own registration."""
    p = leaf(2)
    calls: list[str] = []

    def shared(g: ag.Tensor) -> None:
        calls.append("shared")

    h_a = p.register_hook(shared)
    h_b = p.register_hook(shared)
    h_c = p.register_hook(lambda g: calls.append("c"))
    pa_a = p.register_post_accumulate_grad_hook(lambda t: calls.append("acc-a"))
    pa_b = p.register_post_accumulate_grad_hook(lambda t: calls.append("acc-b"))
    with trio.fail_after(TIMEOUT):
        await (p * 1.0).sum().backward()
    assert calls == ["shared", "shared", "c", "acc-a", "acc-b"]

    calls.clear()
    h_a.remove()
    pa_b.remove()
    with trio.fail_after(TIMEOUT):
        await (p * 1.0).sum().backward()
    assert calls == ["shared", "c", "acc-a"]

    calls.clear()
    h_a.remove()  # removing twice is a no-op: it must not take the other owner's hook
    h_c.remove()
    with trio.fail_after(TIMEOUT):
        await (p * 1.0).sum().backward()
    assert calls == ["shared", "acc-a"]

    calls.clear()
    h_b.remove()
    pa_a.remove()
    with trio.fail_after(TIMEOUT):
        await (p * 1.0).sum().backward()
    assert calls == []
    np.testing.assert_array_equal(p.grad.numpy(), [4.0, 4.0])


async def test_remove_node_hooks_by_handle(rt: Any) -> None:
    x = leaf(2)
    y = x * 2.0
    calls: list[str] = []
    node = y.grad_fn
    hp1 = node.register_prehook(lambda gs: calls.append("pre1"))
    node.register_prehook(lambda gs: calls.append("pre2"))
    node.register_hook(lambda gi, go: calls.append("post1"))
    hq2 = node.register_hook(lambda gi, go: calls.append("post2"))
    ht = y.register_hook(lambda g: calls.append("tensor"))
    hp1.remove()
    hq2.remove()
    ht.remove()
    with trio.fail_after(TIMEOUT):
        await y.sum().backward()
    assert calls == ["pre2", "post1"]


async def test_handle_as_context_manager(rt: Any) -> None:
    p = leaf(2)
    calls: list[str] = []
    with p.register_hook(lambda g: calls.append("inside")) as h:
        assert isinstance(h, ag.RemovableHandle)
        with trio.fail_after(TIMEOUT):
            await (p * 1.0).sum().backward()
    with trio.fail_after(TIMEOUT):
        await (p * 1.0).sum().backward()
    assert calls == ["inside"]
    y = p * 2.0
    with y.grad_fn.register_prehook(lambda gs: calls.append("pre")):
        pass
    with trio.fail_after(TIMEOUT):
        await y.sum().backward()
    assert calls == ["inside"]


class Closure:
    """Something a hook's closure holds: when it dies, the closure died."""


def _hooked(target: Any, kind: str) -> tuple[Any, weakref.ref[Any], weakref.ref[Any]]:
    marker = Closure()

    def fn(*args: Any) -> None:
        marker.touched = True  # type: ignore[attr-defined]

    register = {
        "tensor": lambda: target.register_hook(fn),
        "post_accumulate": lambda: target.register_post_accumulate_grad_hook(fn),
        "prehook": lambda: target.grad_fn.register_prehook(fn),
        "node_hook": lambda: target.grad_fn.register_hook(fn),
    }[kind]
    return register(), weakref.ref(fn), weakref.ref(marker)


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
async def test_removed_leaf_hook_is_garbage_collectable(rt: Any, kind: str) -> None:
    """The hook was registered on a leaf that never went through a backward pass."""
    p = leaf(3)
    h, fn_ref, marker_ref = _hooked(p, kind)
    assert fn_ref() is not None
    h.remove()
    gc.collect()
    assert fn_ref() is None
    assert marker_ref() is None
    assert "removed" in repr(h)


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
async def test_removed_hook_of_trained_leaf_is_collectable_after_the_next_pass(rt: Any, kind: str) -> None:
    """A parameter that has been trained: once removed and after the next pass, its hook is gone for good."""
    p = leaf(3)
    with trio.fail_after(TIMEOUT):
        await (p * 1.0).sum().backward()
    h, fn_ref, marker_ref = _hooked(p, kind)
    with trio.fail_after(TIMEOUT):
        await (p * 1.0).sum().backward()
    assert marker_ref().touched  # type: ignore[union-attr]
    h.remove()
    with trio.fail_after(TIMEOUT):
        await (p * 1.0).sum().backward()
    gc.collect()
    assert fn_ref() is None
    assert marker_ref() is None


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
async def test_removed_hook_of_trained_leaf_is_collectable_at_once(rt: Any, kind: str) -> None:
    """PyTorch semantics: after ``h.remove(); del fn; gc.collect()`` nothing keeps the hook alive."""
    p = leaf(3)
    with trio.fail_after(TIMEOUT):
        await (p * 1.0).sum().backward()  # p now has an owner
    h, fn_ref, marker_ref = _hooked(p, kind)
    h.remove()
    gc.collect()
    assert "removed" in repr(h)
    assert fn_ref() is None
    assert marker_ref() is None


@pytest.mark.parametrize("kind", ["tensor", "prehook", "node_hook"])
async def test_removed_non_leaf_hook_is_garbage_collectable(rt: Any, kind: str) -> None:
    p = leaf(3)
    y = p * 2.0
    h, fn_ref, marker_ref = _hooked(y, kind)
    h.remove()
    gc.collect()
    assert fn_ref() is None
    assert marker_ref() is None
    with trio.fail_after(TIMEOUT):
        await y.sum().backward()
    np.testing.assert_array_equal(p.grad.numpy(), [2.0, 2.0, 2.0])


async def test_graph_does_not_outlive_a_pass_through_hooks(rt: Any) -> None:
    """A hook that ran keeps nothing of the pass alive once the graph is dropped."""
    p = leaf(3)
    y = p * 2.0
    h, fn_ref, marker_ref = _hooked(y, "tensor")
    with trio.fail_after(TIMEOUT):
        await y.sum().backward()
    assert marker_ref().touched  # type: ignore[union-attr]
    del y, h
    gc.collect()
    assert fn_ref() is None and marker_ref() is None


async def test_retain_grad_on_non_leaf(rt: Any) -> None:
    x = leaf(3, value=2.0)
    y = x * x
    z = y * 3.0
    assert not y.retains_grad
    y.retain_grad()
    assert y.retains_grad
    y.retain_grad()  # idempotent
    x.retain_grad()  # a no-op on a leaf
    with trio.fail_after(TIMEOUT):
        await z.sum().backward()
    np.testing.assert_array_equal(y.grad.numpy(), [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(x.grad.numpy(), [12.0, 12.0, 12.0])
    with pytest.warns(UserWarning, match="not a leaf"):
        assert z.grad is None  # not retained (and reading it warns, as in PyTorch)
    assert y.grad.grad_fn is None and not y.grad.requires_grad


async def test_retain_grad_sees_tensor_hook_result(rt: Any) -> None:
    x = leaf(3)
    y = x * 2.0
    y.retain_grad()
    y.register_hook(lambda g: g * 2.0)  # registered after retain_grad: still applies first (PyTorch >= 2.0)
    with trio.fail_after(TIMEOUT):
        await y.sum().backward()
    np.testing.assert_array_equal(y.grad.numpy(), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 4.0, 4.0])


async def test_retain_grad_runs_before_node_prehooks(rt: Any) -> None:
    x = leaf(3)
    y = x * 2.0
    y.retain_grad()
    y.grad_fn.register_prehook(lambda gs: (gs[0] * 10.0,))
    with trio.fail_after(TIMEOUT):
        await y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [20.0, 20.0, 20.0])
    np.testing.assert_array_equal(y.grad.numpy(), [1.0, 1.0, 1.0])


async def test_retain_grad_accumulates_like_pytorch(rt: Any) -> None:
    """retain_graph + a second backward: a retained non-leaf grad accumulates (PyTorch does too)."""
    x = leaf(2)
    y = x * 2.0
    y.retain_grad()
    loss = y.sum()
    with trio.fail_after(TIMEOUT):
        await loss.backward(retain_graph=True)
        await loss.backward()
    np.testing.assert_array_equal(y.grad.numpy(), [2.0, 2.0])


async def test_hook_registration_needs_requires_grad(rt: Any) -> None:
    t = ag.tensor(np.ones(2))
    with pytest.raises(RuntimeError):
        t.register_hook(lambda g: None)
    y = leaf(2) * 2.0
    with pytest.raises(RuntimeError):
        y.register_post_accumulate_grad_hook(lambda t: None)
    with pytest.raises(TypeError):
        leaf(2).register_hook(42)  # type: ignore[arg-type]
