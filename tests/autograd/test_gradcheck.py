"""The checker itself (``autograd/_gradcheck.py``): `gradcheck` / `gradgradcheck` pass on right gradients,
raise `GradcheckError` naming the wrong input on a custom Function with a wrong backward, return False
instead with ``raise_exception=False``, and refuse inputs they cannot differentiate."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.autograd import GradcheckError, gradcheck, gradgradcheck
from tests._util import channels_last

TIMEOUT = 20


class MulAdd(ag.Function):
    """out = a * b + c: a right backward."""

    @staticmethod
    def forward(ctx: Any, a: ag.Tensor, b: ag.Tensor, c: ag.Tensor) -> ag.Tensor:
        ctx.save_for_backward(a, b)
        return a * b + c

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> tuple[Any, ...]:
        a, b = ctx.saved_tensors
        return g * b, g * a, g


class MulAddWrongB(ag.Function):
    """out = a * b + c, but b's gradient is off by a factor 1.01 (a and c are right)."""

    @staticmethod
    def forward(ctx: Any, a: ag.Tensor, b: ag.Tensor, c: ag.Tensor) -> ag.Tensor:
        ctx.save_for_backward(a, b)
        return a * b + c

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> tuple[Any, ...]:
        a, b = ctx.saved_tensors
        return g * b, g * a * 1.01, g


class Cube(ag.Function):
    """out = x ** 3 with the recorded backward 3 x^2 g: right to first and second order."""

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        return (g * x * x * 3.0,)


class CubeWrongSecond(ag.Function):
    """out = x ** 3 with a first derivative that is right in value but recorded as 2 x * x.detach() * 1.5 g:
    its derivative w.r.t. x is 3 x g instead of 6 x g, so only the second-order check can see it."""

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        return (g * x * x.detach() * 3.0,)


def _inputs(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((4,))]


async def test_gradcheck_passes_on_right_gradients(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(TIMEOUT):
        assert await gradcheck(MulAdd.apply, _inputs(rng)) is True
        assert await gradcheck(lambda a, b: ag.tanh(a @ b), [rng.standard_normal((2, 3)), rng.standard_normal((3, 2))])
        # a tensor that requires grad is checked as well; one that does not is passed through as a constant
        c = ag.tensor(rng.standard_normal(4))
        assert await gradcheck(
            MulAdd.apply, [ag.tensor(rng.standard_normal((3, 4)), requires_grad=True), rng.standard_normal((3, 4)), c]
        )


async def test_gradcheck_names_the_wrong_input(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(TIMEOUT):
        with pytest.raises(GradcheckError, match=r"gradcheck: analytic and numerical gradients of input 1 differ"):
            await gradcheck(MulAddWrongB.apply, _inputs(rng))
        # with a and c passed as constants, b is still input 1 of func (the position among its arguments)
        a, c = ag.tensor(rng.standard_normal((3, 4))), ag.tensor(rng.standard_normal(4))
        with pytest.raises(GradcheckError, match=r"gradients of input 1 differ"):
            await gradcheck(MulAddWrongB.apply, [a, rng.standard_normal((3, 4)), c])
        # the same function passes when only the right inputs are checked
        assert await gradcheck(MulAddWrongB.apply, [rng.standard_normal((3, 4)), ag.tensor(np.ones((3, 4))), c])


async def test_gradcheck_raise_exception_false_returns_false(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(TIMEOUT):
        assert await gradcheck(MulAddWrongB.apply, _inputs(rng), raise_exception=False) is False
        assert await gradcheck(MulAdd.apply, _inputs(rng), raise_exception=False) is True


async def test_gradcheck_tolerances_are_the_ones_passed(rt: Any, rng: np.random.Generator) -> None:
    """A 1% error passes at rtol=0.05 and fails at PyTorch's default rtol=1e-3."""
    with trio.fail_after(TIMEOUT):
        ins = [rng.uniform(1, 2, (2, 3)), rng.uniform(1, 2, (2, 3)), rng.uniform(1, 2, 3)]
        assert await gradcheck(MulAddWrongB.apply, ins, rtol=0.05, atol=0.0)
        assert not await gradcheck(MulAddWrongB.apply, ins, raise_exception=False)


async def test_gradgradcheck_passes_and_catches_a_wrong_second_derivative(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(TIMEOUT):
        x = rng.standard_normal((2, 3))
        assert await gradgradcheck(Cube.apply, [x]) is True
        assert await gradgradcheck(Cube.apply, [x], directions=3) is True
        assert await gradcheck(CubeWrongSecond.apply, [x])  # right to first order
        with pytest.raises(GradcheckError, match=r"gradgradcheck: analytic and numerical gradients of input 0"):
            await gradgradcheck(CubeWrongSecond.apply, [x])
        with pytest.raises(GradcheckError, match=r"gradgradcheck: the second derivative along random direction 0"):
            await gradgradcheck(CubeWrongSecond.apply, [x], directions=2)


async def test_gradgradcheck_raise_exception_false_returns_false(rt: Any, rng: np.random.Generator) -> None:
    with trio.fail_after(TIMEOUT):
        x = rng.standard_normal((2, 3))
        assert await gradgradcheck(CubeWrongSecond.apply, [x], raise_exception=False) is False
        assert await gradgradcheck(CubeWrongSecond.apply, [x], directions=2, raise_exception=False) is False
        assert await gradgradcheck(Cube.apply, [x], raise_exception=False) is True


async def test_inputs_keep_their_layout(rt: Any, rng: np.random.Generator) -> None:
    """A channels-last input reaches func channels-last (the checker copies with order="K")."""
    seen: list[tuple[int, ...]] = []
    x = channels_last(rng.standard_normal((1, 3, 2, 2)))

    def f(t: ag.Tensor) -> ag.Tensor:
        seen.append(tuple(t.stride()))
        return t * t

    with trio.fail_after(TIMEOUT):
        assert await gradcheck(f, [x])
    want = tuple(s // x.itemsize for s in x.strides)
    assert want[1] == 1  # channels innermost
    assert seen and all(s == want for s in seen), (seen, want)


async def test_refuses_inputs_it_cannot_differentiate(rt: Any) -> None:
    with trio.fail_after(TIMEOUT):
        with pytest.raises(TypeError, match="input 0 has dtype int64; differentiated inputs must be floating point"):
            await gradcheck(lambda a: a * 2, [np.arange(3)])
        with pytest.raises(ValueError, match="no input to differentiate"):
            await gradcheck(lambda a: a * 2, [ag.tensor([1.0, 2.0])])
