#!/usr/bin/env python3
"""Train a population of models at once on the handwritten digits: over worker processes by default.

Sixteen trainings (MLPs and small CNNs of different widths, optimizers and learning rates). By default
they run through ``dist.open_population``: one worker process per core, each an asyncgrad runtime, the
trainings placed on the least-loaded worker; each training streams its losses back with
``await trial.report(...)`` and the parent redraws one progress bar per model from those reports.
``--in-process`` runs them as concurrent trio tasks in ONE runtime instead (kernels on the runtime's
lanes, the loop switching between the trainings); ``--sequential`` runs them one after another in one
runtime. At the end the script prints a table of test accuracies and the wall time (next to what one
after another took, when you ran ``--sequential`` before: it is kept in ``out/``), and saves the loss
curves as a PNG.

The data is scikit-learn's ``load_digits()`` (1797 8x8 images, shipped inside scikit-learn: no
network needed).

Usage::

    python3 examples/train_many.py                 # the full population (well under 2 minutes on 2 cores)
    python3 examples/train_many.py --quick         # a few seconds: 4 small trainings, 2 epochs
    python3 examples/train_many.py --no-progress --out out/curves.png
    python3 examples/train_many.py --sequential    # the same trainings one after another, to compare
    python3 examples/train_many.py --in-process    # concurrent tasks in one runtime (no worker processes)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

import asyncgrad as ag
from asyncgrad import distributed as dist
from asyncgrad import nn, optim
from asyncgrad.nn import functional as F


@dataclass
class Config:
    """One member of the population."""

    name: str
    kind: str  # "mlp" or "cnn"
    width: int
    opt: str  # "sgd", "adam" or "adamw"
    lr: float
    epochs: int
    batch: int = 32
    act: str = "relu"
    depth: int = 1
    dropout: float = 0.0


@dataclass
class Result:
    """What one training produced."""

    cfg: Config
    params: int = 0
    step_losses: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    test_acc: float = float("nan")
    seconds: float = 0.0


def population(quick: bool) -> list[Config]:
    """The trainings to run: MLPs and CNNs of several widths, optimizers and learning rates."""
    if quick:
        return [
            Config("mlp-32-sgd", "mlp", 32, "sgd", 0.1, epochs=2),
            Config("mlp-64-adam", "mlp", 64, "adam", 3e-3, epochs=2),
            Config("cnn-4-sgd", "cnn", 4, "sgd", 0.05, epochs=2),
            Config("cnn-8-adam", "cnn", 8, "adam", 3e-3, epochs=2),
        ]
    e = 12
    return [
        Config("mlp-32-sgd", "mlp", 32, "sgd", 0.1, epochs=e),
        Config("mlp-64-sgd", "mlp", 64, "sgd", 0.05, epochs=e),
        Config("mlp-128-sgd", "mlp", 128, "sgd", 0.1, epochs=e),
        Config("mlp-256-sgd-slow", "mlp", 256, "sgd", 0.002, epochs=e),
        Config("mlp-64-adam", "mlp", 64, "adam", 3e-3, epochs=e),
        Config("mlp-128-adam", "mlp", 128, "adam", 1e-3, epochs=e),
        Config("mlp-256-adamw", "mlp", 256, "adamw", 1e-3, epochs=e),
        Config("mlp-128x2-adam", "mlp", 128, "adam", 1e-3, epochs=e, depth=2),
        Config("mlp-64-tanh-sgd", "mlp", 64, "sgd", 0.1, epochs=e, act="tanh"),
        Config("mlp-128-gelu-adam", "mlp", 128, "adam", 2e-3, epochs=e, act="gelu", dropout=0.1),
        Config("cnn-4-sgd", "cnn", 4, "sgd", 0.05, epochs=e),
        Config("cnn-8-sgd", "cnn", 8, "sgd", 0.05, epochs=e),
        Config("cnn-8-adam", "cnn", 8, "adam", 3e-3, epochs=e),
        Config("cnn-16-adam", "cnn", 16, "adam", 2e-3, epochs=e),
        Config("cnn-16-adamw", "cnn", 16, "adamw", 1e-3, epochs=e),
        Config("cnn-32-adam-drop", "cnn", 32, "adam", 1e-3, epochs=e, dropout=0.2),
    ]


def _act(name: str) -> nn.Module:
    return {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}[name]()


def build(cfg: Config, seed: int = 0) -> nn.Module:
    """The model of one configuration (inputs: (N, 64) for MLPs, (N, 1, 8, 8) for CNNs).

    Its dropout draws from a generator of its own (seeded with ``seed``): the trainings run concurrently,
    so draws from the shared default generator would interleave in scheduling order, run to run.
    """
    drop_rng = np.random.default_rng(seed)
    if cfg.kind == "mlp":
        layers: list[nn.Module] = []
        fan_in = 64
        for _ in range(cfg.depth):
            layers += [nn.Linear(fan_in, cfg.width), _act(cfg.act)]
            if cfg.dropout:
                layers.append(nn.Dropout(cfg.dropout, generator=drop_rng))
            fan_in = cfg.width
        layers.append(nn.Linear(fan_in, 10))
        return nn.Sequential(*layers)
    c = cfg.width
    layers = [
        nn.Conv2d(1, c, 3, padding=1),
        _act(cfg.act),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Conv2d(c, 2 * c, 3, padding=1),
        _act(cfg.act),
        nn.MaxPool2d(2),  # 4x4 -> 2x2
        nn.Flatten(),
    ]
    if cfg.dropout:
        layers.append(nn.Dropout(cfg.dropout, generator=drop_rng))
    layers.append(nn.Linear(2 * c * 4, 10))
    return nn.Sequential(*layers)


def make_optimizer(cfg: Config, model: nn.Module) -> optim.Optimizer:
    if cfg.opt == "sgd":
        return optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    if cfg.opt == "adam":
        return optim.Adam(model.parameters(), lr=cfg.lr)
    return optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-2)


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits scaled to [0, 1], split 80/20 (stratified, fixed seed)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.2, random_state=seed, stratify=y)
    return Xtr, Xte, ytr, yte


def _shape_input(cfg: Config, X: np.ndarray) -> np.ndarray:
    return X.reshape(-1, 1, 8, 8) if cfg.kind == "cnn" else X


class _Bars:
    """One tqdm bar per training (position=i), or plain log lines when bars are off."""

    def __init__(self, cfgs: list[Config], steps: list[int], enabled: bool) -> None:
        self.enabled = enabled
        self.bars: list[Any] = []
        if enabled:
            from tqdm import tqdm

            w = max(len(c.name) for c in cfgs)
            self.bars = [
                tqdm(
                    total=n,
                    position=i,
                    desc=c.name.ljust(w),
                    leave=True,
                    mininterval=0.2,
                    dynamic_ncols=True,
                    bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {elapsed} {postfix}",
                )
                for i, (c, n) in enumerate(zip(cfgs, steps))
            ]

    def update(self, i: int, n: int = 1) -> None:
        if self.enabled:
            self.bars[i].update(n)

    def epoch(self, i: int, epoch: int, loss: float) -> None:
        if self.enabled:
            self.bars[i].set_postfix(epoch=epoch, loss=f"{loss:.4f}", refresh=False)

    def done(self, i: int, r: Result, k: int, n: int) -> None:
        if self.enabled:
            self.bars[i].set_postfix(acc=f"{100 * r.test_acc:.1f}%", time=f"{r.seconds:.1f}s")
        else:
            print(
                f"[{k:2d}/{n}] {r.cfg.name:<20} test accuracy {100 * r.test_acc:5.1f}%  ({r.seconds:.1f} s)",
                flush=True,
            )

    def close(self) -> None:
        for b in self.bars:
            b.close()


async def evaluate(model: nn.Module, cfg: Config, X: np.ndarray, y: np.ndarray) -> float:
    """Test accuracy (eval mode, no graph)."""
    model.eval()
    with ag.no_grad():
        logits = model(ag.tensor(_shape_input(cfg, X)))
    await logits.ready()  # wait without blocking the loop, then read
    model.train()
    return float((logits.numpy().argmax(axis=1) == y).mean())


async def train_one(
    i: int,
    cfg: Config,
    model: nn.Module,
    data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    bars: _Bars,
    results: list[Result],
    seed: int,
) -> None:
    """One training: a plain training loop, written with ``await`` where it waits."""
    Xtr, Xte, ytr, yte = data
    Xin = _shape_input(cfg, Xtr)
    opt = make_optimizer(cfg, model)
    rng = np.random.default_rng(seed + i)
    res = results[i]
    res.params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    n = len(Xtr)
    for epoch in range(cfg.epochs):
        order = rng.permutation(n)
        losses = []
        for s in range(0, n, cfg.batch):
            idx = order[s : s + cfg.batch]
            x = ag.tensor(Xin[idx])
            loss = F.cross_entropy(model(x), ytr[idx])
            await loss.backward()  # the loop serves the other trainings while this one's kernels run
            opt.step()  # queues one fused in-place kernel per parameter, after the backward
            opt.zero_grad()
            losses.append(loss.detach())
            bars.update(i)
        vals = [(await t.ready()).item() for t in losses]  # the async form: the loop keeps serving
        res.step_losses += vals
        res.epoch_losses.append(float(np.mean(vals)))
        bars.epoch(i, epoch + 1, res.epoch_losses[-1])
    res.test_acc = await evaluate(model, cfg, Xte, yte)
    res.seconds = time.perf_counter() - t0


REPORT_EVERY = 8  # steps per streamed report: progress stays smooth, messages stay few


async def train_trial(trial: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One training in a worker process (the population's ``train``): streams its step losses back."""
    cfg = Config(**job["cfg"])
    i, seed = job["index"], job["seed"]
    # the parent's copy of the data comes with the job (arrays travel as arrays, not pickled): a worker
    # needs no sklearn of its own; a job without it (another caller) loads it here
    data = tuple(np.asarray(a) for a in job["data"]) if "data" in job else load_data(seed)
    ag.manual_seed(seed * 1000 + i)
    model = build(cfg, seed=seed * 1000 + i)
    res = Result(cfg)

    class _Reporter:
        """Stands in for the bars: losses go to the parent in reports of REPORT_EVERY steps."""

        def __init__(self) -> None:
            self.pending = 0

        def update(self, i: int, n: int = 1) -> None:
            self.pending += n

        def epoch(self, i: int, epoch: int, loss: float) -> None:
            pass

    rep = _Reporter()
    sent = 0

    async def flush(epoch: int) -> None:
        nonlocal sent
        new = res.step_losses[sent:]
        sent = len(res.step_losses)
        await trial.report(step=sent, losses=new, epoch=epoch, loss=res.epoch_losses[-1])

    # the same loop as in-process, epoch by epoch, reporting after each epoch's losses are read
    Xtr, Xte, ytr, yte = data
    Xin = _shape_input(cfg, Xtr)
    opt = make_optimizer(cfg, model)
    rng = np.random.default_rng(seed + i)
    res.params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    n = len(Xtr)
    for epoch in range(cfg.epochs):
        order = rng.permutation(n)
        losses = []
        for s in range(0, n, cfg.batch):
            idx = order[s : s + cfg.batch]
            loss = F.cross_entropy(model(ag.tensor(Xin[idx])), ytr[idx])
            await loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            rep.update(i)
            if len(losses) % REPORT_EVERY == 0:
                await losses[-1].ready()
                await trial.report(step=sent + len(losses), epoch=epoch, partial=True)
        await losses[-1].ready()
        vals = [t.item() for t in losses]
        res.step_losses += vals
        res.epoch_losses.append(float(np.mean(vals)))
        await flush(epoch + 1)
    res.test_acc = await evaluate(model, cfg, Xte, yte)
    res.seconds = time.perf_counter() - t0
    return {
        "params": res.params, "step_losses": res.step_losses, "epoch_losses": res.epoch_losses,
        "test_acc": res.test_acc, "seconds": res.seconds,
    }


