"""Helpers for the tests of the ported PyTorch layers: torch comparisons and the one gradcheck import.

``gradcheck`` lives in ``tests/gradcheck.py`` today and is moving to ``asyncgrad.autograd.gradcheck``;
this module is the one place that knows where to find it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag

# The new home once the package itself has it (``ag.autograd``, bound by asyncgrad's own __init__). Not
# ``import asyncgrad.autograd``: with the editable install, a submodule this checkout lacks can be found
# in another checkout's tree.
_home = getattr(ag, "autograd", None)
if _home is not None and hasattr(_home, "gradcheck") and hasattr(_home, "gradgradcheck"):
    _gradcheck, _gradgradcheck = _home.gradcheck, _home.gradgradcheck
else:
    from gradcheck import gradcheck as _gradcheck
    from gradcheck import gradgradcheck as _gradgradcheck

RTOL = 1e-10


@pytest.fixture(autouse=True)
def torch_one_thread() -> Any:
    """Torch, the reference, on one thread while a test runs (restored after): its thread pool on a shared
    2-core machine made tiny reference steps take seconds. Autouse in every module that imports it."""
    try:
        import torch
    except ImportError:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)

ATOL = 1e-12


async def gradcheck(fn: Any, inputs: Any, **kw: Any) -> bool:
    """Central-difference gradient check in float64 (see ``tests/gradcheck.py``)."""
    return bool(await _gradcheck(fn, inputs, **kw))


async def gradgradcheck(fn: Any, inputs: Any, **kw: Any) -> bool:
    """Second-derivative check in float64 (see ``tests/gradcheck.py``)."""
    return bool(await _gradgradcheck(fn, inputs, **kw))


def state_from_torch(tmod: Any) -> dict[str, np.ndarray]:
    """A torch module's state dict as numpy arrays (what ``load_state_dict`` takes)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in tmod.state_dict().items()}


def load_from_torch(amod: Any, tmod: Any) -> None:
    """Load ``tmod``'s state into ``amod`` strictly (the keys and shapes must match exactly)."""
    sd = state_from_torch(tmod)
    assert list(amod.state_dict()) == list(sd), (list(amod.state_dict()), list(sd))
    for k, v in amod.state_dict().items():
        assert v.shape == sd[k].shape, (k, v.shape, sd[k].shape)
    amod.load_state_dict(sd, strict=True)


def to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, ag.Tensor):
        return x.numpy()
    return x.detach().cpu().numpy()


def assert_close(got: Any, want: Any, what: str = "", rtol: float = RTOL, atol: float = ATOL) -> None:
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=rtol, atol=atol, err_msg=what)


def assert_grads_match(amod: Any, tmod: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every parameter's ``.grad`` of ``amod`` equals ``tmod``'s (both None, or close)."""
    tp = dict(tmod.named_parameters())
    ap = dict(amod.named_parameters())
    assert list(ap) == list(tp)
    for k, p in tp.items():
        if p.grad is None:
            assert ap[k].grad is None, f"{k}: asyncgrad has a grad, torch has none"
            continue
        assert ap[k].grad is not None, f"{k}: torch has a grad, asyncgrad has none"
        assert_close(ap[k].grad, p.grad, f"grad of {k}", rtol, atol)


def pair(rng: np.random.Generator, shape: tuple[int, ...], torch: Any, requires_grad: bool = True) -> Any:
    """The same float64 values as an asyncgrad leaf and a torch leaf."""
    a = rng.standard_normal(shape)
    return (
        ag.tensor(a, dtype=ag.float64, requires_grad=requires_grad),
        torch.tensor(a, dtype=torch.float64, requires_grad=requires_grad),
    )


class Lib:
    """The names a model written once needs from its library: ``nn``, ``F``, ``optim``, ``tensor``, ...

    The ported programs' models are written once against these, and built for torch and for asyncgrad:
    the same source runs on both, which is what porting with the smallest changes means.
    """

    def __init__(self, which: str) -> None:
        self.which = which
        if which == "torch":
            import torch

            self.nn = torch.nn
            self.F = torch.nn.functional
            self.optim = torch.optim
            self.tensor = torch.tensor
            self.arange = torch.arange
            self.zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64)
            self.clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
        else:
            self.nn = ag.nn
            self.F = ag.nn.functional
            self.optim = ag.optim
            self.tensor = ag.tensor
            self.arange = ag.arange
            self.zeros = lambda *shape: ag.zeros(shape, dtype=ag.float64)
            self.clip_grad_norm_ = ag.nn.utils.clip_grad_norm_

    async def backward(self, loss: Any) -> None:
        if self.which == "torch":
            loss.backward()
        else:
            await loss.backward()


def max_rel_diff(a: list[float], b: list[float]) -> float:
    """``max_i |a_i - b_i| / |b_i|`` over two loss curves of one length."""
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(y), 1e-300) for x, y in zip(a, b))
