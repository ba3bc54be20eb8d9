"""What a recorded node keeps, now that the per-node paths read fields directly (issue 21): ops whose rule
reads only their output record no input version (PyTorch saves only the result of exp, tanh, sigmoid and
sqrt), a shape-only node released to stand-ins still runs backward again and still lists its inputs, and the
saved-version check still fires on the paths that skip it when nothing was saved. Values against torch
(``torch_ref``: live, or recorded under ``tests/references/``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from tests._util import set_inline_limit


@pytest.fixture(params=["inline", "lanes"])
def mode(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "lanes":
        set_inline_limit(monkeypatch, -1)
    return str(request.param)


X = [0.25, 0.5, 1.5]


@pytest.mark.parametrize("name", ["exp", "tanh", "sigmoid", "sqrt"])
async def test_output_only_rules_allow_inplace_on_the_input(rt: Any, mode: str, name: str, torch_ref) -> None:
    with trio.fail_after(20):
        x = ag.tensor(X, dtype="float64", requires_grad=True)
        p = x * 2.0
        y = getattr(ag, name)(p)
        s = (y * y).sum()
        assert y.grad_fn.ver == 0  # no input version recorded
        with ag.no_grad():
            p.add_(0.5)  # the op's input, which its backward does not read
        await s.backward()
        await x.grad.ready()

        # the reference: torch, whose same op saves only its result (the same in-place write is fine there)
        def reference(torch: Any) -> Any:
            tx = torch.tensor(X, dtype=torch.float64, requires_grad=True)
            tp = tx * 2.0
            ty = getattr(torch, name)(tp)
            with torch.no_grad():
                tp.add_(0.5)
            (ty * ty).sum().backward()
            return tx.grad

        want = torch_ref("grad", reference, x=X, name=name)
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("name", ["exp", "tanh", "sigmoid", "sqrt"])
async def test_output_only_rules_still_check_their_output(rt: Any, mode: str, name: str) -> None:
    with trio.fail_after(20):
        x = ag.tensor(X, dtype="float64", requires_grad=True)
        y = getattr(ag, name)(x)
        s = y.sum()
        with ag.no_grad():
            y.add_(1)
        with pytest.raises(RuntimeError, match=r"Backward0.*its output"):
            await s.backward()
        assert x.grad is None


async def test_released_shape_only_nodes_run_again_and_list_inputs(rt: Any, mode: str) -> None:
    with trio.fail_after(20):
        x = ag.tensor(X, dtype="float64", requires_grad=True)
        b = ag.tensor(X, dtype="float64", requires_grad=True)
        y = (x + 2.0) - b  # add, sub: rules read only shapes, so release keeps shape stand-ins
        s = y.sum()
        before = [(type(n).__name__ if n is not None else None, nr) for n, nr in y.grad_fn.next_functions]
        await s.backward()
        after = [(type(n).__name__ if n is not None else None, nr) for n, nr in y.grad_fn.next_functions]
        assert before == after and len(after) == 2
        y.grad_fn.release()  # a second release of stand-ins leaves them as they are
        await s.backward()  # a second pass through the released graph (as PyTorch allows for these ops)
        await x.grad.ready()
        await b.grad.ready()
        np.testing.assert_array_equal(x.grad.numpy(), [2.0, 2.0, 2.0])
        np.testing.assert_array_equal(b.grad.numpy(), [-2.0, -2.0, -2.0])


async def test_versions_recorded_on_the_fast_paths(rt: Any, mode: str) -> None:
    with trio.fail_after(20):
        x = ag.tensor(X, dtype="float64", requires_grad=True)
        w = ag.tensor(X, dtype="float64")
        with ag.no_grad():
            w.add_(1)  # version 1 before it is saved
        y = (x * w).sum() + (x * 2.0).sum() + ag.log(x).sum()
        await y.backward()  # saved at version 1, still 1: no error
        await x.grad.ready()
        np.testing.assert_allclose(x.grad.numpy(), np.array(X) + 1 + 2 + 1 / np.array(X), rtol=1e-12)
        z = (x * w).sum()
        with ag.no_grad():
            w.add_(1)
        with pytest.raises(RuntimeError, match=r"MulBackward0.*input 1.*is at version 2 but was at version 1"):
            await z.backward()
