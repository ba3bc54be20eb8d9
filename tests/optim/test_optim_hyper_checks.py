"""Every optimizer's hyper-parameter checks give PyTorch's errors, in the constructor and for added groups.

The checks are table-driven (`Optimizer._hyper_checks`, `ADAM_FAMILY_CHECKS`); these cases pin each table
entry's message against torch's own for the same bad value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag

_CASES: list[tuple[str, dict[str, Any]]] = [
    ("SGD", {"lr": -1.0}),
    ("SGD", {"lr": 0.1, "momentum": -0.5}),
    ("SGD", {"lr": 0.1, "weight_decay": -0.5}),
    ("SGD", {"lr": 0.1, "nesterov": True}),
    ("Adam", {"lr": -1.0}),
    ("Adam", {"eps": -1.0}),
    ("Adam", {"betas": (1.0, 0.999)}),
    ("Adam", {"betas": (0.9, 1.0)}),
    ("Adam", {"weight_decay": -1.0}),
    ("AdamW", {"betas": (0.9, -0.1)}),
    ("Adagrad", {"lr": -1.0}),
    ("Adagrad", {"lr_decay": -1.0}),
    ("Adagrad", {"weight_decay": -1.0}),
    ("Adagrad", {"initial_accumulator_value": -1.0}),
    ("Adagrad", {"eps": -1.0}),
    ("RMSprop", {"lr": -1.0}),
    ("RMSprop", {"eps": -1.0}),
    ("RMSprop", {"momentum": -1.0}),
    ("RMSprop", {"weight_decay": -1.0}),
    ("RMSprop", {"alpha": -1.0}),
    ("Adadelta", {"lr": -1.0}),
    ("Adadelta", {"rho": 1.5}),
    ("Adadelta", {"eps": -1.0}),
    ("Adadelta", {"weight_decay": -1.0}),
    ("Adamax", {"lr": -1.0}),
    ("Adamax", {"eps": -1.0}),
    ("Adamax", {"betas": (1.5, 0.999)}),
    ("Adamax", {"weight_decay": -1.0}),
    ("ASGD", {"lr": -1.0}),
    ("ASGD", {"weight_decay": -1.0}),
    ("NAdam", {"lr": -1.0}),
    ("NAdam", {"eps": -1.0}),
    ("NAdam", {"betas": (0.9, 1.5)}),
    ("NAdam", {"weight_decay": -1.0}),
    ("NAdam", {"momentum_decay": -1.0}),
    ("RAdam", {"lr": -1.0}),
    ("RAdam", {"eps": -1.0}),
    ("RAdam", {"betas": (-0.1, 0.999)}),
    ("RAdam", {"weight_decay": -1.0}),
    ("Rprop", {"lr": -1.0}),
    ("Rprop", {"etas": (1.5, 1.2)}),
]


def _torch_error(torch_ref: Any, name: str, kw: dict[str, Any]) -> str:
    """The message of torch's ValueError for ``torch.optim.<name>(params, **kw)`` (recorded)."""

    def reference(torch: Any) -> str:
        with pytest.raises(ValueError) as e:
            getattr(torch.optim, name)([torch.zeros(2, requires_grad=True)], **kw)
        return str(e.value)

    return torch_ref("torch_error", reference, name=name, kw=kw)


@pytest.mark.parametrize(("name", "kw"), _CASES, ids=[f"{n}-{next(iter(k))}-{i}" for i, (n, k) in enumerate(_CASES)])
async def test_constructor_error_is_torchs(rt: Any, torch_ref: Any, name: str, kw: dict[str, Any]) -> None:
    expected = _torch_error(torch_ref, name, kw)
    with trio.fail_after(30), pytest.raises(ValueError) as e:
        getattr(ag.optim, name)([ag.tensor(np.zeros(2, np.float32), requires_grad=True)], **kw)
    assert str(e.value) == expected


@pytest.mark.parametrize(("name", "kw"), _CASES, ids=[f"{n}-{next(iter(k))}-{i}" for i, (n, k) in enumerate(_CASES)])
async def test_added_group_error_is_torchs(rt: Any, torch_ref: Any, name: str, kw: dict[str, Any]) -> None:
    if name == "Adagrad" and "initial_accumulator_value" in kw:
        pytest.skip("initial_accumulator_value is a constructor argument only (as in PyTorch)")
    if name == "SGD" and "nesterov" in kw:
        kw = {**kw, "momentum": 0.0}
    expected = _torch_error(torch_ref, name, kw)
    with trio.fail_after(30):
        opt = getattr(ag.optim, name)([ag.tensor(np.zeros(2, np.float32), requires_grad=True)], lr=0.1)
        with pytest.raises(ValueError) as e:
            opt.add_param_group({"params": [ag.tensor(np.zeros(2, np.float32), requires_grad=True)], **kw})
    assert str(e.value) == expected
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name", ["Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "Rprop"])
@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
async def test_torch_only_flags(rt: Any, name: str, flag: str) -> None:
    with trio.fail_after(30):
        p = ag.tensor(np.zeros(2, np.float32), requires_grad=True)
        with pytest.raises(ValueError, match=f"^{name}: {flag}=True is not supported by asyncgrad"):
            getattr(ag.optim, name)([p], **{flag: True})
        opt = getattr(ag.optim, name)([p], foreach=True)
    g = opt.param_groups[0]
    assert (g["foreach"], g["capturable"], g["differentiable"], g["maximize"]) == (True, False, False, False)
