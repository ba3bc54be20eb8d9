"""Parity with PyTorch: the same models from the same weights and data, trained the same way, in float64.

The MLP and the small CNN are trained 20 steps with SGD (momentum) and 20 steps with Adam by asyncgrad
and by PyTorch; every step's loss must agree to 1e-6 relative. Skipped when torch is not installed (CI
installs the CPU build ``torch==2.13.0`` through the ``compare`` extra).
"""

from __future__ import annotations

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn, optim
from asyncgrad.nn import functional as F

torch = pytest.importorskip("torch")

STEPS = 20
RTOL = 1e-6


def _ag_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 32, dtype=np.float64),
        nn.Tanh(),
        nn.Linear(32, 16, dtype=np.float64),
        nn.GELU(),
        nn.Linear(16, 5, dtype=np.float64),
    )


def _torch_mlp() -> torch.nn.Module:
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


def _torch_cnn() -> torch.nn.Module:
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


def _optimizers(name: str, ag_params, torch_params):
    if name == "sgd":
        kw = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}
        return optim.SGD(ag_params, **kw), torch.optim.SGD(torch_params, **kw)
    kw = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8}
    return optim.Adam(ag_params, **kw), torch.optim.Adam(torch_params, **kw)


async def _parity(kind: str, opt_name: str) -> None:
    x, y = _data(kind)
    async with ag.open_runtime():
        ag.manual_seed(0)
        model = _ag_mlp() if kind == "mlp" else _ag_cnn()
        tmodel = _torch_mlp() if kind == "mlp" else _torch_cnn()
        # identical initial weights: asyncgrad's (PyTorch-style) init copied into the torch model
        tmodel.load_state_dict({k: torch.from_numpy(v.numpy()) for k, v in model.state_dict().items()})
        opt, topt = _optimizers(opt_name, model.parameters(), tmodel.parameters())
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        losses, tlosses = [], []
        for _ in range(STEPS):
            loss = F.cross_entropy(model(ag.tensor(x, dtype=np.float64)), y)
            await loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())

            tloss = torch.nn.functional.cross_entropy(tmodel(xt), yt)
            topt.zero_grad()
            tloss.backward()
            topt.step()
            tlosses.append(tloss.item())
        final = model.state_dict()
    np.testing.assert_allclose(losses, tlosses, rtol=RTOL, atol=0)
    assert losses[-1] < losses[0]  # it did train
    for k, v in tmodel.state_dict().items():
        np.testing.assert_allclose(final[k], v.numpy(), rtol=1e-5, atol=1e-9, err_msg=k)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
async def test_mlp_parity_with_torch(opt_name: str) -> None:
    await _parity("mlp", opt_name)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
async def test_cnn_parity_with_torch(opt_name: str) -> None:
    await _parity("cnn", opt_name)


# ---- state_dict values ---------------------------------------------------------------------------------------


async def test_state_dict_values_behave_as_torch(rt: ag.Runtime) -> None:
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    tm = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sd, tsd = m.state_dict(), tm.state_dict()
    assert list(sd) == list(tsd)
    for k in sd:
        v, tv = sd[k], tsd[k]
        assert isinstance(v, ag.Tensor) and not v.requires_grad and v.is_leaf
        assert tuple(v.size()) == tuple(tv.size()) and v.dim() == tv.dim()
        c = v.clone()
        assert c is not v and c.shape == v.shape
    w0 = sd["0.weight"].numpy().copy()
    with ag.no_grad():
        m[0].weight.add_(1.0)  # a copy: later updates do not show through
    np.testing.assert_array_equal(sd["0.weight"].numpy(), w0)
    # torch-format state dicts load: plain values, and parameters that require grad (keep_vars=True)
    m.load_state_dict(tm.state_dict())
    m.load_state_dict(tm.state_dict(keep_vars=True))
    np.testing.assert_array_equal(m[0].weight.numpy(), tm[0].weight.detach().numpy())
    # and our values load into torch
    tm.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in m.state_dict().items()})
    # channels-last parameter layouts survive state_dict
    conv = nn.Conv2d(2, 3, 3)
    with ag.no_grad():
        cl = ag.tensor(np.ascontiguousarray(conv.weight.numpy().transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2))
    conv.weight = nn.Parameter(cl)
    assert conv.state_dict()["weight"].stride() == cl.stride()
