#!/usr/bin/env python3
"""The fused recurrence beside the same LSTM/GRU written as a Python loop of small ops, and beside PyTorch.

One training step (forward, backward of the output's sum) of a 2-layer LSTM and GRU, T=50, B=32,
64 -> 128, float64, in alternating rounds in one process; prints the median of each and the ratios.

    python3 benchmarks/rnn_fused.py [--rounds 7] [--torch-threads 1]

Run by hand; nothing here is part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import asyncgrad as ag
from asyncgrad import nn

T, B, I, H, L = 50, 32, 64, 128, 2


def unrolled(mode: str, x: ag.Tensor, m: nn.RNNBase) -> ag.Tensor:
    """The same recurrence with one op per gate and step (what the fused op replaces)."""
    inp = x
    for layer in range(L):
        w_ih, w_hh, b_ih, b_hh = (getattr(m, f"{n}_l{layer}") for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        h = ag.zeros((B, H), dtype=x.dtype)
        c = ag.zeros((B, H), dtype=x.dtype)
        outs = []
        for t in range(T):
            gi = nn.functional.linear(inp[t], w_ih, b_ih)
            gh = nn.functional.linear(h, w_hh, b_hh)
            if mode == "LSTM":
                g = gi + gh
                i, f = ag.sigmoid(g[:, :H]), ag.sigmoid(g[:, H : 2 * H])
                gg, o = ag.tanh(g[:, 2 * H : 3 * H]), ag.sigmoid(g[:, 3 * H :])
                c = f * c + i * gg
                h = o * ag.tanh(c)
            else:
                r = ag.sigmoid(gi[:, :H] + gh[:, :H])
                z = ag.sigmoid(gi[:, H : 2 * H] + gh[:, H : 2 * H])
                n = ag.tanh(gi[:, 2 * H :] + r * gh[:, 2 * H :])
                h = n + z * (h - n)
            outs.append(h)
        inp = ag.stack(outs, 0)
    return inp


def _steps(kind: str, am: nn.RNNBase, tm: object, x_np: np.ndarray, torch: object) -> tuple:
    async def fused() -> None:
        y, _ = am(ag.tensor(x_np))
        await y.sum().backward()

    async def loop() -> None:
        await unrolled(kind, ag.tensor(x_np), am).sum().backward()

    async def ref() -> None:
        y, _ = tm(torch.tensor(x_np))  # type: ignore[operator, attr-defined]
        y.sum().backward()

    return fused, loop, ref


async def main(rounds: int, torch_threads: int) -> None:
    import torch

    torch.set_num_threads(torch_threads)
    x_np = np.random.default_rng(0).standard_normal((T, B, I))
    for kind in ("LSTM", "GRU"):
        tm = getattr(torch.nn, kind)(I, H, L).double()
        am = getattr(nn, kind)(I, H, L, dtype=ag.float64)
        am.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})

        fused, loop, ref = _steps(kind, am, tm, x_np, torch)

        # the two asyncgrad forms compute the same values
        ya, _ = am(ag.tensor(x_np))
        yb = unrolled(kind, ag.tensor(x_np), am)
        assert np.allclose(ya.numpy(), yb.numpy(), rtol=1e-10, atol=1e-12)
        times: dict[str, list[float]] = {"fused": [], "loop": [], "torch": []}
        for _ in range(rounds):
            for name, fn in (("fused", fused), ("loop", loop), ("torch", ref)):
                await fn()  # warm
                t0 = time.perf_counter()
                for _ in range(3):
                    await fn()
                times[name].append((time.perf_counter() - t0) / 3)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"{kind}: fused {med['fused']:.1f} ms, loop of ops {med['loop']:.1f} ms, torch ({torch_threads} thread) "
            f"{med['torch']:.1f} ms per step; fused / torch {med['fused'] / med['torch']:.2f}x, "
            f"loop / fused {med['loop'] / med['fused']:.1f}x"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--torch-threads", type=int, default=1)
    a = ap.parse_args()
    ag.run(main, a.rounds, a.torch_threads)
