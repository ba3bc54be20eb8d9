"""Errors users see, with their exact messages: shape mismatches (naming the op and the shapes), backward
twice, backward on a non-scalar without `gradient`, device mismatch, tensor ops outside a runtime; an
exception raised in a backward function or hook reaches the caller as itself, with a note naming where it
was raised; and a failed backward leaves every `.grad` bit-identical to before."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag

TIMEOUT = 20

BROADCAST = (
    "{op}: shapes {a} and {b} cannot be broadcast together; make each dimension equal or 1 "
    "(reshape or unsqueeze one operand)"
)
RETAIN = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they "
    "have already been freed). Saved intermediate values of the graph are freed when you call "
    "backward() or grad(). Specify retain_graph=True if you need to backward through the graph a "
    "second time or if you need to access saved tensors after calling backward."
)
NO_RUNTIME = (
    "{what} needs an asyncgrad runtime, and none is open in this task: wrap your code in "
    "`async with asyncgrad.open_runtime():` or start it with `asyncgrad.run(main)`"
)


def raises_exactly(exc: type[BaseException], msg: str, fn: Callable[[], Any]) -> BaseException:
    with pytest.raises(exc, match=re.escape(msg)) as info:
        fn()
    assert str(info.value) == msg
    return info.value


async def araises_exactly(exc: type[BaseException], msg: str, fn: Callable[[], Any]) -> BaseException:
    with pytest.raises(exc, match=re.escape(msg)) as info:
        with trio.fail_after(TIMEOUT):
            await fn()
    assert str(info.value) == msg
    return info.value


async def araises_user(exc: type[BaseException], msg: str, note: str, fn: Callable[[], Any]) -> BaseException:
    """``fn()`` raises the user's own exception: exactly ``exc`` (not wrapped), ``msg``, and ``note`` as a note."""
    with pytest.raises(exc) as info:
        with trio.fail_after(TIMEOUT):
            await fn()
    e = info.value
    assert type(e) is exc
    assert str(e) == msg
    assert getattr(e, "__notes__", None) == [note]
    return e


def t(*shape: int, rg: bool = False) -> ag.Tensor:
    return ag.tensor(np.ones(shape), requires_grad=rg)


# ---- shape mismatches --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, fn",
    [
        ("add", lambda a, b: a + b),
        ("add", ag.add),
        ("sub", lambda a, b: a - b),
        ("mul", lambda a, b: a * b),
        ("div", lambda a, b: a / b),
        ("pow", lambda a, b: a**b),
        ("maximum", ag.maximum),
        ("minimum", ag.minimum),
    ],
)
@pytest.mark.parametrize("sa, sb", [((3, 4), (5,)), ((2, 3), (3, 2)), ((3, 1, 4), (2, 4, 1, 5))])
async def test_broadcast_mismatch_names_op_and_shapes(rt: Any, name: str, fn: Any, sa: Any, sb: Any) -> None:
    a, b = t(*sa, rg=True), t(*sb)
    raises_exactly(ag.OpError, BROADCAST.format(op=name, a=sa, b=sb), lambda: fn(a, b))


async def test_where_shape_mismatch(rt: Any) -> None:
    x, y = t(2, 3), t(2, 3)
    cond = ag.tensor(np.ones(4, dtype=bool))
    raises_exactly(ag.OpError, BROADCAST.format(op="where", a=(4,), b=(2, 3)), lambda: ag.where(cond, x, y))


async def test_matmul_inner_dimension_mismatch(rt: Any) -> None:
    a, b = t(3, 4), t(5, 2)
    msg = (
        "matmul: shapes (3, 4) and (5, 2) are not aligned: (..., n, k) @ (..., k, m) needs equal k, "
        "got 4 and 5"
    )
    raises_exactly(ag.OpError, msg, lambda: a @ b)
    msg1 = (
        "matmul: shapes (3,) and (4, 2) are not aligned: (..., n, k) @ (..., k, m) needs equal k, got 3 and 4"
    )
    raises_exactly(ag.OpError, msg1, lambda: ag.matmul(t(3), t(4, 2)))


async def test_matmul_batch_mismatch_names_both_shapes(rt: Any) -> None:
    msg = (
        "matmul: shapes (2, 3, 4) and (5, 4, 2) have batch dimensions (2,) and (5,) that cannot be "
        "broadcast together; make each batch dimension equal or 1"
    )
    raises_exactly(ag.OpError, msg, lambda: t(2, 3, 4) @ t(5, 4, 2))


