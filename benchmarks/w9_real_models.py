"""W9 real-models: ms per training step of three real programs, CPU float32, beside PyTorch (1 and 2 threads).

Models (the same module structure written once for both libraries, `_models`):
- ``gpt``: a char GPT (nanoGPT's layout): vocab 65, 2 layers, 2 heads, 32 embd, block 16, batch 16; token +
  position embeddings, pre-LN blocks (LayerNorm, causal scaled_dot_product_attention, 4x GELU MLP), tied-free
  head, cross-entropy.
- ``cnn``: PyTorch's examples/mnist ``Net`` on 28x28, batch 64: conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU,
  max_pool 2, dropout 0.25, flatten, fc 9216->128, ReLU, dropout 0.5, fc 128->10, log_softmax + nll_loss.
- ``lstm``: a word-language-model LSTM LM (examples/word_language_model): vocab 10000, embedding 200, 2-layer
  LSTM with 200 hidden units, seq 35, batch 20, dropout 0.2, decoder 200->10000, cross-entropy.

Each step is forward, backward and an SGD update (lr 0.01). Contenders per model: torch with
``torch.set_num_threads(1)`` and ``(2)``; asyncgrad eager in a runtime whose BLAS threads match each torch
column (``open_runtime(lanes=1, blas_threads=n)``) and with the runtime's defaults; ``ag.compile(step)``
too when the library has it. Before timing, one step from the same weights and data (dropout off) must give
torch's loss and parameters; the timing then alternates contenders round by round, each repeat in a fresh interpreter (a
contender's spinning thread pool would slow the next one), and reports medians and the median of per-round
ratios to torch (each ratio from figures taken seconds apart).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import Failed, blas_info, blas_line, fmt, have, load_line, median, run_child, say, table

LR = 0.01
MODELS = ("gpt", "cnn", "lstm")
# steps per timed repeat (about the same wall time per model on 1 thread)
STEPS = {"gpt": 40, "cnn": 8, "lstm": 4}

# ---- shapes ---------------------------------------------------------------------------------------

GPT = {"vocab": 65, "layers": 2, "heads": 2, "embd": 32, "block": 16, "batch": 16}
CNN = {"batch": 64}
LSTM = {"vocab": 10000, "hidden": 200, "layers": 2, "seq": 35, "batch": 20, "dropout": 0.2}


def data(model: str) -> tuple[np.ndarray, np.ndarray]:
    """The batch of one step (the same every step): inputs and integer targets."""
    rng = np.random.default_rng(0)
    if model == "gpt":
        b, t, v = GPT["batch"], GPT["block"], GPT["vocab"]
        return rng.integers(0, v, (b, t)), rng.integers(0, v, (b, t))
    if model == "cnn":
        return rng.standard_normal((CNN["batch"], 1, 28, 28), dtype=np.float32), rng.integers(0, 10, CNN["batch"])
    s, b, v = LSTM["seq"], LSTM["batch"], LSTM["vocab"]
    return rng.integers(0, v, (s, b)), rng.integers(0, v, (s, b))


# ---- the models, written once against a library's nn / functional ----------------------------------


def _models(nn: Any, F: Any) -> dict[str, Callable[[], Any]]:
    """Builders of the three models over ``nn`` / ``F`` (torch's or asyncgrad's: the same names)."""

    class Block(nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self, e: int, h: int) -> None:
            super().__init__()
            self.h = h
            self.ln_1 = nn.LayerNorm(e)
            self.c_attn = nn.Linear(e, 3 * e)
            self.c_proj = nn.Linear(e, e)
            self.ln_2 = nn.LayerNorm(e)
            self.c_fc = nn.Linear(e, 4 * e)
            self.mlp_proj = nn.Linear(4 * e, e)

        def forward(self, x: Any) -> Any:
            b, t, e = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(e, dim=2)
            q = q.view(b, t, self.h, e // self.h).transpose(1, 2)
            k = k.view(b, t, self.h, e // self.h).transpose(1, 2)
            v = v.view(b, t, self.h, e // self.h).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(b, t, e)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))

    class CharGPT(nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            v, e = GPT["vocab"], GPT["embd"]
            self.wte = nn.Embedding(v, e)
            self.wpe = nn.Embedding(GPT["block"], e)
            self.h = nn.ModuleList([Block(e, GPT["heads"]) for _ in range(GPT["layers"])])
            self.ln_f = nn.LayerNorm(e)
            self.lm_head = nn.Linear(e, v, bias=False)

        def forward(self, idx: Any, pos: Any) -> Any:
            x = self.wte(idx) + self.wpe(pos)
            for blk in self.h:
                x = blk(x)
            return self.lm_head(self.ln_f(x))

        def loss(self, idx: Any, y: Any, pos: Any) -> Any:
            logits = self(idx, pos)
            return F.cross_entropy(logits.view(-1, GPT["vocab"]), y.view(-1))

    class Net(nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.dropout1 = nn.Dropout(0.25)
            self.dropout2 = nn.Dropout(0.5)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, x: Any) -> Any:
            x = F.relu(self.conv1(x))
            x = F.relu(self.conv2(x))
            x = F.max_pool2d(x, 2)
            x = self.dropout1(x)
            x = x.flatten(1)
            x = F.relu(self.fc1(x))
            x = self.dropout2(x)
            return F.log_softmax(self.fc2(x), dim=1)

        def loss(self, x: Any, y: Any, _: Any) -> Any:
            return F.nll_loss(self(x), y)

    class RNNModel(nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            v, h = LSTM["vocab"], LSTM["hidden"]
            self.drop = nn.Dropout(LSTM["dropout"])
            self.encoder = nn.Embedding(v, h)
            self.rnn = nn.LSTM(h, h, LSTM["layers"], dropout=LSTM["dropout"])
            self.decoder = nn.Linear(h, v)

        def loss(self, x: Any, y: Any, _: Any) -> Any:
            emb = self.drop(self.encoder(x))
            out, _h = self.rnn(emb)
            logits = self.decoder(self.drop(out))
            return F.cross_entropy(logits.view(-1, LSTM["vocab"]), y.view(-1))

    return {"gpt": CharGPT, "cnn": Net, "lstm": RNNModel}


def init_weights(model: str) -> dict[str, np.ndarray]:
    """The start of every contender: torch's default initialisation under a fixed seed, as numpy."""
    import torch

    torch.manual_seed(0)
    m = _models(torch.nn, torch.nn.functional)[model]()
    return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}


