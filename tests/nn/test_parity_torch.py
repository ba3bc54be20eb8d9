"""Parity with PyTorch: the same models from the same weights and data, trained the same way, in float64.

The MLP and the small CNN are trained 20 steps with SGD (momentum) and 20 steps with Adam by asyncgrad
and by PyTorch; every step's loss must agree to 1e-6 relative. The torch side runs in ``torch_ref``
functions: live where torch is installed (CI installs the CPU build ``torch==2.13.0`` through the
``compare`` extra), recorded under ``tests/references/`` otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn, optim
from asyncgrad.nn import functional as F
from tests._util import state_from_torch

STEPS = 20
RTOL = 1e-6
OPTIMIZER_KW = {
    "sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
    "adam": {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8},
}


def _ag_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 32, dtype=np.float64),
        nn.Tanh(),
        nn.Linear(32, 16, dtype=np.float64),
        nn.GELU(),
        nn.Linear(16, 5, dtype=np.float64),
    )


def _torch_mlp(torch):
    tn = torch.nn
    return tn.Sequential(
        tn.Linear(20, 32), tn.Tanh(), tn.Linear(32, 16), tn.GELU(), tn.Linear(16, 5)
    ).double()


def _ag_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, dtype=np.float64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, dtype=np.float64),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 2 * 2, 5, dtype=np.float64),
    )


def _torch_cnn(torch):
    tn = torch.nn
    return tn.Sequential(
        tn.Conv2d(1, 4, 3, padding=1),
        tn.ReLU(),
        tn.MaxPool2d(2),
        tn.Conv2d(4, 8, 3),
        tn.ReLU(),
        tn.Flatten(),
        tn.Linear(8 * 2 * 2, 5),
    ).double()


def _data(kind: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (32, 20) if kind == "mlp" else (16, 1, 8, 8)
    return rng.standard_normal(shape), rng.integers(0, 5, shape[0])


def _ag_optimizer(name: str, params):
    return (optim.SGD if name == "sgd" else optim.Adam)(params, **OPTIMIZER_KW[name])


def _torch_optimizer(torch, name: str, params):
    return (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(params, **OPTIMIZER_KW[name])


async def _parity(torch_ref, kind: str, opt_name: str) -> None:
    x, y = _data(kind)
    async with ag.open_runtime():
        ag.manual_seed(0)
        model = _ag_mlp() if kind == "mlp" else _ag_cnn()
        # identical initial weights: asyncgrad's (PyTorch-style) init copied into the torch model
        init = {k: v.numpy().copy() for k, v in model.state_dict().items()}

        def reference(torch):
            tmodel = _torch_mlp(torch) if kind == "mlp" else _torch_cnn(torch)
            tmodel.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
            topt = _torch_optimizer(torch, opt_name, tmodel.parameters())
            xt, yt = torch.from_numpy(x), torch.from_numpy(y)
            tlosses = []
            for _ in range(STEPS):
                tloss = torch.nn.functional.cross_entropy(tmodel(xt), yt)
                topt.zero_grad()
                tloss.backward()
                topt.step()
                tlosses.append(tloss.item())
            return {"losses": tlosses, "final": state_from_torch(tmodel)}

        want = torch_ref("train", reference, init=init, x=x, y=y)
        opt = _ag_optimizer(opt_name, model.parameters())
        losses = []
        for _ in range(STEPS):
            loss = F.cross_entropy(model(ag.tensor(x, dtype=np.float64)), y)
            await loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        final = model.state_dict()
    np.testing.assert_allclose(losses, want["losses"], rtol=RTOL, atol=0)
    assert losses[-1] < losses[0]  # it did train
    for k, v in want["final"].items():
        np.testing.assert_allclose(final[k], v, rtol=1e-5, atol=1e-9, err_msg=k)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
async def test_mlp_parity_with_torch(torch_ref, opt_name: str) -> None:
    await _parity(torch_ref, "mlp", opt_name)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
async def test_cnn_parity_with_torch(torch_ref, opt_name: str) -> None:
    await _parity(torch_ref, "cnn", opt_name)


# ---- state_dict values ---------------------------------------------------------------------------------------


class _TorchValue:
    """A torch state dict's value as asyncgrad's ``load_state_dict`` meets it: ``detach()``, ``cpu()`` and
    ``numpy()``, where ``numpy()`` refuses while the value requires grad (a parameter from
    ``state_dict(keep_vars=True)``), as torch's does. It holds torch's (recorded) values and flags."""

    def __init__(self, a: np.ndarray, requires_grad: bool = False) -> None:
        self._a, self.requires_grad = a, requires_grad

    def detach(self) -> _TorchValue:
        return _TorchValue(self._a)

    def cpu(self) -> _TorchValue:
        return self

    def numpy(self) -> np.ndarray:
        if self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return self._a


def _sequential(lib):
    return lib.nn.Sequential(lib.nn.Linear(3, 4), lib.nn.BatchNorm1d(4))


def _flat(sd):
    """A state dict as ``name -> (values raveled, shape)``: ``torch_ref`` records a 0-d array (BatchNorm's
    ``num_batches_tracked``) as shape (1,) (``np.ascontiguousarray`` in ``tests/_reference.py``), so the
    shapes travel beside the values; `_unflat` undoes it."""
    return {k: (np.asarray(v).reshape(-1), tuple(np.shape(v))) for k, v in sd.items()}


def _unflat(flat):
    return {k: a.reshape(shape) for k, (a, shape) in flat.items()}


async def test_state_dict_values_behave_as_torch(rt: ag.Runtime, torch_ref) -> None:
    def reference(torch):
        tm = _sequential(torch)
        tsd, kept = tm.state_dict(), tm.state_dict(keep_vars=True)
        return {
            "state": _flat(state_from_torch(tm)),
            "sizes": [tuple(v.size()) for v in tsd.values()],
            "dims": [v.dim() for v in tsd.values()],
            "requires_grad": [v.requires_grad for v in kept.values()],
        }

    want = torch_ref("torch_state", reference)
    tsd = _unflat(want["state"])
    m = _sequential(ag)
    sd = m.state_dict()
    assert list(sd) == list(tsd)
    assert len(want["sizes"]) == len(want["dims"]) == len(sd)
    for k, size, dim in zip(sd, want["sizes"], want["dims"]):
        v = sd[k]
        assert isinstance(v, ag.Tensor) and not v.requires_grad and v.is_leaf
        assert tuple(v.size()) == size and v.dim() == dim
        c = v.clone()
        assert c is not v and c.shape == v.shape
    w0 = sd["0.weight"].numpy().copy()
    with ag.no_grad():
        m[0].weight.add_(1.0)  # a copy: later updates do not show through
    np.testing.assert_array_equal(sd["0.weight"].numpy(), w0)
    # torch-format state dicts load: plain values, and parameters that require grad (keep_vars=True)
    m.load_state_dict({k: _TorchValue(v) for k, v in tsd.items()})
    m.load_state_dict({k: _TorchValue(v, rg) for (k, v), rg in zip(tsd.items(), want["requires_grad"], strict=True)})
    np.testing.assert_array_equal(m[0].weight.numpy(), tsd["0.weight"])
    torch = torch_ref.torch
    if torch is not None:  # live only: torch's own tensors (what _TorchValue stands in for) load as well
        m.load_state_dict({k: torch.from_numpy(v) for k, v in tsd.items()})
        m.load_state_dict({k: torch.nn.Parameter(torch.from_numpy(v), requires_grad=rg)
                           for (k, v), rg in zip(tsd.items(), want["requires_grad"])})
        np.testing.assert_array_equal(m[0].weight.numpy(), tsd["0.weight"])
    # and our values load into torch
    ours = {k: v.numpy().copy() for k, v in m.state_dict().items()}

    def load_into_torch(torch):
        tm = _sequential(torch)
        tm.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in _unflat(flat_ours).items()})
        return _flat(state_from_torch(tm))

    flat_ours = _flat(ours)
    loaded = _unflat(torch_ref("load_into_torch", load_into_torch, ours=flat_ours))
    assert list(loaded) == list(ours)
    for k, v in ours.items():
        assert loaded[k].shape == v.shape, k
        np.testing.assert_array_equal(loaded[k], v, err_msg=k)
    # channels-last parameter layouts survive state_dict
    conv = nn.Conv2d(2, 3, 3)
    with ag.no_grad():
        cl = ag.tensor(np.ascontiguousarray(conv.weight.numpy().transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2))
    conv.weight = nn.Parameter(cl)
    assert conv.state_dict()["weight"].stride() == cl.stride()