async def test_matmul_of_a_scalar(rt: Any) -> None:
    msg = "matmul: both operands need at least 1 dim, got shapes (2, 3) and ()"
    raises_exactly(ag.OpError, msg, lambda: t(2, 3) @ t())


async def test_shape_op_errors(rt: Any) -> None:
    x = t(2, 3, 4)
    raises_exactly(
        ag.OpError,
        "reshape: shape (5, 5) is invalid for input of shape (2, 3, 4) (24 elements)",
        lambda: x.reshape(5, 5),
    )
    raises_exactly(
        ag.OpError,
        "concat: tensors must match in every dim but 0, got shapes [(2, 3, 4), (2, 2, 4)]",
        lambda: ag.concat([x, t(2, 2, 4)]),
    )
    raises_exactly(
        ag.OpError,
        "stack: all tensors must have the same shape, got [(2, 3, 4), (2, 3)]",
        lambda: ag.stack([x, t(2, 3)]),
    )
    raises_exactly(
        ag.OpError, "broadcast_to: cannot broadcast shape (2, 3, 4) to (3, 4)", lambda: x.broadcast_to(3, 4)
    )
    raises_exactly(
        ag.OpError,
        "permute: dims (0, 0, 1) are not a permutation of the 3 dims of shape (2, 3, 4)",
        lambda: x.permute(0, 0, 1),
    )


async def test_op_error_is_a_value_error(rt: Any) -> None:
    with pytest.raises(ValueError):
        t(2) + t(3)


# ---- backward misuse ---------------------------------------------------------------------------------------


async def test_backward_twice_without_retain_graph(rt: Any) -> None:
    x = t(3, rg=True)
    loss = (x * x).sum()
    with trio.fail_after(TIMEOUT):
        await loss.backward()
    before = x.grad.numpy().copy()
    await araises_exactly(RuntimeError, RETAIN, lambda: loss.backward())
    np.testing.assert_array_equal(x.grad.numpy(), before)
    loss2 = (x * x).sum()
    with trio.fail_after(TIMEOUT):
        await ag.grad(loss2, [x])
    await araises_exactly(RuntimeError, RETAIN, lambda: ag.grad(loss2, [x]))


@pytest.mark.parametrize("inline", [True, False])
async def test_backward_twice_through_nodes_that_saved_nothing(inline: bool, monkeypatch: Any) -> None:
    """PyTorch frees only saved tensors: a graph of nodes whose backward reads no values (sum, add, reshape,
    indexing, mean, broadcasting) runs backward again, accumulating; one saving a tensor still raises."""
    from tests._util import set_inline_limit

    if not inline:
        set_inline_limit(monkeypatch, -1)
    async with ag.open_runtime():
        x = ag.tensor([1.0, 2.0, 3.0], dtype="float64", requires_grad=True)
        y = (x.reshape(3, 1) + x[1:].sum() + 1).mean()
        with trio.fail_after(TIMEOUT):
            await y.backward()
            first = x.grad.numpy().copy()
            await y.backward()
            (g,) = await ag.grad(y, [x])
        np.testing.assert_allclose(first, [1 / 3, 4 / 3, 4 / 3])  # what PyTorch gives
        np.testing.assert_allclose(x.grad.numpy(), 2 * first)
        np.testing.assert_allclose(g.numpy(), first)
        assert [f is None for f, _ in y.grad_fn.next_functions] == [False]
        z = (x * x).sum()
        await z.backward()
        await araises_exactly(RuntimeError, RETAIN, lambda: z.backward())


async def test_backward_twice_through_a_function(rt: Any) -> None:
    class Square(ag.Function):
        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx: Any, g: ag.Tensor) -> ag.Tensor:
            (x,) = ctx.saved_tensors
            return 2.0 * x * g

    x = t(3, rg=True)
    loss = Square.apply(x).sum()
    with trio.fail_after(TIMEOUT):
        await loss.backward()
    await araises_exactly(RuntimeError, RETAIN, lambda: loss.backward())


