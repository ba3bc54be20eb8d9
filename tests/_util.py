"""Helpers shared by the tests: the inline-limit switch and the torch-comparison helpers of the ports.

Fixtures live in ``tests/conftest.py``; this module holds plain functions (and the one autouse fixture,
``torch_one_thread``, that a module opts into by importing it). Gradient checks are
``ag.autograd.gradcheck`` / ``ag.autograd.gradgradcheck``, called directly by the tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad.devices import KernelError

RTOL = 1e-10
ATOL = 1e-12


def set_inline_limit(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """Set the inline fast-path threshold everywhere it was imported.

    ``limit=-1`` sends every kernel (forward, backward rule, in-place) to the worker lanes; a huge limit
    runs every kernel inline on the calling thread.
    """
    for name, mod in list(sys.modules.items()):
        if name.startswith("asyncgrad") and hasattr(mod, "INLINE_MAX_ELEMENTS"):
            monkeypatch.setattr(mod, "INLINE_MAX_ELEMENTS", limit)
        # and the bound while several tasks share a device (read when the count of streams taken changes)
        if name.startswith("asyncgrad") and hasattr(mod, "SHARED_INLINE_MAX_ELEMENTS"):
            monkeypatch.setattr(mod, "SHARED_INLINE_MAX_ELEMENTS", max(limit, 0))


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


def state_from_torch(tmod: Any) -> dict[str, np.ndarray]:
    """A torch module's state dict as numpy arrays (what ``load_state_dict`` takes)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in tmod.state_dict().items()}


def load_state(amod: Any, sd: dict[str, np.ndarray]) -> None:
    """Load a (recorded) torch state dict into ``amod`` strictly: the keys, order and shapes must match."""
    assert list(amod.state_dict()) == list(sd), (list(amod.state_dict()), list(sd))
    for k, v in amod.state_dict().items():
        assert v.shape == sd[k].shape, (k, v.shape, sd[k].shape)
    amod.load_state_dict(sd, strict=True)


def load_from_torch(amod: Any, tmod: Any) -> None:
    """Load ``tmod``'s state into ``amod`` strictly (the keys and shapes must match exactly)."""
    load_state(amod, state_from_torch(tmod))


def grads_of(tmod: Any) -> dict[str, np.ndarray | None]:
    """A torch module's parameter gradients by name (None where it has none): a recordable value."""
    return {k: None if p.grad is None else p.grad.detach().cpu().numpy().copy() for k, p in tmod.named_parameters()}


def assert_grads_equal(amod: Any, grads: dict[str, np.ndarray | None], rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every parameter's ``.grad`` of ``amod`` equals ``grads[name]`` (see ``grads_of``): both None, or close."""
    ap = dict(amod.named_parameters())
    assert list(ap) == list(grads)
    for k, g in grads.items():
        if g is None:
            assert ap[k].grad is None, f"{k}: asyncgrad has a grad, torch has none"
            continue
        assert ap[k].grad is not None, f"{k}: torch has a grad, asyncgrad has none"
        assert_close(ap[k].grad, g, f"grad of {k}", rtol, atol)


def to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, ag.Tensor):
        return x.numpy()
    if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
        return np.asarray(x)
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

    # one attribute holds torch's or asyncgrad's object: typed Any, as nothing else fits both
    nn: Any
    F: Any
    optim: Any
    tensor: Any
    arange: Any
    zeros: Any
    clip_grad_norm_: Any

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


def leaf(values: Any) -> ag.Tensor:
    """A float64 leaf that requires grad."""
    return ag.tensor(np.asarray(values, dtype=np.float64), requires_grad=True)


# ---- the op tests' helpers (tests/ops/) ------------------------------------------------------------

Fn = Callable[..., Any]

# a bad index raises IndexError from a kernel run inline, or KernelError (naming it) from one run on a lane
INDEX_ERRORS = (IndexError, KernelError)


def t(a: Any, **kw: Any) -> ag.Tensor:
    return ag.tensor(np.asarray(a), **kw)


def arr(x: ag.Tensor) -> np.ndarray:
    return x.numpy()


def output_weights(shape: tuple[int, ...], seed: int = 7) -> np.ndarray:
    """The fixed random weighting ``W`` of a non-scalar output: tests differentiate ``(out * W).sum()``."""
    return np.random.default_rng(seed).standard_normal(shape)


def channels_last(a: np.ndarray) -> np.ndarray:
    """The same values as ``a`` (N, C, H, W), stored NHWC: a permuted-stride view."""
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


async def vs_torch(torch_ref: Any, key: str, ag_fn: Fn, torch_fn: Fn, *inputs: np.ndarray,
                   atol: float = 1e-10) -> None:
    """Values and gradients (for a random output weighting) against PyTorch's (``torch_ref``), in float64.

    ``torch_fn(torch, *tensors)`` gets the torch module and the inputs as float64 torch leaves; the torch
    side runs live or comes from the recording under ``key`` (see ``tests/_reference.py``).
    """

    def reference(torch: Any) -> Any:
        tl = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inputs]
        tout = torch_fn(torch, *tl)
        w = torch.tensor(output_weights(tuple(tout.shape)))
        tg = torch.autograd.grad((tout * w).sum(), tl, allow_unused=True)
        return tout.detach(), list(tg)

    tout, tg = torch_ref(key, reference, inputs=list(inputs))
    leaves = [ag.tensor(a, dtype=np.float64, requires_grad=True) for a in inputs]
    out = ag_fn(*leaves)
    np.testing.assert_allclose(out.numpy(), tout, atol=atol, rtol=1e-9)
    w = output_weights(out.shape)
    grads = await ag.grad((out * ag.tensor(w)).sum(), leaves, allow_unused=True)
    for i, (g, t) in enumerate(zip(grads, tg)):
        gv = np.zeros(inputs[i].shape) if g is None else g.numpy()
        tv = np.zeros(inputs[i].shape) if t is None else t
        np.testing.assert_allclose(gv, tv, atol=atol, rtol=1e-8, err_msg=f"gradient of input {i}")


def torch_or_skip() -> Any:
    """The torch module, or skip the calling test where it is not installed."""
    return pytest.importorskip("torch")


def torch_pair(a: np.ndarray, rg: bool = False) -> tuple[ag.Tensor, Any]:
    """The same float64 values as an asyncgrad tensor and a torch tensor (torch must be installed)."""
    import torch

    return ag.tensor(a, dtype=ag.float64, requires_grad=rg), torch.tensor(a, dtype=torch.float64, requires_grad=rg)
