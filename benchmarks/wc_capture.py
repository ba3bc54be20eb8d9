"""CAPTURE: eager vs ``ag.compile``-captured training steps of three models (issue 21), same run.

An MLP (32-64-64-10, batch 16), the MNIST example's CNN on 28x28 (conv2d 1->8->16, maxpool, linear; batch 8)
and a 2-layer LSTM language model (vocab 20, emb 16, hidden 32, batch 4 x 12 tokens); SGD with momentum.
Each round times ``steps`` consecutive steps of the eager model, then of the captured one (alternating which
goes first), waiting for the last step's kernels; figure: ms per step, median over rounds. The two trainings
start from the same weights on the same batches, and their parameters are compared bit for bit at the end.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from _common import fmt, median, say, table


def _models() -> dict[str, Any]:
    import asyncgrad as ag

    nn, F = ag.nn, ag.nn.functional

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

        def forward(self, x: Any) -> Any:
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, 1), nn.Conv2d(8, 16, 3, 1)
            self.fc1, self.fc2 = nn.Linear(16 * 12 * 12, 32), nn.Linear(32, 10)

        def forward(self, x: Any) -> Any:
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            return F.log_softmax(self.fc2(F.relu(self.fc1(ag.flatten(x, 1)))), dim=1)

    class LSTMLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 16)
            self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
            self.head = nn.Linear(32, 20)

        def forward(self, x: Any) -> Any:
            h, _ = self.lstm(self.emb(x))
            return self.head(h).reshape(-1, 20)

    rng = np.random.default_rng(0)
    return {
        "MLP": (MLP, lambda: (rng.standard_normal((16, 32)).astype(np.float32), rng.integers(0, 10, 16)),
                F.cross_entropy),
        "CNN 28x28": (CNN, lambda: (rng.standard_normal((8, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 8)),
                      F.nll_loss),
        "LSTM LM": (LSTMLM, lambda: (rng.integers(0, 20, (4, 12)), rng.integers(0, 20, 48)), F.cross_entropy),
    }


def _measure(name: str, spec: Any, steps: int, rounds: int) -> dict[str, Any]:
    import trio

    import asyncgrad as ag

    cls, batch, loss_fn = spec

    def make() -> tuple[Any, Any]:
        ag.manual_seed(0)
        m = cls()
        return m, ag.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    def step_of(model: Any, opt: Any) -> Any:
        async def step(x: Any, y: Any) -> Any:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            await loss.backward()
            opt.step()
            return loss

        return step

    async def main() -> dict[str, Any]:
        async with ag.open_runtime() as rt:
            data = [tuple(ag.tensor(a) for a in batch()) for _ in range(steps)]
            (m1, o1), (m2, o2) = make(), make()
            eager, captured = step_of(m1, o1), ag.compile(step_of(m2, o2))
            for x, y in data[:3]:  # warm: eager, record, first replay
                await eager(x, y)
                await captured(x, y)
            await rt.synchronize()
            times: dict[str, list[float]] = {"eager": [], "captured": []}
            for r in range(rounds):
                order = [("eager", eager), ("captured", captured)]
                for label, fn in order if r % 2 == 0 else order[::-1]:
                    t = time.perf_counter()
                    for x, y in data:
                        await fn(x, y)
                    await rt.synchronize()
                    times[label].append((time.perf_counter() - t) / steps * 1e3)
            same = all(a.numpy().tobytes() == b.numpy().tobytes() for a, b in zip(m1.parameters(), m2.parameters()))
            st = captured.statistics()
            return {"eager_ms": times["eager"], "captured_ms": times["captured"], "bit_identical": same,
                    "replays": st.replays, "kernels": st.instructions, "fallback": st.fallback_reason}

    return trio.run(main)  # type: ignore[no-any-return]


def run(quick: bool = False) -> dict[str, Any]:
    steps, rounds = (5, 5) if quick else (10, 9)
    say(f"CAPTURE: eager vs ag.compile training steps (SGD momentum), {steps} steps per round, median of "
        f"{rounds} alternating rounds")
    rows, out = [], {}
    for name, spec in _models().items():
        r = _measure(name, spec, steps, rounds)
        e, c = median(r["eager_ms"]), median(r["captured_ms"])
        r.update(eager_median_ms=e, captured_median_ms=c, captured_vs_eager=c / e)
        out[name] = r
        rows.append([name, fmt(e), fmt(c), fmt(c / e) + "x", str(r["kernels"]), str(r["bit_identical"]),
                     r["fallback"] or "-"])
    say()
    say(table(["model", "eager ms/step", "captured", "captured/eager", "kernels", "bit-identical", "fallback"],
              rows))
    return out