async def main_population(args: argparse.Namespace) -> list[Result]:
    """The trainings over worker processes; one bar per model, fed by the streamed reports."""
    cfgs = population(args.quick)
    results = [Result(c) for c in cfgs]
    finished = 0
    bars: list[_Bars] = []
    box: list[Any] = []  # the data, once loaded
    have_data = trio.Event()

    async def load() -> None:
        # in a thread while the workers start (sklearn's import, ~0.7 s): the jobs carry the data to them
        box.append(await trio.to_thread.run_sync(load_data, args.seed))
        n_train = len(box[0][0])
        steps = [c.epochs * -(-n_train // c.batch) for c in cfgs]
        progress = not args.no_progress and sys.stdout.isatty() and sys.stderr.isatty()
        bars.append(_Bars(cfgs, steps, progress))
        have_data.set()

    async def follow(i: int, run: Any) -> None:
        nonlocal finished
        shown = 0
        async for rep in run.reports():  # as they happen in the worker
            bars[0].update(i, rep["step"] - shown)
            shown = rep["step"]
            if "loss" in rep:
                bars[0].epoch(i, rep["epoch"], rep["loss"])
        out = await run.result()
        r = results[i]
        r.params, r.step_losses, r.epoch_losses = out["params"], out["step_losses"], out["epoch_losses"]
        r.test_acc, r.seconds = out["test_acc"], out["seconds"]
        finished += 1
        bars[0].done(i, r, finished, len(cfgs))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load)
            async with dist.open_population(workers=args.workers) as pop:
                await have_data.wait()
                async with trio.open_nursery() as runs:
                    # the largest first (steps x width): the long trainings do not end up alone at the tail
                    for i in sorted(range(len(cfgs)), key=lambda k: -cfgs[k].epochs * cfgs[k].width / cfgs[k].batch):
                        job = {"cfg": dataclasses.asdict(cfgs[i]), "index": i, "seed": args.seed, "data": box[0]}
                        run = await pop.start(train_trial, job)
                        runs.start_soon(follow, i, run)
    finally:
        if bars:
            bars[0].close()
    return results


def print_table(results: list[Result], wall: float, mode: str) -> None:
    head = (
        f"{'model':<20} {'params':>7} {'optim':>6} {'lr':>7} {'epochs':>6} "
        f"{'final loss':>10} {'test acc':>8} {'time':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        c = r.cfg
        fl = r.epoch_losses[-1] if r.epoch_losses else float("nan")
        print(
            f"{c.name:<20} {r.params:>7d} {c.opt:>6} {c.lr:>7.3g} {c.epochs:>6d} {fl:>10.4f} "
            f"{100 * r.test_acc:>7.1f}% {r.seconds:>6.1f}s"
        )
    print("-" * len(head))
    best = max(results, key=lambda r: r.test_acc)
    print(f"{len(results)} trainings ({mode}): wall time {wall:.1f} s")
    print(f"best: {best.cfg.name} with {100 * best.test_acc:.1f}% test accuracy")


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 1]})
    cmap = plt.get_cmap("tab20")
    for k, r in enumerate(results):
        if not r.step_losses:
            continue
        y = np.asarray(r.step_losses)
        w = max(1, len(y) // 60)
        smooth = np.convolve(y, np.ones(w) / w, mode="valid")
        steps_per_epoch = len(y) / max(1, r.cfg.epochs)
        xs = (np.arange(len(smooth)) + w - 1) / steps_per_epoch
        style = "-" if r.cfg.kind == "mlp" else "--"
        ax1.plot(xs, smooth, style, color=cmap(k % 20), lw=1.4, label=r.cfg.name)
    ax1.set_yscale("log")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("training loss (cross entropy, moving average)")
    ax1.set_title("loss curves (solid: MLPs, dashed: CNNs)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, ncol=2)
    names = [r.cfg.name for r in results]
    accs = [100 * r.test_acc for r in results]
    ax2.barh(names, accs, color=[cmap(k % 20) for k in range(len(results))])
    ax2.set_xlim(min(80.0, min(accs) - 2) if accs else 80.0, 100)
    ax2.axvline(95, color="k", lw=0.8, ls=":")
    ax2.set_xlabel("test accuracy (%)")
    ax2.invert_yaxis()
    ax2.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main(args: argparse.Namespace) -> list[Result]:
    cfgs = population(args.quick)
    data = load_data(args.seed)
    models = []
    for i, c in enumerate(cfgs):
        # one seed per model (as in a worker): the same initial weights in every mode
        ag.manual_seed(args.seed * 1000 + i)
        models.append(build(c, seed=args.seed * 1000 + i))
    steps = [c.epochs * -(-len(data[0]) // c.batch) for c in cfgs]
    progress = not args.no_progress and sys.stdout.isatty() and sys.stderr.isatty()
    bars = _Bars(cfgs, steps, progress)
    results = [Result(c) for c in cfgs]
    finished = 0

    async def run(i: int) -> None:
        nonlocal finished
        await train_one(i, cfgs[i], models[i], data, bars, results, args.seed)
        finished += 1
        bars.done(i, results[i], finished, len(cfgs))

    try:
        if args.sequential:
            for i in range(len(cfgs)):
                await run(i)
        else:
            async with trio.open_nursery() as nursery:
                for i in range(len(cfgs)):
                    nursery.start_soon(run, i)
    finally:
        bars.close()
    return results


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a few-second run: 4 small trainings, 2 epochs")
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bars (also off when not on a terminal)"
    )
    p.add_argument(
        "--out", default=os.path.join("out", "loss_curves.png"), help="where to save the loss-curve PNG"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the data split, initialisations and shuffling"
    )
    p.add_argument(
        "--sequential", action="store_true", help="run the trainings one after another (to compare)"
    )
    p.add_argument(
        "--in-process", action="store_true", help="concurrent tasks in ONE runtime, no worker processes"
    )
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: one per core)")
    p.add_argument("--lanes", type=int, default=None, help="lanes of the CPU device (one-runtime modes)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    opts = {} if args.lanes is None else {"lanes": args.lanes}
    if args.sequential or args.in_process:
        results = ag.run(main, args, **opts)
        mode = "one after another, one runtime" if args.sequential else "concurrently in one runtime"
    else:
        # the parent's runtime only receives results: one lane leaves the cores to the workers
        results = ag.run(main_population, args, lanes=1)
        mode = "population over worker processes"
    wall = time.perf_counter() - t0
    print()
    print_table(results, wall, mode)
    walls_path = os.path.join(os.path.dirname(args.out) or ".", "train_many_walls.json")
    walls: dict[str, float] = {}
    if os.path.exists(walls_path):
        try:
            with open(walls_path) as f:
                walls = json.load(f)
        except (OSError, ValueError):
            walls = {}
    key = f"{mode}{' (quick)' if args.quick else ''}"
    walls[key] = wall
    seq = walls.get(f"one after another, one runtime{' (quick)' if args.quick else ''}")
    if seq is not None and not args.sequential:
        print(f"one after another took {seq:.1f} s (an earlier --sequential run): {seq / wall:.2f}x")
    os.makedirs(os.path.dirname(walls_path) or ".", exist_ok=True)
    with open(walls_path, "w") as f:
        json.dump(walls, f, indent=1)
    plot(results, args.out)
    print(f"loss curves saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
