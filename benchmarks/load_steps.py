"""LOAD: W1 and a small-CNN step under load, asyncgrad beside numpy by hand in the same conditions.

Loads: none; one outside busy process (a pure-Python loop in a subprocess); torch training an MLP in a
thread of this process (torch's own intra-op threads). For each load the contenders run interleaved,
each a few timed repeats of N steps: numpy by hand (the floor; also shown on one BLAS thread, beside
the bar's default-threads floor, since a multi-threaded BLAS call stalls when one of its threads waits
for a core and the default floor then swings with the load), asyncgrad with the default
``lane_nice`` and with ``lane_nice=10`` (the old default), so the ratio to numpy is a same-run figure.

Small CNN: conv 1->16 3x3 (batch 64, 28x28, float32), ReLU, linear 10816->10, softmax cross-entropy,
SGD. The numpy floor computes the conv with a sliding-window view and tensordot, its weight gradient the
same way (the input needs no gradient).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
from _common import fmt, interleave, median, say, table

CB, CH, HW, K, NC = 64, 16, 28, 3, 10
LR = 0.01


def cnn_data() -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    r = np.random.default_rng(0)
    x = r.standard_normal((CB, 1, HW, HW), dtype=np.float32)
    y = r.integers(0, NC, CB)
    o = HW - K + 1
    P = [
        r.standard_normal((CH, 1, K, K), dtype=np.float32) * 0.3,
        np.zeros(CH, np.float32),
        r.standard_normal((CH * o * o, NC), dtype=np.float32) * 0.01,
        np.zeros(NC, np.float32),
    ]
    return x, y, P


class NumpyCNN:
    def __init__(self) -> None:
        self.x, self.y, self.P = cnn_data()
        self.win = np.lib.stride_tricks.sliding_window_view(self.x[:, 0], (K, K), axis=(1, 2))  # B,o,o,K,K
        self.ar = np.arange(CB)

    def step(self) -> None:
        Wc, bc, Wl, bl = self.P
        h = np.tensordot(self.win, Wc[:, 0], axes=([3, 4], [1, 2]))  # B,o,o,CH
        h = h.transpose(0, 3, 1, 2) + bc[:, None, None]
        a = np.maximum(h, 0)
        f = a.reshape(CB, -1)
        z = f @ Wl + bl
        z = z - z.max(1, keepdims=True)
        e = np.exp(z)
        g = e / e.sum(1, keepdims=True)
        g[self.ar, self.y] -= 1
        g /= CB
        gWl = f.T @ g
        gbl = g.sum(0)
        gf = (g @ Wl.T).reshape(a.shape)
        gf[h <= 0] = 0
        gWc = np.tensordot(gf, self.win, axes=([0, 2, 3], [0, 1, 2]))[:, None]
        gbc = gf.sum((0, 2, 3))
        for p, gp in zip(self.P, [gWc, gbc, gWl, gbl]):
            p -= np.float32(LR) * gp


class AgCNN:
    def __init__(self) -> None:
        import asyncgrad as ag

        self.ag = ag
        x, y, P = cnn_data()
        self.x, self.y = ag.tensor(x), ag.tensor(y)
        self.P = [ag.tensor(p, requires_grad=True) for p in P]

    async def step(self) -> None:
        ag = self.ag
        F = ag.nn.functional
        Wc, bc, Wl, bl = self.P
        a = ag.relu(F.conv2d(self.x, Wc, bc))
        z = a.reshape(CB, -1) @ Wl + bl
        loss = F.cross_entropy(z, self.y)
        await loss.backward()
        with ag.no_grad():
            for p in self.P:
                p -= LR * p.grad  # type: ignore[operator]
                p.grad = None

    async def sync(self) -> None:
        for p in self.P:
            await p.ready()


def numpy_time(kind: str, steps: int, blas_threads: int | None = None) -> float:
    """Seconds per numpy step; with ``blas_threads``, BLAS limited to that many threads meanwhile."""
    from contextlib import nullcontext

    from w1_mlp_step import NumpyMLP

    limit: Any = nullcontext()
    if blas_threads is not None:
        from threadpoolctl import threadpool_limits

        limit = threadpool_limits(blas_threads, user_api="blas")
    with limit:
        m: Any = NumpyMLP() if kind == "W1" else NumpyCNN()
        m.step()
        t = time.perf_counter()
        for _ in range(steps):
            m.step()
        return (time.perf_counter() - t) / steps


def ag_time(kind: str, steps: int, **opts: Any) -> float:
    import trio

    import asyncgrad as ag

    async def main() -> float:
        async with ag.open_runtime(**opts):
            if kind == "W1":
                from w1_mlp_step import AgMLP

                m: Any = AgMLP()
            else:
                m = AgCNN()
            await m.step()
            await m.sync()
            t = time.perf_counter()
            for _ in range(steps):
                await m.step()
            await m.sync()
            return (time.perf_counter() - t) / steps

    return trio.run(main)  # type: ignore[no-any-return]


class BusyProcess:
    """One outside process spinning a pure-Python loop (killed and reaped on exit)."""

    def __enter__(self) -> BusyProcess:
        self.p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.p.kill()
        self.p.wait()


class TorchThread:
    """torch training a small MLP in a thread of this process, with torch's default intra-op threads."""

    def __enter__(self) -> TorchThread:
        import torch

        self.stop = threading.Event()
        self.steps = 0

        def train() -> None:
            r = torch.Generator().manual_seed(0)
            x = torch.randn(128, 784, generator=r)
            y = torch.randint(0, 10, (128,), generator=r)
            m = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
            while not self.stop.is_set():
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
                self.steps += 1

        self.t = threading.Thread(target=train, name="torch-load", daemon=True)
        self.t.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.t.join(10)


