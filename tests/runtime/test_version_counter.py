"""PyTorch's version counter: an in-place write to a tensor that a backward node saved makes that backward
raise (naming the node, the tensor's shape and both versions) instead of giving wrong gradients, and leaves
every `.grad` as it was; tensors a backward does not read (add, sum, reshape...) may change freely."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn, optim
from tests._util import set_inline_limit


def _bits(t: ag.Tensor | None) -> bytes | None:
    return None if t is None else t.numpy().tobytes()


@pytest.fixture(params=["inline", "lanes"])
def mode(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "lanes":
        set_inline_limit(monkeypatch, -1)
    return str(request.param)


async def test_version_bumps_on_every_inplace_write(rt: Any) -> None:
    t = ag.tensor([1.0, 2.0], dtype="float64")
    assert t._version == 0
    t.add_(1)
    t.mul_(2)
    t[0] = 5.0
    t += 1
    t.zero_()
    assert t._version == 5
    assert ag.tensor([0.0])._version == 0  # a new tensor starts at 0 (the class default)


async def test_data_setter_does_not_bump(rt: Any) -> None:
    t = ag.tensor([1.0, 2.0], dtype="float64")
    t.data = ag.tensor([3.0, 4.0], dtype="float64")
    assert t._version == 0
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    s = (x * x).sum()
    x.data = ag.tensor([5.0, 6.0], dtype="float64")  # PyTorch: not an in-place op, no error
    await s.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [10.0, 12.0])


async def test_modified_operand_of_mul_raises(rt: Any, mode: str) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    w = ag.tensor([3.0, 4.0], dtype="float64")
    await ((x * 1.0).sum()).backward()  # x.grad = [1, 1]
    before = _bits(x.grad)
    y = (x * w).sum()
    w[0] = 100.0
    with pytest.raises(RuntimeError) as info:
        await y.backward()
    msg = str(info.value)
    assert "MulBackward0" in msg and "modified by an in-place operation" in msg
    assert "input 1" in msg and "shape (2,)" in msg and "is at version 1" in msg and "at version 0" in msg
    assert "clone()" in msg
    assert _bits(x.grad) == before


async def test_modified_input_under_no_grad_raises(rt: Any, mode: str) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    s = (x * x).sum()
    with ag.no_grad():
        x.mul_(0)
    with pytest.raises(RuntimeError, match="MulBackward0"):
        await s.backward()
    assert x.grad is None


async def test_modified_saved_output_raises(rt: Any) -> None:
    x = ag.tensor([0.5, 1.0], dtype="float64", requires_grad=True)
    y = x.exp()  # exp's backward reads its output
    s = y.sum()
    with ag.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match=r"ExpBackward0.*its output"):
        await s.backward()


async def test_create_graph_checks_too(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    w = ag.tensor([3.0, 4.0], dtype="float64")
    y = (x * w).sum()
    w.add_(1)
    with pytest.raises(RuntimeError, match="MulBackward0"):
        await y.backward(create_graph=True)
    assert x.grad is None


async def test_ops_that_save_nothing_allow_inplace(rt: Any, mode: str) -> None:
    x = ag.tensor([[1.0, 2.0], [3.0, 4.0]], dtype="float64", requires_grad=True)
    w = ag.tensor([[1.0, 1.0], [1.0, 1.0]], dtype="float64")
    y = ((x + w) - w).reshape(4)[1:].sum() + x.mean() + ag.stack([x, w]).permute(1, 0, 2).sum()
    w.add_(1)  # add/sub/reshape/getitem/stack/permute/sum/mean read only shapes: fine in PyTorch too
    await y.backward()
    np.testing.assert_allclose(x.grad.numpy(), [[1.25, 2.25], [2.25, 2.25]])


async def test_inplace_on_unrelated_tensor_is_fine(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    w = ag.tensor([3.0, 4.0], dtype="float64")
    other = ag.tensor([3.0, 4.0], dtype="float64")
    y = (x * w).sum()
    other.mul_(7)
    await y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 4.0])


async def test_training_loop_does_not_raise(rt: Any, mode: str) -> None:
    ag.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xb = ag.tensor(np.ones((5, 3), np.float32))
    for _ in range(3):
        opt.zero_grad()
        loss = (model(xb) ** 2).mean()
        await loss.backward()  # the graph is released: the step below cannot reach it
        opt.step()
    assert all(p._version > 0 for p in model.parameters())


async def test_retain_graph_then_step_then_backward_raises(rt: Any) -> None:
    w = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    x = ag.tensor([3.0, 4.0], dtype="float64", requires_grad=True)
    opt = optim.SGD([w], lr=0.1)
    loss = (w * x).sum()
    await loss.backward(retain_graph=True)
    opt.step()
    before_w, before_x = _bits(w.grad), _bits(x.grad)
    with pytest.raises(RuntimeError, match=r"MulBackward0.*input 0.*is at version 1"):
        await loss.backward()
    assert (_bits(w.grad), _bits(x.grad)) == (before_w, before_x)


async def test_grad_accumulation_does_not_trip_later_passes(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    for _ in range(3):
        await (x * x).sum().backward()  # the second and third add into x.grad in place
    np.testing.assert_array_equal(x.grad.numpy(), [6.0, 12.0])


class _Scale(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: ag.Tensor, w: ag.Tensor) -> ag.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: ag.Tensor) -> tuple[ag.Tensor, ag.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, g * x


async def test_function_saved_tensors_are_checked(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    w = ag.tensor([3.0, 4.0], dtype="float64")
    y = _Scale.apply(x, w).sum()
    w.mul_(2)
    with pytest.raises(RuntimeError) as info:
        await y.backward()
    msg = str(info.value)
    assert "_ScaleBackward" in msg and "saved tensor 1" in msg and "is at version 1" in msg
    assert x.grad is None


async def test_function_unmodified_saved_tensors_pass(rt: Any) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    w = ag.tensor([3.0, 4.0], dtype="float64")
    w.add_(1)  # before the forward: saved at version 1
    y = _Scale.apply(x, w).sum()
    await y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 5.0])


# ---- views share their base's version counter (PyTorch) --------------------------------------------------


async def test_write_through_a_view_of_a_saved_tensor_raises(rt: Any, mode: str) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    w = ag.tensor([[3.0, 4.0]], dtype="float64")
    y = (x * w[0]).sum()  # saves the view w[0]
    with ag.no_grad():
        w[0].mul_(2)  # another view of the same memory
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        await y.backward()
    assert x.grad is None


@pytest.mark.parametrize("make_view", ["reshape", "transpose", "slice", "unsqueeze", "expand", "detach", "split"])
async def test_write_to_the_base_of_a_saved_view_raises(rt: Any, mode: str, make_view: str) -> None:
    x = ag.tensor([[1.0, 2.0]], dtype="float64", requires_grad=True)
    w = ag.tensor([[3.0, 4.0]], dtype="float64")
    v = {
        "reshape": lambda: w.reshape(1, 2),
        "transpose": lambda: w.t().t(),
        "slice": lambda: w[:, :],
        "unsqueeze": lambda: w.unsqueeze(0)[0],
        "expand": lambda: w.expand(1, 2),
        "detach": lambda: w.detach(),
        "split": lambda: ag.cat(w.split(1, 1), 1),  # the pieces are views; cat copies them
    }[make_view]()
    y = (x * v).sum()
    w.mul_(2)
    if make_view == "split":  # mul saved the concatenated copy: nothing it reads changed
        await y.backward()
        np.testing.assert_array_equal(x.grad.numpy(), [[3.0, 4.0]])
        return
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        await y.backward()
    assert x.grad is None


async def test_write_through_detach_of_a_saved_tensor_raises(rt: Any, mode: str) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    y = (x * x).sum()
    x.detach().mul_(2)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        await y.backward()


async def test_data_has_a_version_counter_of_its_own(rt: Any, mode: str) -> None:
    # PyTorch's documented difference between .data and .detach(): writes through .data are not tracked
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    y = (x * x).sum()
    x.data.mul_(2)
    await y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 8.0])  # 2x of the new values, as PyTorch gives
    assert x._version == 0


async def test_copies_do_not_share_the_counter(rt: Any, mode: str) -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    w = ag.tensor([3.0, 4.0], dtype="float64")
    y = (x * w).sum()
    w[ag.tensor([0, 1])].mul_(2)  # advanced indexing copies: w is untouched
    (w + 0).mul_(2)
    w.clone().mul_(2)
    await y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 4.0])
    assert w._version == 0


async def test_an_int_index_is_a_view(rt: Any, mode: str) -> None:
    w = ag.tensor([[3.0, 4.0]], dtype="float64")
    e = w[0, 1]
    assert e.shape == ()
    e.add_(1)
    np.testing.assert_array_equal(w.numpy(), [[3.0, 5.0]])
    assert w._version == e._version == 1


# ---- a queued write to memory that views share: every view waits for it ----------------------------------


async def test_a_queued_write_to_a_base_is_seen_through_its_views_and_back() -> None:
    import threading

    import trio

    async with ag.open_runtime(lanes=1):
        with trio.fail_after(20):
            a = ag.zeros(8, dtype="float64")
            v, w = a[:3], a.reshape(2, 4)
            await v.ready()
            gate = threading.Event()
            ag.current_stream("cpu").submit(lambda: gate.wait(20))  # hold the lane: the write queues
            a.add_(1.0)
            assert not v.is_ready() and not w.is_ready()  # pending on the write, not "ready" on stale memory
            doubled = v * 2  # three elements: would run inline on ready inputs, queues behind the write instead
            v.add_(10.0)  # a write through a view makes its base pending too
            assert not a.is_ready()
            gate.set()
            assert (await v.ready()).tolist() == [11.0, 11.0, 11.0]
            assert (await doubled.ready()).tolist() == [2.0, 2.0, 2.0]
            assert (await a.ready()).tolist() == [11.0, 11.0, 11.0, 1.0, 1.0, 1.0, 1.0, 1.0]
            assert (await w.ready()).numpy()[1].tolist() == [1.0] * 4
            assert a._version == v._version == w._version == 2