async def test_backward_on_non_scalar_without_gradient(rt: Any) -> None:
    x = t(3, rg=True)
    msg = (
        "backward: grad can be implicitly created only for scalar outputs, but the output has shape (3,); "
        "pass gradient= (a tensor of shape (3,)) to backward()"
    )
    await araises_exactly(RuntimeError, msg, lambda: (x * 2.0).backward())
    msg2 = msg.replace("(3,)", "(2, 3)")
    y = t(2, 3, rg=True)
    await araises_exactly(RuntimeError, msg2, lambda: (y * 2.0).backward())
    assert x.grad is None and y.grad is None
    with trio.fail_after(TIMEOUT):
        await (x * 2.0).backward(ag.tensor(np.ones(3)))  # with gradient= it works
        await (x * 2.0).sum().reshape(1, 1).backward()  # one element: no gradient= needed
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 4.0, 4.0])


async def test_grad_on_non_scalar_without_grad_outputs(rt: Any) -> None:
    x = t(3, rg=True)
    msg = (
        "grad: grad can be implicitly created only for scalar outputs, but the output has shape (3,); "
        "pass grad_outputs= (a tensor of shape (3,)) to grad()"
    )
    await araises_exactly(RuntimeError, msg, lambda: ag.grad(x * 2.0, [x]))


async def test_backward_gradient_shape_mismatch(rt: Any) -> None:
    x = t(3, rg=True)
    msg = "backward: gradient has shape (2,) but the output has shape (3,); they must match"
    await araises_exactly(RuntimeError, msg, lambda: (x * 2.0).backward(ag.tensor(np.ones(2))))


async def test_backward_of_tensor_without_graph(rt: Any) -> None:
    msg = (
        "backward: element 0 of tensors does not require grad and does not have a grad_fn; did you forget "
        "requires_grad=True on the inputs, or run the forward under no_grad()?"
    )
    await araises_exactly(RuntimeError, msg, lambda: t(3).sum().backward())
    x = t(3, rg=True)
    with ag.no_grad():
        y = (x * 2.0).sum()
    await araises_exactly(RuntimeError, msg, lambda: y.backward())


async def test_grad_of_unused_input(rt: Any) -> None:
    x, z = t(3, rg=True), t(3, rg=True)
    msg = (
        "grad: one of the differentiated Tensors appears to not have been used in the graph; set "
        "allow_unused=True if this is the desired behavior"
    )
    await araises_exactly(RuntimeError, msg, lambda: ag.grad((x * 2.0).sum(), [x, z]))


# ---- devices -----------------------------------------------------------------------------------------------


async def test_device_mismatch() -> None:
    async with ag.open_runtime(cpu_devices=2):
        a = ag.tensor([1.0, 2.0], device="cpu:1")
        b = ag.tensor([1.0, 2.0])
        assert str(a.device) == "cpu:1" and str(b.device) == "cpu"
        msg = (
            "add: expected all tensors on one device, got devices ['cpu:1', 'cpu'] (shapes [(2,), (2,)]); "
            "move them with .to(device) first"
        )
        raises_exactly(ag.OpError, msg, lambda: a + b)
        msg_mm = (
            "matmul: expected all tensors on one device, got devices ['cpu', 'cpu:1'] "
            "(shapes [(2, 2), (2,)]); move them with .to(device) first"
        )
        raises_exactly(ag.OpError, msg_mm, lambda: ag.tensor(np.ones((2, 2))) @ a)
        c = a.to("cpu") + b  # the fix the message suggests
        np.testing.assert_array_equal(c.numpy(), [2.0, 4.0])
        assert str(c.device) == "cpu"


# ---- outside a runtime -------------------------------------------------------------------------------------


async def test_factory_outside_a_runtime() -> None:
    raises_exactly(ag.NoRuntimeError, NO_RUNTIME.format(what="asyncgrad.tensor"), lambda: ag.tensor([1.0]))
    raises_exactly(ag.NoRuntimeError, NO_RUNTIME.format(what="asyncgrad.zeros"), lambda: ag.zeros(2))
    raises_exactly(
        ag.NoRuntimeError, NO_RUNTIME.format(what="asyncgrad.from_numpy"), lambda: ag.from_numpy(np.ones(2))
    )
    assert issubclass(ag.NoRuntimeError, RuntimeError)


def test_factory_outside_trio() -> None:
    raises_exactly(ag.NoRuntimeError, NO_RUNTIME.format(what="asyncgrad.tensor"), lambda: ag.tensor([1.0]))


async def test_backward_after_the_runtime_closed() -> None:
    async with ag.open_runtime():
        x = t(3, rg=True)
        loss = (x * 2.0).sum()
    await araises_exactly(ag.NoRuntimeError, NO_RUNTIME.format(what="backward()"), lambda: loss.backward())
    await araises_exactly(ag.NoRuntimeError, NO_RUNTIME.format(what="grad()"), lambda: ag.grad(loss, [x]))