# ---- torch ----------------------------------------------------------------------------------------


class TorchStep:
    def __init__(self, model: str, weights: dict[str, np.ndarray], train: bool = True) -> None:
        import torch

        self.torch = torch
        self.m = _models(torch.nn, torch.nn.functional)[model]()
        self.m.load_state_dict({k: torch.tensor(v) for k, v in weights.items()})
        self.m.train(train)
        x, y = data(model)
        self.x, self.y = torch.tensor(x), torch.tensor(y)
        self.pos = torch.arange(GPT["block"])
        self.opt = torch.optim.SGD(self.m.parameters(), lr=LR)

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.m.loss(self.x, self.y, self.pos)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def params(self) -> dict[str, np.ndarray]:
        return {k: v.detach().numpy().copy() for k, v in self.m.state_dict().items()}


def torch_ms(model: str, weights: dict[str, np.ndarray], threads: int, n: int) -> float:
    """ms per step of torch with ``threads`` intra-op threads (after 2 warm-up steps)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        s = TorchStep(model, weights)
        for _ in range(2):
            s.step()
        t = time.perf_counter()
        for _ in range(n):
            s.step()
        return (time.perf_counter() - t) * 1e3 / n
    finally:
        torch.set_num_threads(old)


# ---- asyncgrad ------------------------------------------------------------------------------------


class AgStep:
    """Build inside an open runtime; ``await step()`` trains one step (recording may run one step ahead)."""

    def __init__(self, model: str, weights: dict[str, np.ndarray], train: bool = True) -> None:
        import asyncgrad as ag
        from asyncgrad import nn

        self.ag = ag
        self.m = _models(nn, nn.functional)[model]()
        self.m.load_state_dict(weights)
        self.m.train(train)
        x, y = data(model)
        self.x, self.y = ag.tensor(x), ag.tensor(y)
        self.pos = ag.arange(GPT["block"])
        self.opt = ag.optim.SGD(self.m.parameters(), lr=LR)
        self.params_list = list(self.m.parameters())
        self.compiled: Any = None

    async def step(self) -> Any:
        self.opt.zero_grad(set_to_none=True)
        loss = self.m.loss(self.x, self.y, self.pos)
        await loss.backward()
        self.opt.step()
        return loss

    async def sync(self) -> None:
        for p in self.params_list:
            await p.ready()

    def params(self) -> dict[str, np.ndarray]:
        return {k: v.numpy().copy() for k, v in self.m.state_dict().items()}


def ag_ms(model: str, weights: dict[str, np.ndarray], lanes: int | None, blas: int | None, n: int,
          compiled: bool = False) -> tuple[float, dict[str, Any]]:
    """ms per step of asyncgrad in a fresh runtime (``lanes``, ``blas_threads``), after 2 warm-up steps."""
    import trio

    import asyncgrad as ag

    async def main() -> tuple[float, dict[str, Any]]:
        async with ag.open_runtime(lanes=lanes, blas_threads=blas) as rt:
            s = AgStep(model, weights)
            step: Any = s.step
            if compiled:
                step = ag.compile(s.step)  # type: ignore[attr-defined]
            for _ in range(2):
                await step()
            await s.sync()
            t = time.perf_counter()
            for _ in range(n):
                await step()
            await s.sync()
            ms = (time.perf_counter() - t) * 1e3 / n
            return ms, {"lanes": rt.lanes, "blas_threads": rt.blas_threads}

    return trio.run(main)  # type: ignore[no-any-return]


def check_same(model: str, weights: dict[str, np.ndarray]) -> str:
    """One step from the same weights and data, dropout off: losses and updated parameters vs torch's."""
    import trio

    import asyncgrad as ag

    t = TorchStep(model, weights, train=False)
    tl = float(t.step())
    tp = t.params()

    async def main() -> tuple[float, dict[str, np.ndarray]]:
        async with ag.open_runtime(lanes=1, blas_threads=1):
            s = AgStep(model, weights, train=False)
            loss = await s.step()
            await s.sync()
            return float(loss.item()), s.params()

    al, ap = trio.run(main)
    perr = max(float(np.max(np.abs(ap[k] - tp[k]))) for k in tp)
    ok = abs(al - tl) <= 1e-4 * max(1.0, abs(tl)) and perr <= 1e-4
    return (f"loss asyncgrad {al:.6f} torch {tl:.6f}, max |param - torch's| after the step {perr:.1e}"
            + ("" if ok else "  << DIFFERS"))


