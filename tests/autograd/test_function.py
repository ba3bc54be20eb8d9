"""Custom `Function`s (``autograd/_function.py``): plain and async backward, constants and
``needs_input_grad``, forward not recorded, no grad inputs records nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import trio

import asyncgrad as ag
from tests._util import leaf

TIMEOUT = 20


# ---- Function ----------------------------------------------------------------------------------------------


class MulAdd(ag.Function):
    """out = a * b + c, with a plain backward."""

    @staticmethod
    def forward(ctx: Any, a: ag.Tensor, b: ag.Tensor, c: ag.Tensor) -> ag.Tensor:
        ctx.save_for_backward(a, b)
        return a * b + c

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> tuple[Any, ...]:
        a, b = ctx.saved_tensors
        return g * b, g * a, g


class AsyncSquare(ag.Function):
    """out = x ** 2, with an async backward that itself awaits a gradient (a reentrant pass)."""

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    async def backward(ctx: Any, g: ag.Tensor) -> ag.Tensor:
        (x,) = ctx.saved_tensors
        with ag.enable_grad():
            xx = x.detach().requires_grad_()
            (d,) = await ag.grad((xx * xx).sum(), [xx])
        return g * d


class Scale(ag.Function):
    """out = x * k + y with a non-tensor argument k; records ctx.needs_input_grad where it is read."""

    seen: ClassVar[dict[str, Any]] = {}

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor, k: float, y: ag.Tensor) -> ag.Tensor:
        ctx.k = k
        Scale.seen["forward"] = tuple(ctx.needs_input_grad)
        return x * k + y

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> tuple[Any, ...]:
        Scale.seen["backward"] = tuple(ctx.needs_input_grad)
        return g * ctx.k, None, None


async def test_function_plain_backward(rt: Any) -> None:
    a, b, c = leaf([1.0, 2.0]), leaf([3.0, 4.0]), leaf([5.0, 6.0])
    out = MulAdd.apply(a, b, c)
    np.testing.assert_array_equal(out.numpy(), [8.0, 14.0])
    assert out.requires_grad and not out.is_leaf
    assert out.grad_fn.name() == "MulAddBackward"
    with trio.fail_after(TIMEOUT):
        await (out * 2.0).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), [6.0, 8.0])
    np.testing.assert_array_equal(b.grad.numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(c.grad.numpy(), [2.0, 2.0])


async def test_function_async_backward(rt: Any) -> None:
    x = leaf([1.0, -2.0, 3.0])
    y = AsyncSquare.apply(x)
    with trio.fail_after(TIMEOUT):
        await (y * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [6.0, -12.0, 18.0])


async def test_function_with_constants_and_needs_input_grad(rt: Any) -> None:
    Scale.seen = {}
    x = leaf([1.0, 2.0])
    y = ag.tensor(np.array([1.0, 1.0]))
    out = Scale.apply(x, 3.0, y)
    with trio.fail_after(TIMEOUT):
        await out.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0])
    assert Scale.seen["backward"] == (True, False, False)


async def test_function_needs_input_grad_in_forward(rt: Any) -> None:
    Scale.seen = {}
    Scale.apply(leaf([1.0, 2.0]), 3.0, ag.tensor(np.array([1.0, 1.0])))
    assert Scale.seen["forward"] == (True, False, False)


async def test_function_forward_is_not_recorded(rt: Any) -> None:
    class Inner(ag.Function):
        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            out = x * 2.0
            seen["inner_rg"] = out.requires_grad
            return out

        @staticmethod
        def backward(ctx: Any, g: ag.Tensor) -> ag.Tensor:
            return g * 2.0

    seen: dict[str, Any] = {}
    x = leaf([1.0])
    y = Inner.apply(x)
    assert seen["inner_rg"] is False
    assert y.grad_fn.name() == "InnerBackward"


async def test_function_without_grad_inputs_records_nothing(rt: Any) -> None:
    out = MulAdd.apply(ag.tensor(np.ones(2)), ag.tensor(np.ones(2)), ag.tensor(np.ones(2)))
    assert not out.requires_grad and out.grad_fn is None