def _tensors_from_a_closed_runtime() -> dict[str, ag.Tensor]:
    out: dict[str, ag.Tensor] = {}

    async def main() -> None:
        async with ag.open_runtime():
            out["small"] = ag.tensor(np.ones((3, 4)))
            out["big"] = ag.tensor(np.ones((100, 100)))

    trio.run(main)
    return out


async def test_op_after_the_runtime_closed() -> None:
    async with ag.open_runtime():
        x = t(3, 4)
    raises_exactly(ag.NoRuntimeError, NO_RUNTIME.format(what="add"), lambda: x + 1.0)


async def test_op_in_another_trio_run_without_a_runtime() -> None:
    ts = await trio.to_thread.run_sync(_tensors_from_a_closed_runtime)
    raises_exactly(ag.NoRuntimeError, NO_RUNTIME.format(what="mul"), lambda: ts["small"] * 2.0)


def test_op_outside_trio() -> None:
    ts = _tensors_from_a_closed_runtime()
    raises_exactly(ag.NoRuntimeError, NO_RUNTIME.format(what="mul"), lambda: ts["small"] * 2.0)


async def test_large_op_after_the_runtime_closed_fails_instead_of_hanging() -> None:
    """A queued op needs the device's lanes: with the runtime gone it must raise, not wait forever."""
    async with ag.open_runtime():
        x = t(100, 100)
    with trio.fail_after(TIMEOUT), pytest.raises(RuntimeError):
        y = x + 1.0
        await y.ready()


# ---- a failed backward changes no .grad --------------------------------------------------------------------