# ---- one contender's repeat in a fresh interpreter ----------------------------------------------------


def contender_ms(kind: str, model: str, weights_path: str, n: int, threads: int = 1, lanes: int | None = None,
                 blas: int | None = None, compiled: bool = False) -> dict[str, Any]:
    """One repeat of one contender, run by ``_child.py`` in a fresh interpreter (``kind``: torch or ag).

    In one shared process the contenders spoiled each other on 2 cores: the thread pool of the one just
    timed (torch's OpenMP pool, OpenBLAS's) still spins while the next one runs. Measured so, asyncgrad's
    CNN with 2 BLAS threads took 141 ms a step instead of 68, and torch's 1-thread GPT step 5.3 ms
    instead of 2.1."""
    with np.load(weights_path) as f:
        weights = {k: f[k] for k in f.files}
    # a fresh interpreter loads lazily what a long-lived one has at hand (kernels from the disk cache,
    # BLAS buffers, allocator arenas): one untimed run of the same contender first
    if kind == "torch":
        torch_ms(model, weights, threads, max(2, n // 2))
        return {"ms": torch_ms(model, weights, threads, n), "info": {}}
    ag_ms(model, weights, lanes, blas, max(2, n // 2), compiled)
    ms, info = ag_ms(model, weights, lanes, blas, n, compiled)
    return {"ms": ms, "info": info}


# ---- the workload ---------------------------------------------------------------------------------


def run(quick: bool = False, models: tuple[str, ...] = MODELS) -> dict[str, Any]:
    import warnings

    import asyncgrad as ag

    # building a module reads the weights it just initialised (one wait per model, outside the timing)
    warnings.filterwarnings("ignore", message=".*blocked the trio event loop.*")

    rounds = 3 if quick else 5
    cores = os.cpu_count() or 1
    say(f"W9 real-models: ms per training step (forward, backward, SGD), CPU float32; {rounds} alternating rounds")
    say(f"  gpt {GPT}; cnn mnist Net {CNN}; lstm {LSTM}")
    say(f"  {blas_line()}")
    if not have("torch"):
        say("  torch: not installed; W9 needs it for the weights and the anchor (pip install torch==2.13.0)")
        return {"error": "torch not installed"}
    import torch

    has_compile = hasattr(ag, "compile")
    say(f"  torch {torch.__version__}, interop threads {torch.get_num_interop_threads()}; "
        f"ag.compile: {'present, timed' if has_compile else 'absent (eager only)'}")
    say("  each figure: one repeat in a fresh interpreter (contenders alternate, round by round)")
    out: dict[str, Any] = {"rounds": rounds, "models": {}, "load_before": load_line()}
    tmp = tempfile.mkdtemp(prefix="w9-weights-")
    for model in models:
        w = init_weights(model)
        n = max(2, STEPS[model] // (2 if quick else 1))
        say()
        say(f"  {model}: {sum(v.size for v in w.values()):,} parameters, {n} steps per repeat")
        try:
            check = check_same(model, w)
        except Exception as e:
            check = str(Failed(e))
        say(f"    same computation: {check}")
        extra: dict[str, Any] = {}
        wpath = os.path.join(tmp, f"{model}.npz")
        np.savez(wpath, **w)

        def child(key: str, extra: dict[str, Any] = extra, **kw: Any) -> Callable[[], float]:
            def one() -> float:
                r = run_child("w9_real_models", "contender_ms", kw, timeout=600)
                if "error" in r:
                    raise RuntimeError(r["error"])
                if r["info"]:
                    extra[key] = r["info"]
                return float(r["ms"])

            return one

        def torchc(threads: int, model: str = model, n: int = n, wpath: str = wpath) -> Callable[[], float]:
            return child("", kind="torch", model=model, weights_path=wpath, n=n, threads=threads)

        def agc(lanes: int | None, blas: int | None, key: str, compiled: bool = False,
                model: str = model, n: int = n, wpath: str = wpath) -> Callable[[], float]:
            return child(key, kind="ag", model=model, weights_path=wpath, n=n, lanes=lanes, blas=blas,
                         compiled=compiled)

        contenders: dict[str, Callable[[], float]] = {"torch 1 thread": torchc(1), "torch 2 threads": torchc(2)}

        contenders["asyncgrad 1 BLAS thread"] = agc(1, 1, "asyncgrad 1 BLAS thread")
        contenders["asyncgrad 2 BLAS threads"] = agc(1, 2, "asyncgrad 2 BLAS threads")
        contenders[f"asyncgrad default (lanes={cores})"] = agc(None, None, f"asyncgrad default (lanes={cores})")
        if has_compile:
            contenders["asyncgrad compiled, 1 BLAS thread"] = agc(1, 1, "c1", True)
            contenders["asyncgrad compiled, 2 BLAS threads"] = agc(1, 2, "c2", True)
        res: dict[str, list[float] | Failed] = {k: [] for k in contenders}
        for _ in range(rounds):
            for name, fn in contenders.items():
                r = res[name]
                if isinstance(r, Failed):
                    continue
                try:
                    r.append(fn())
                except Exception as e:
                    res[name] = Failed(e)
        rows = []
        mo: dict[str, Any] = {"check": check, "steps": n, "contenders": {}}
        for name, r in res.items():
            if isinstance(r, Failed):
                rows.append([name, str(r)])
                mo["contenders"][name] = {"error": str(r)}
                continue
            anchor = "torch 1 thread" if ("1 BLAS" in name or name == "torch 1 thread") else "torch 2 threads"
            a = res[anchor]
            paired = median([x / y for x, y in zip(r, a)]) if isinstance(a, list) and a else math.nan
            r1 = res["torch 1 thread"]
            r2 = res["torch 2 threads"]
            v1 = median(r) / median(r1) if isinstance(r1, list) else math.nan
            v2 = median(r) / median(r2) if isinstance(r2, list) else math.nan
            info = extra.get(name, {})
            rows.append([name, fmt(median(r), ".2f"), fmt(min(r), ".2f"), fmt(v1, ".2f") + "x", fmt(v2, ".2f") + "x",
                         fmt(paired, ".2f") + f"x vs {anchor.split()[1]}", str(info.get("blas_threads", "-"))])
            mo["contenders"][name] = {"ms": r, "median": median(r), "best": min(r), "vs_torch1": v1, "vs_torch2": v2,
                                      "paired_vs_" + anchor.replace(" ", "_"): paired, **info}
        say(table(["contender", "ms/step med", "best", "/torch1 med", "/torch2 med", "paired", "BLAS thr"], rows))
        out["models"][model] = mo
    shutil.rmtree(tmp, ignore_errors=True)
    out["load_after"] = load_line()
    out["blas"] = blas_info()
    say(f"  {out['load_before']} before, {out['load_after']} after")
    return out


if __name__ == "__main__":
    import sys

    from _common import steady_malloc

    say(steady_malloc())
    run(quick="--quick" in sys.argv, models=tuple(a for a in sys.argv[1:] if a in MODELS) or MODELS)
