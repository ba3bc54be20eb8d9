"""The PyTorch DQN tutorial's update, ported to asyncgrad with the smallest changes: a deep-copied target
net, Huber loss on ``Q(s, a)`` gathered from the policy net, AdamW(amsgrad=True), gradient value
clipping, and the soft target update written, as in the tutorial, with state_dict arithmetic. 40 updates
from torch's initial weights on a synthetic replay batch stream, float64, losses against torch
(max relative difference <= 1e-6).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn import functional as F
from tests._util import load_state, state_from_torch

from ._parity import float64_everywhere, max_rel_diff

N_OBS, N_ACT, HID = 4, 2, 32
BATCH, GAMMA, TAU, LR = 16, 0.99, 0.005, 1e-3


class DQN(nn.Module):
    def __init__(self, n_observations: int, n_actions: int) -> None:
        super().__init__()
        self.layer1 = nn.Linear(n_observations, HID)
        self.layer2 = nn.Linear(HID, HID)
        self.layer3 = nn.Linear(HID, n_actions)

    def forward(self, x):  # type: ignore[no-untyped-def]
        x = F.relu(self.layer1(x))
        x = F.relu(self.layer2(x))
        return self.layer3(x)


def _tdqn(torch: Any, n_observations: int, n_actions: int) -> Any:
    """The torch net (built inside the reference function: torch is a parameter, not a module global)."""
    tnn, TF = torch.nn, torch.nn.functional

    class TDQN(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer1 = tnn.Linear(n_observations, HID)
            self.layer2 = tnn.Linear(HID, HID)
            self.layer3 = tnn.Linear(HID, n_actions)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.layer3(TF.relu(self.layer2(TF.relu(self.layer1(x)))))

    return TDQN()


async def _optimize_model(policy_net, target_net, optimizer, batch) -> float:  # type: ignore[no-untyped-def]
    state, action, reward, next_state, non_final = (ag.tensor(a) for a in batch)
    state_action_values = policy_net(state).gather(1, action)
    with ag.no_grad():
        next_state_values = target_net(next_state).max(1).values * non_final
    expected_state_action_values = (next_state_values * GAMMA) + reward
    criterion = nn.SmoothL1Loss()
    loss = criterion(state_action_values, expected_state_action_values.unsqueeze(1))
    optimizer.zero_grad()
    await loss.backward()
    nn.utils.clip_grad_value_(policy_net.parameters(), 100)
    optimizer.step()
    return loss.item()


def _t_optimize_model(torch, policy_net, target_net, optimizer, batch) -> float:  # type: ignore[no-untyped-def]
    tnn = torch.nn
    state, action, reward, next_state, non_final = (torch.from_numpy(a) for a in batch)
    state_action_values = policy_net(state).gather(1, action)
    with torch.no_grad():
        next_state_values = target_net(next_state).max(1).values * non_final
    expected_state_action_values = (next_state_values * GAMMA) + reward
    loss = tnn.SmoothL1Loss()(state_action_values, expected_state_action_values.unsqueeze(1))
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)
    optimizer.step()
    return loss.item()


def _soft_update(policy_net, target_net) -> None:  # type: ignore[no-untyped-def]
    # the tutorial's code, unchanged: θ′ ← τ θ + (1 − τ) θ′ on state_dict values
    target_net_state_dict = target_net.state_dict()
    policy_net_state_dict = policy_net.state_dict()
    for key in policy_net_state_dict:
        target_net_state_dict[key] = policy_net_state_dict[key] * TAU + target_net_state_dict[key] * (1 - TAU)
    target_net.load_state_dict(target_net_state_dict)


async def test_dqn_update_with_deep_copied_target_matches_torch(rt: ag.Runtime, torch_ref) -> None:
    rng = np.random.default_rng(0)
    batches = [
        (
            rng.standard_normal((BATCH, N_OBS)),
            rng.integers(0, N_ACT, (BATCH, 1)),
            rng.choice([0.0, 1.0], BATCH),
            rng.standard_normal((BATCH, N_OBS)),
            (rng.random(BATCH) > 0.1).astype(np.float64),
        )
        for _ in range(40)
    ]

    def reference(torch):
        with float64_everywhere(torch):
            torch.manual_seed(0)
            tpolicy = _tdqn(torch, N_OBS, N_ACT)
            ttarget = _tdqn(torch, N_OBS, N_ACT)
            ttarget.load_state_dict(tpolicy.state_dict())
            state = state_from_torch(tpolicy)
            toptimizer = torch.optim.AdamW(tpolicy.parameters(), lr=LR, amsgrad=True, foreach=False)
            tlosses = []
            for batch in batches:
                tlosses.append(_t_optimize_model(torch, tpolicy, ttarget, toptimizer, batch))
                _soft_update(tpolicy, ttarget)
            return {"state": state, "losses": tlosses, "target": state_from_torch(ttarget)}

    want = torch_ref("dqn", reference, batches=batches)
    tlosses = want["losses"]
    with float64_everywhere():
        policy_net = DQN(N_OBS, N_ACT)
        load_state(policy_net, want["state"])
        target_net = copy.deepcopy(policy_net)  # the port: deepcopy instead of a second net + load
        assert target_net.layer1.weight is not policy_net.layer1.weight
        optimizer = ag.optim.AdamW(policy_net.parameters(), lr=LR, amsgrad=True)
        losses = []
        with trio.fail_after(60):
            for batch in batches:
                losses.append(await _optimize_model(policy_net, target_net, optimizer, batch))
                _soft_update(policy_net, target_net)
        diff = max_rel_diff(losses, tlosses)
        print(f"DQN update (deep-copied target, soft updates), 40 steps: max relative loss difference {diff:.3g}")
        assert diff <= 1e-6, diff
        for k, v in target_net.state_dict().items():
            np.testing.assert_allclose(v.numpy(), want["target"][k], rtol=1e-9, atol=1e-12)
        # the target really is a separate net that lags the policy
        assert not np.allclose(target_net.layer1.weight.numpy(), policy_net.layer1.weight.numpy())