class Boom(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> ag.Tensor:
        raise ValueError("boom")


class AsyncBoom(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 1.0

    @staticmethod
    async def backward(ctx: Any, g: ag.Tensor) -> ag.Tensor:
        await trio.lowlevel.checkpoint()
        raise ValueError("boom")


def _params(rng: np.random.Generator) -> tuple[ag.Tensor, ...]:
    a = ag.from_numpy(np.asfortranarray(rng.standard_normal((3, 4)))).requires_grad_()
    b = ag.tensor(rng.standard_normal((3, 4)), requires_grad=True)
    c = ag.tensor(rng.standard_normal((3, 4)), requires_grad=True)
    d = ag.tensor(rng.standard_normal((3, 4)), requires_grad=True)
    return a, b, c, d


def _snapshot(ps: tuple[ag.Tensor, ...]) -> list[Any]:
    return [(p.grad, None if p.grad is None else (p.grad.numpy().tobytes(), p.grad.strides)) for p in ps]


async def _presets(ps: tuple[ag.Tensor, ...], rng: np.random.Generator) -> None:
    a, b, c, _ = ps
    with trio.fail_after(TIMEOUT):
        await ((a * b).sum() + (c * c).sum()).backward()  # a, b, c get a .grad; d none


@pytest.mark.parametrize(
    "fail, note",
    [
        (Boom, "raised in the backward of BoomBackward"),
        (AsyncBoom, "raised in the backward of AsyncBoomBackward"),
    ],
    ids=["plain", "async"],
)
async def test_failed_backward_leaves_every_grad_bit_identical(
    rt: Any, rng: np.random.Generator, fail: Any, note: str
) -> None:
    ps = _params(rng)
    a, b, c, d = ps
    await _presets(ps, rng)
    before = _snapshot(ps)
    # the failing node is the oldest, so every other node (and leaf) has run before it fails
    broken = fail.apply(a)
    loss = broken.sum() + (b * c).sum() + (d * 3.0).sum() + (a * 2.0).sum()
    e = await araises_user(ValueError, "boom", note, lambda: loss.backward())
    # the traceback still reaches the line that raised, in the user's backward
    assert e.__traceback__ is not None
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "backward" and tb.tb_frame.f_code.co_filename == __file__
    after = _snapshot(ps)
    for (g0, s0), (g1, s1) in zip(before, after):
        assert g1 is g0
        assert s1 == s0
    assert d.grad is None
    # the runtime carries on
    with trio.fail_after(TIMEOUT):
        await (d * 1.0).sum().backward()
    np.testing.assert_array_equal(d.grad.numpy(), np.ones((3, 4)))


async def test_failed_leaf_hook_leaves_every_grad_bit_identical(rt: Any, rng: np.random.Generator) -> None:
    ps = _params(rng)
    a, b, c, d = ps
    await _presets(ps, rng)
    before = _snapshot(ps)
    d.register_hook(lambda g: 1 / 0)
    note = "raised in a hook on a leaf tensor of shape (3, 4)"
    await araises_user(
        ZeroDivisionError, "division by zero", note, lambda: ((a * b).sum() + (c * d).sum()).backward()
    )
    assert _snapshot(ps) == before


async def test_failed_tensor_hook_message(rt: Any) -> None:
    x = t(2, rg=True)
    y = x * 2.0
    y.register_hook(lambda g: g[:1])
    msg = (
        "a hook on MulBackward0 returned (1,) but the gradient has shape (2,); a hook must return None or a "
        "Tensor of the same shape"
    )
    await araises_exactly(ag.BackwardError, msg, lambda: y.sum().backward())
    assert x.grad is None


async def test_tensor_hook_returning_a_non_tensor_is_a_type_error(rt: Any) -> None:
    # PyTorch: TypeError for a hook's result that is no tensor (a RuntimeError for a wrong size)
    x = t(2, rg=True)
    y = x * 2.0
    y.register_hook(lambda g: 3)
    msg = (
        "a hook on MulBackward0 returned int but the gradient has shape (2,); a hook must return None or a "
        "Tensor of the same shape"
    )
    await araises_exactly(TypeError, msg, lambda: y.sum().backward())
    assert x.grad is None


class WrongShape(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> ag.Tensor:
        return ag.ones(3, dtype="float64")


async def test_wrong_gradient_shape_from_a_backward_is_a_runtime_error(rt: Any) -> None:
    # the engine's own check (PyTorch: RuntimeError "returned an invalid gradient"): a BackwardError
    x = t(2, rg=True)
    x.grad = ag.full((2,), 5.0, dtype="float64")
    msg = "WrongShapeBackward: backward returned a gradient of shape (3,) for input 0, which has shape (2,)"
    e = await araises_exactly(ag.BackwardError, msg, lambda: WrongShape.apply(x).sum().backward())
    assert isinstance(e, RuntimeError)
    np.testing.assert_array_equal(x.grad.numpy(), np.full(2, 5.0))


class OddNotes(Exception):
    pass


async def test_exception_with_a_non_list_notes_attribute_is_reraised_as_it_is(rt: Any) -> None:
    class Odd(ag.Function):
        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            return x * 1.0

        @staticmethod
        def backward(ctx: Any, g: ag.Tensor) -> ag.Tensor:
            e = OddNotes("odd")
            e.__notes__ = ("not", "a list")  # type: ignore[assignment]
            raise e

    x = t(2, rg=True)
    with pytest.raises(OddNotes) as info:
        with trio.fail_after(TIMEOUT):
            await Odd.apply(x).sum().backward()
    assert str(info.value) == "odd" and info.value.__notes__ == ("not", "a list")
    assert x.grad is None


@pytest.mark.parametrize(
    "where, note",
    [
        ("non-leaf tensor hook", "raised in a hook on MulBackward0"),
        ("node pre-hook", "raised in a hook on MulBackward0"),
        ("node hook", "raised in a hook on MulBackward0"),
        ("leaf tensor hook", "raised in a hook on a leaf tensor of shape (2,)"),
    ],
)
async def test_exception_in_a_hook_is_reraised_with_a_note(rt: Any, where: str, note: str) -> None:
    x = t(2, rg=True)
    y = x * 2.0

    def hook(*_: Any) -> None:
        raise KeyError("nope")

    if where == "non-leaf tensor hook":
        y.register_hook(hook)
    elif where == "node pre-hook":
        y.grad_fn.register_prehook(hook)
    elif where == "node hook":
        y.grad_fn.register_hook(hook)
    else:
        x.register_hook(hook)
    await araises_user(KeyError, "'nope'", note, lambda: y.sum().backward())
    assert x.grad is None


# ---- a failing post-accumulate-grad hook puts every .grad back ---------------------------------------------


def _exact(p: ag.Tensor) -> Any:
    """``.grad`` as an object, its bytes and its strides (None when there is none)."""
    g = p.grad
    return None if g is None else (g, g.numpy().tobytes(), g.numpy().strides)


async def test_failing_post_accumulate_hook_puts_back_grads_that_were_none(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    y = ag.tensor([3.0, 4.0], requires_grad=True)
    x.register_post_accumulate_grad_hook(lambda p: 1 / 0)
    note = (
        "raised in a post-accumulate-grad hook on a leaf tensor of shape (2,); every .grad this backward pass "
        "had written was put back as it was"
    )
    await araises_user(ZeroDivisionError, "division by zero", note, lambda: (x * y).sum().backward())
    assert x.grad is None and y.grad is None


@pytest.mark.parametrize("size", [(3, 4), (80, 90)], ids=["inline", "queued"])
async def test_failing_post_accumulate_hook_puts_back_preset_grads_exactly(
    rt: Any, rng: np.random.Generator, size: tuple[int, int]
) -> None:
    # a Fortran-order parameter with a Fortran-order .grad, a C-order one with a C-order .grad (accumulated
    # in place: the same objects, values and strides come back), and one with no .grad yet
    a = ag.from_numpy(np.asfortranarray(rng.standard_normal(size))).requires_grad_()
    b = ag.tensor(rng.standard_normal(size), requires_grad=True)
    c = ag.tensor(rng.standard_normal(size), requires_grad=True)
    a.grad = ag.from_numpy(np.asfortranarray(rng.standard_normal(size)))
    b.grad = ag.tensor(rng.standard_normal(size))
    assert a.grad.numpy().flags.f_contiguous and not a.grad.numpy().flags.c_contiguous
    before = [_exact(p) for p in (a, b, c)]
    ga, gb = a.grad, b.grad
    seen = []

    def zero_it(p: ag.Tensor) -> None:  # runs first: changes .grad in place, then replaces it
        seen.append(p.grad.numpy().copy())
        p.grad.zero_()
        p.grad = ag.ones(size, dtype="float64")

    def fail(p: ag.Tensor) -> None:
        raise ValueError("post says no")

    b.register_post_accumulate_grad_hook(zero_it)
    b.register_post_accumulate_grad_hook(fail)
    loss = (a * b).sum() + (b * c).sum() + (c * 2.0).sum()
    with pytest.raises(ValueError, match="post says no") as info:
        with trio.fail_after(TIMEOUT):
            await loss.backward()
    assert str(info.value) == "post says no"
    assert len(info.value.__notes__) == 1 and "post-accumulate-grad hook" in info.value.__notes__[0]
    # the hook saw the accumulated gradient (the pass did commit before it ran)
    np.testing.assert_array_equal(seen[0], np.frombuffer(before[1][1]).reshape(size) + (a.numpy() + c.numpy()))
    assert a.grad is ga and b.grad is gb and c.grad is None
    for (g0, bytes0, strides0), p in zip(before[:2], (a, b)):
        assert p.grad is g0
        assert p.grad.numpy().tobytes() == bytes0
        assert p.grad.numpy().strides == strides0
    assert np.array_equal(a.grad.numpy(), np.frombuffer(before[0][1]).reshape(size))
    # the same leaves accumulate normally afterwards (into the very same objects)
    with trio.fail_after(TIMEOUT):
        await (a * 3.0).sum().backward()
    assert a.grad is ga
    np.testing.assert_array_equal(a.grad.numpy(), np.frombuffer(before[0][1]).reshape(size) + 3.0)


async def test_failing_post_accumulate_hook_under_create_graph_puts_back_the_old_grad(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    g0 = ag.tensor([7.0, 8.0])
    x.grad = g0
    x.register_post_accumulate_grad_hook(lambda p: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        with trio.fail_after(TIMEOUT):
            await (x * x).sum().backward(create_graph=True)  # out-of-place accumulation
    assert x.grad is g0
    np.testing.assert_array_equal(g0.numpy(), [7.0, 8.0])


@pytest.mark.parametrize("kind", ["post-count", "post-type", "pre-count", "pre-shape"])
async def test_bad_node_hook_result_is_a_backward_error(rt: Any, kind: str) -> None:
    x = t(2, rg=True)
    y = x * 2.0  # MulBackward: two inputs (x and the scalar), one output
    if kind == "post-count":
        y.grad_fn.register_hook(lambda gi, go: (gi[0], None, gi[0]))
    elif kind == "post-type":
        y.grad_fn.register_hook(lambda gi, go: (gi[0].numpy(), None))
    elif kind == "pre-count":
        y.grad_fn.register_prehook(lambda gs: (gs[0], gs[0]))
    else:
        y.grad_fn.register_prehook(lambda gs: (gs[0][:1],))
    with pytest.raises(ag.BackwardError, match="hook"):
        with trio.fail_after(TIMEOUT):
            await y.sum().backward()
    assert x.grad is None
