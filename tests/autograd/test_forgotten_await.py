"""A ``loss.backward()`` without ``await``: reported as `ForgottenAwaitWarning` naming the line that made it.

Reported at the next ``backward()`` (the next training step) or at the loop's next scheduling point,
whichever comes first; an awaited pass is never reported.
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import trio

import asyncgrad as ag


def grad_of(t: ag.Tensor) -> ag.Tensor:
    g = t.grad
    assert g is not None, "no gradient"
    return g


def forgotten(rec: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in rec if issubclass(w.category, ag.ForgottenAwaitWarning)]


def here() -> int:
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


async def test_reported_at_the_next_backward_with_its_line(rt) -> None:
    with trio.fail_after(30):
        w = ag.tensor(np.arange(4.0), requires_grad=True)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            line = here() + 1
            (w * w).sum().backward()  # forgotten: no await, and no scheduling point before the next backward
            assert w.grad is None
            assert forgotten(rec) == []  # nothing yet: it may still be awaited
            await (w * 3).sum().backward()  # the next backward reports the earlier one first
        ws = forgotten(rec)
        assert len(ws) == 1, [str(x.message) for x in rec]
        msg = str(ws[0].message)
        assert f"{__file__}:{line}" in msg and "await loss.backward()" in msg and "never awaited" in msg
        assert (ws[0].filename, ws[0].lineno) == (__file__, line)
        # only the awaited pass ran
        np.testing.assert_array_equal(grad_of(w).numpy(), [3.0, 3.0, 3.0, 3.0])


async def test_reported_at_the_next_scheduling_point(rt) -> None:
    with trio.fail_after(30):
        w = ag.tensor(np.ones(3), requires_grad=True)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            line = here() + 1
            w.sum().backward()
            # the loop's next pass runs its queued callbacks (after an I/O poll): the check runs
            await trio.sleep(0.01)
            ws = forgotten(rec)
        assert len(ws) == 1 and ws[0].lineno == line
        assert w.grad is None


async def test_awaited_passes_are_not_reported(rt) -> None:
    with trio.fail_after(30):
        w = ag.tensor(np.ones(3), requires_grad=True)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for _ in range(3):
                await (w * 2).sum().backward()
            p = (w * 2).sum().backward()  # kept, awaited before the task yields
            await p
            await trio.sleep(0.01)
        assert forgotten(rec) == []
        np.testing.assert_array_equal(grad_of(w).numpy(), [8.0, 8.0, 8.0])


async def test_reported_once_per_site_in_a_loop(rt) -> None:
    with trio.fail_after(30):
        w = ag.tensor(np.ones(2), requires_grad=True)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for _ in range(5):
                (w * w).sum().backward()
            await trio.sleep(0.01)
        assert len(forgotten(rec)) == 1
        assert w.grad is None


async def test_as_an_error_with_the_warning_filter(rt) -> None:
    with trio.fail_after(30):
        w = ag.tensor(np.ones(2), requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ag.ForgottenAwaitWarning)
            w.sum().backward()
            try:
                w.sum().backward()  # the next backward raises it
            except ag.ForgottenAwaitWarning as e:
                assert "never awaited" in str(e)
            else:
                raise AssertionError("no error raised for the forgotten await")
