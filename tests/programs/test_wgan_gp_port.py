"""WGAN-GP (Gulrajani et al.; the common PyTorch implementation) ported to asyncgrad with the smallest
changes: the gradient penalty takes ``autograd.grad(..., create_graph=True, retain_graph=True,
only_inputs=True)`` of the critic at random interpolates, the critic trains 5 steps per generator step,
Adam(lr=1e-4, betas=(0.5, 0.9)). 36 steps (30 critic + 6 generator) from torch's initial weights on a
synthetic 2-d "real" distribution, float64, losses against torch (max relative difference <= 1e-6).
Noise and interpolation weights are drawn once with numpy and fed to both.
"""

from __future__ import annotations

import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import autograd, nn
from tests._util import load_state, state_from_torch

from ._parity import float64_everywhere, max_rel_diff

Z, HID, BATCH, LAMBDA, N_CRITIC = 4, 32, 16, 10.0, 5


def _gen(lib):  # type: ignore[no-untyped-def]
    return lib.Sequential(lib.Linear(Z, HID), lib.ReLU(), lib.Linear(HID, HID), lib.ReLU(), lib.Linear(HID, 2))


def _critic(lib):  # type: ignore[no-untyped-def]
    return lib.Sequential(lib.Linear(2, HID), lib.LeakyReLU(0.2), lib.Linear(HID, HID), lib.Tanh(), lib.Linear(HID, 1))


async def _gradient_penalty(netD, real, fake, alpha):  # type: ignore[no-untyped-def]
    interpolates = alpha * real + (1 - alpha) * fake
    interpolates.requires_grad_(True)
    disc_interpolates = netD(interpolates)
    gradients = (await autograd.grad(
        outputs=disc_interpolates, inputs=interpolates, grad_outputs=ag.ones(disc_interpolates.size()),
        create_graph=True, retain_graph=True, only_inputs=True,
    ))[0]
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean() * LAMBDA


def _t_gradient_penalty(torch, netD, real, fake, alpha):  # type: ignore[no-untyped-def]
    interpolates = alpha * real + (1 - alpha) * fake
    interpolates.requires_grad_(True)
    disc_interpolates = netD(interpolates)
    gradients = torch.autograd.grad(
        outputs=disc_interpolates, inputs=interpolates, grad_outputs=torch.ones(disc_interpolates.size()),
        create_graph=True, retain_graph=True, only_inputs=True,
    )[0]
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean() * LAMBDA


async def test_wgan_gp_matches_torch(rt: ag.Runtime, torch_ref) -> None:
    rng = np.random.default_rng(0)
    # per generator step: N_CRITIC critic batches (real, noise, alpha), then the generator's noise
    its = []
    for _it in range(6):
        critic = []
        for _ in range(N_CRITIC):
            real_np = rng.standard_normal((BATCH, 2)) * 0.5 + np.array([2.0, -1.0])
            noise_np = rng.standard_normal((BATCH, Z))
            alpha_np = rng.random((BATCH, 1))
            critic.append((real_np, noise_np, alpha_np))
        its.append((critic, rng.standard_normal((BATCH, Z))))

    def reference(torch):
        tnn = torch.nn
        with float64_everywhere(torch):
            torch.manual_seed(3)
            tG, tD = _gen(tnn), _critic(tnn)
            state = {"G": state_from_torch(tG), "D": state_from_torch(tD)}
            toptD = torch.optim.Adam(tD.parameters(), lr=1e-4, betas=(0.5, 0.9), foreach=False)
            toptG = torch.optim.Adam(tG.parameters(), lr=1e-4, betas=(0.5, 0.9), foreach=False)
            tlosses = []
            for critic, gnoise_np in its:
                for tp in tD.parameters():
                    tp.requires_grad_(True)
                for real_np, noise_np, alpha_np in critic:
                    treal, tnoise, talpha = (torch.from_numpy(a) for a in (real_np, noise_np, alpha_np))
                    tD.zero_grad()
                    with torch.no_grad():
                        tfake = tG(tnoise)
                    tloss_d = (tD(tfake).mean() - tD(treal).mean()
                               + _t_gradient_penalty(torch, tD, treal, tfake, talpha))
                    tloss_d.backward()
                    toptD.step()
                    tlosses.append(tloss_d.item())
                for tp in tD.parameters():
                    tp.requires_grad_(False)
                tG.zero_grad()
                tloss_g = -tD(tG(torch.from_numpy(gnoise_np))).mean()
                tloss_g.backward()
                toptG.step()
                tlosses.append(tloss_g.item())
            return {"state": state, "losses": tlosses}

    want = torch_ref("wgan_gp", reference, its=its)
    tlosses = want["losses"]
    with float64_everywhere():
        G, D = _gen(nn), _critic(nn)
        load_state(G, want["state"]["G"])
        load_state(D, want["state"]["D"])
        optD = ag.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.9))
        optG = ag.optim.Adam(G.parameters(), lr=1e-4, betas=(0.5, 0.9))
        losses, gps = [], []
        with trio.fail_after(90):
            for critic, gnoise_np in its:
                for p in D.parameters():
                    p.requires_grad_(True)
                for real_np, noise_np, alpha_np in critic:
                    real, noise, alpha = ag.tensor(real_np), ag.tensor(noise_np), ag.tensor(alpha_np)
                    D.zero_grad()
                    with ag.no_grad():
                        fake = G(noise)
                    d_cost = D(fake).mean() - D(real).mean()
                    gp = await _gradient_penalty(D, real, fake, alpha)
                    loss_d = d_cost + gp
                    await loss_d.backward()
                    optD.step()
                    losses.append(loss_d.item())
                    gps.append(gp.item())
                for p in D.parameters():
                    p.requires_grad_(False)
                G.zero_grad()
                loss_g = -D(G(ag.tensor(gnoise_np))).mean()
                await loss_g.backward()
                optG.step()
                losses.append(loss_g.item())
        assert len(losses) == 36 and min(gps) > 0
        diff = max_rel_diff(losses, tlosses)
        print(f"WGAN-GP (create_graph=True penalty), 36 steps: max relative loss difference {diff:.3g}")
        assert diff <= 1e-6, diff