class NoLoad:
    def __enter__(self) -> NoLoad:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def run(quick: bool = False, loads: tuple[str, ...] = ("none", "busy process", "torch thread")) -> dict[str, Any]:
    from asyncgrad.devices import DEFAULT_LANE_NICE

    steps = {"W1": 20 if quick else 40, "CNN": 20 if quick else 40}
    rounds = 2 if quick else 4
    say(f"LOAD: step time under load, {rounds} interleaved rounds of {steps['W1']} steps each; "
        f"{os.cpu_count()} cores; default lane_nice={DEFAULT_LANE_NICE}")
    out: dict[str, Any] = {}
    rows = []
    for load in loads:
        if load == "torch thread":
            try:
                import torch  # noqa: F401
            except ImportError:
                say("  torch not importable: the torch-thread load is skipped")
                continue
        loaders: dict[str, Any] = {"none": NoLoad, "busy process": BusyProcess, "torch thread": TorchThread}
        ctx = loaders[load]()
        with ctx:
            for kind in ("W1", "CNN"):
                n = steps[kind]
                contenders: dict[str, Any] = {
                    "numpy": lambda k=kind, n=n: numpy_time(k, n),
                    # the floor on one BLAS thread: shows when the default floor's own multi-threaded
                    # BLAS stalls (a barrier across its threads while one of them waits for a core)
                    "numpy 1 BLAS thread": lambda k=kind, n=n: numpy_time(k, n, 1),
                    "asyncgrad (default)": lambda k=kind, n=n: ag_time(k, n),
                    "asyncgrad lane_nice=10": lambda k=kind, n=n: ag_time(k, n, lane_nice=10),
                }
                res = interleave(contenders, rounds)
                med = {c: median(v) if isinstance(v, list) and v else float("nan") for c, v in res.items()}
                out[f"{load}/{kind}"] = {c: v * 1e3 for c, v in med.items()}
                rows.append([
                    load, kind, fmt(med["numpy"] * 1e3), fmt(med["numpy 1 BLAS thread"] * 1e3),
                    fmt(med["asyncgrad (default)"] * 1e3), fmt(med["asyncgrad (default)"] / med["numpy"]),
                    fmt(med["asyncgrad lane_nice=10"] * 1e3), fmt(med["asyncgrad lane_nice=10"] / med["numpy"]),
                ])
                say(f"  {load}/{kind}: " + ", ".join(f"{c} {v * 1e3:.2f} ms" for c, v in med.items()))
    say(table(["load", "step", "numpy ms", "np 1-thr ms", "ag default ms", "x numpy", "ag nice=10 ms", "x numpy"],
              rows))
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    run(quick="--quick" in sys.argv)
