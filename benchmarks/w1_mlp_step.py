"""W1 mlp-step: MLP 784-512-512-10, ReLU, batch 128, float32, softmax cross-entropy, SGD step.

Figures: steps/s (median and best of interleaved repeats) and peak RSS (each contender in a fresh child
process). Contenders: numpy by hand (the floor, measured outside any asyncgrad runtime with the default
BLAS threads), asyncgrad with lanes=1 and with the default lanes (eager, and under ``ag.compile``), PyTorch
CPU, HIPS autograd if installed.
Before timing, every contender trains 3 steps from the same start and its parameters are compared with
the floor's, so the table compares the same work.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from _common import (
    Failed,
    blas_info,
    fmt,
    have,
    median,
    minor_faults,
    peak_rss_mb,
    ru_maxrss_mb,
    run_child,
    say,
    table,
)

B, D, H, C = 128, 784, 512, 10
LR = 0.01
CHECK_STEPS = 3


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((B, D), dtype=np.float32), rng.integers(0, C, B)


def init() -> list[np.ndarray]:
    r = np.random.default_rng(1)
    return [r.standard_normal(s, dtype=np.float32) * 0.05 for s in [(D, H), (H,), (H, H), (H,), (H, C), (C,)]]


# ---- numpy by hand: the floor ---------------------------------------------------------------------


class NumpyMLP:
    def __init__(self) -> None:
        self.X, self.Y = data()
        self.P = init()
        self.ar = np.arange(B)

    def step(self) -> None:
        X, Y, ar = self.X, self.Y, self.ar
        W1, b1, W2, b2, W3, b3 = P = self.P
        h1p = X @ W1 + b1
        h1 = np.maximum(h1p, 0)
        h2p = h1 @ W2 + b2
        h2 = np.maximum(h2p, 0)
        z = h2 @ W3 + b3
        z = z - z.max(1, keepdims=True)
        e = np.exp(z)
        p = e / e.sum(1, keepdims=True)
        g = p
        g[ar, Y] -= 1
        g /= B
        gW3 = h2.T @ g
        gb3 = g.sum(0)
        gh2 = g @ W3.T
        gh2[h2p <= 0] = 0
        gW2 = h1.T @ gh2
        gb2 = gh2.sum(0)
        gh1 = gh2 @ W2.T
        gh1[h1p <= 0] = 0
        gW1 = X.T @ gh1
        gb1 = gh1.sum(0)
        for p_, g_ in zip(P, [gW1, gb1, gW2, gb2, gW3, gb3]):
            p_ -= LR * g_

    def params(self) -> list[np.ndarray]:
        return [p.copy() for p in self.P]


# ---- PyTorch --------------------------------------------------------------------------------------


class TorchMLP:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        X, Y = data()
        self.P = [torch.tensor(p, requires_grad=True) for p in init()]
        self.x, self.y = torch.tensor(X), torch.tensor(Y)

    def step(self) -> None:
        torch = self.torch
        W1, b1, W2, b2, W3, b3 = self.P
        h = torch.relu(self.x @ W1 + b1)
        h = torch.relu(h @ W2 + b2)
        z = h @ W3 + b3
        loss = torch.nn.functional.cross_entropy(z, self.y)
        loss.backward()
        with torch.no_grad():
            for p in self.P:
                p -= LR * p.grad
                p.grad = None

    def params(self) -> list[np.ndarray]:
        return [p.detach().numpy().copy() for p in self.P]


# ---- HIPS autograd (only when installed) ----------------------------------------------------------


class HipsMLP:
    def __init__(self) -> None:
        import autograd.numpy as anp
        from autograd import grad

        X, Y = data()
        self.P = init()

        def loss(P: list[Any]) -> Any:
            W1, b1, W2, b2, W3, b3 = P
            h = anp.maximum(anp.dot(X, W1) + b1, 0)
            h = anp.maximum(anp.dot(h, W2) + b2, 0)
            z = anp.dot(h, W3) + b3
            z = z - anp.max(z, 1, keepdims=True)
            lp = z - anp.log(anp.sum(anp.exp(z), 1, keepdims=True))
            return -anp.mean(lp[anp.arange(B), Y])

        self.g = grad(loss)

    def step(self) -> None:
        gs = self.g(self.P)
        for p_, g_ in zip(self.P, gs):
            p_ -= LR * g_

    def params(self) -> list[np.ndarray]:
        return [p.copy() for p in self.P]


# ---- asyncgrad ------------------------------------------------------------------------------------


def ag_loss_fn() -> tuple[Any, str]:
    """The library's fused cross-entropy if it has one, else log_softmax + integer-array indexing."""
    import importlib

    import asyncgrad as ag

    ce = getattr(ag, "cross_entropy", None)
    name = "ag.cross_entropy"
    if ce is None:
        try:
            ce = importlib.import_module("asyncgrad.nn.functional").cross_entropy
            name = "ag.nn.functional.cross_entropy"
        except Exception:
            ce = None
    if ce is not None:
        return (lambda z, y, idx: ce(z, y)), name

    def loss(z: Any, y: Any, idx: Any) -> Any:
        return -ag.log_softmax(z, 1)[idx, y].mean()

    return loss, "-ag.log_softmax(z, 1)[ag.arange(B), y].mean()"


class AgMLP:
    """Build inside an open runtime; `await step()` trains one step and waits for its work."""

    def __init__(self) -> None:
        import asyncgrad as ag

        self.ag = ag
        X, Y = data()
        self.P = [ag.tensor(p, requires_grad=True) for p in init()]
        self.x, self.y = ag.tensor(X), ag.tensor(Y)
        self.idx = ag.arange(B)
        self.loss_fn, _ = ag_loss_fn()

    async def step(self, *, wait: bool = True) -> None:
        """One training step; with ``wait``, also wait until its kernels (the updates too) have run.

        Without ``wait`` this is the loop a user writes: ``await loss.backward()`` bounds how far the
        recording runs ahead of the kernels (one step), and `sync` at the end of the timed window waits for
        the rest, so the timing still covers all the work of every step (as the anchors time n steps).
        """
        ag = self.ag
        W1, b1, W2, b2, W3, b3 = self.P
        h = ag.relu(self.x @ W1 + b1)
        h = ag.relu(h @ W2 + b2)
        z = h @ W3 + b3
        loss = self.loss_fn(z, self.y, self.idx)
        await loss.backward()
        with ag.no_grad():
            for p in self.P:
                p -= LR * p.grad
                p.grad = None
        if wait:
            await loss.ready()
            await self.sync()

    async def sync(self) -> None:
        """Wait until every queued update of the parameters has run."""
        for p in self.P:
            await p.ready()

    def params(self) -> list[np.ndarray]:
        return [p.numpy().copy() for p in self.P]


def ag_run(lanes: int | None, fn: Any) -> Any:
    """``await fn(model, rt)`` inside a fresh runtime with ``lanes``."""
    import trio

    import asyncgrad as ag

    async def main() -> Any:
        async with ag.open_runtime(lanes=lanes) as rt:
            return await fn(AgMLP(), rt)

    return trio.run(main)


def _stepper(m: AgMLP, compiled: bool = False, wait: bool = False) -> Any:
    """``await f()`` trains one step: `AgMLP.step` (with ``wait``, also waiting for its kernels), or its
    ``ag.compile``."""

    async def step() -> None:
        await m.step(wait=wait)

    return m.ag.compile(step) if compiled else step


def ag_repeat(lanes: int | None, warm: int, n: int, wait_each: bool = False,
              compiled: bool = False) -> tuple[float, dict[str, Any]]:
    async def go(m: AgMLP, rt: Any) -> tuple[float, dict[str, Any]]:
        f = _stepper(m, compiled, wait_each)
        for _ in range(warm):
            await f()
            await m.sync()
        t = time.perf_counter()
        for _ in range(n):
            await f()
        await m.sync()
        rate = n / (time.perf_counter() - t)
        b = blas_info()
        return rate, {"lanes": rt.lanes, "blas_threads": b[0].get("num_threads") if b else None}

    return ag_run(lanes, go)  # type: ignore[no-any-return]


def ag_check(lanes: int | None, compiled: bool = False) -> list[np.ndarray]:
    async def go(m: AgMLP, rt: Any) -> list[np.ndarray]:
        f = _stepper(m, compiled)  # compiled: step 1 eager, step 2 recorded, step 3 replayed
        for _ in range(CHECK_STEPS):
            await f()  # as timed: recording runs ahead of the kernels
        await m.sync()
        return m.params()

    return ag_run(lanes, go)  # type: ignore[no-any-return]


# ---- peak RSS, one contender per fresh child process ------------------------------------------------


def rss_child(contender: str, steps: int = 20, lanes: int | None = None, wait_each: bool = False,
              compiled: bool = False) -> dict[str, Any]:
    """(child) Build the contender, then train; report peak RSS after setup and after training, and the
    rate and minor page faults of the steps after the first few (a fresh process, glibc's defaults)."""
    warm = min(3, steps - 1)

    def result(base: float, t: float, f: int) -> dict[str, Any]:
        timed = steps - warm
        return {"base_mb": base, "peak_mb": peak_rss_mb(), "ru_maxrss_mb": ru_maxrss_mb(),
                "steps_per_s": timed / (time.perf_counter() - t), "faults_per_step": (minor_faults() - f) / timed}

    if contender == "asyncgrad":

        async def go(m: AgMLP, rt: Any) -> dict[str, Any]:
            base = peak_rss_mb()
            step = _stepper(m, compiled, wait_each)
            for _ in range(warm):
                await step()
                await m.sync()
            t, f = time.perf_counter(), minor_faults()
            for _ in range(steps - warm):
                await step()
            await m.sync()
            return result(base, t, f)

        return ag_run(lanes, go)  # type: ignore[no-any-return]
    cls = {"numpy": NumpyMLP, "torch": TorchMLP, "autograd": HipsMLP}[contender]
    m = cls()
    base = peak_rss_mb()
    for _ in range(warm):
        m.step()
    t, f = time.perf_counter(), minor_faults()
    for _ in range(steps - warm):
        m.step()
    return result(base, t, f)


# ---- the workload ---------------------------------------------------------------------------------


def _rate(model: Any, warm: int, n: int) -> float:
    for _ in range(warm):
        model.step()
    t = time.perf_counter()
    for _ in range(n):
        model.step()
    return n / (time.perf_counter() - t)


def _rate_blas1(model: Any, warm: int, n: int) -> float:
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return _rate(model, warm, n)


def run(quick: bool = False) -> dict[str, Any]:
    from _common import interleave

    rounds, n, warm = (3, 30, 3) if quick else (11, 60, 5)
    cores = os.cpu_count() or 1
    say(f"W1 mlp-step: MLP {D}-{H}-{H}-{C} ReLU, batch {B}, float32, softmax CE, SGD; "
        f"{rounds} interleaved rounds x {n} steps (+{warm} warm-up)")
    _, loss_name = ag_loss_fn()
    say(f"  asyncgrad loss: {loss_name}")

    # contender name -> (label, factory for in-process timing, RSS child kwargs)
    extra: dict[str, dict[str, Any]] = {}
    contenders: dict[str, Any] = {}
    floor = NumpyMLP()
    contenders["numpy (floor)"] = lambda: _rate(floor, warm, n)
    # a second reference: the same numpy with 1 BLAS thread (what asyncgrad's default lanes give each
    # kernel); it also shows how much of a noisy run is OpenBLAS threads fighting other processes
    contenders["numpy, 1 BLAS thread"] = lambda: _rate_blas1(floor, warm, n)

    def ag_c(lanes: int | None, key: str, wait_each: bool = False, compiled: bool = False) -> Any:
        def one() -> float:
            rate, info = ag_repeat(lanes, warm, n, wait_each, compiled)
            extra[key] = info
            return rate

        return one

    default = f"asyncgrad lanes={cores} (default)"
    each = "asyncgrad default, waits each step"
    contenders["asyncgrad lanes=1"] = ag_c(1, "asyncgrad lanes=1")
    contenders[default] = ag_c(None, default)
    # the same, waiting for every step's kernels before recording the next (what this runner timed before)
    contenders[each] = ag_c(None, each, wait_each=True)
    # the captured form (`ag.compile`: one job per step replaying the recorded kernels), as W9 times it
    comp1, comp = "asyncgrad compiled, lanes=1", "asyncgrad compiled, default lanes"
    import asyncgrad as ag

    if hasattr(ag, "compile"):  # (absent in an older checkout this runner may time)
        contenders[comp1] = ag_c(1, comp1, compiled=True)
        contenders[comp] = ag_c(None, comp, compiled=True)
    models: dict[str, Any] = {}
    if have("torch"):
        models["torch"] = TorchMLP()
        contenders["torch"] = lambda: _rate(models["torch"], warm, n)
    else:
        say("  torch: not installed, skipped (pip install torch==2.13.0)")
    if have("autograd"):
        models["autograd"] = HipsMLP()
        contenders["HIPS autograd"] = lambda: _rate(models["autograd"], max(1, warm // 2), max(5, n // 4))
    else:
        say("  HIPS autograd: not installed, skipped")
    rss_args = {
        "numpy (floor)": {"contender": "numpy"},
        "numpy, 1 BLAS thread": {"contender": "numpy"},
        "asyncgrad lanes=1": {"contender": "asyncgrad", "lanes": 1},
        default: {"contender": "asyncgrad", "lanes": None},
        each: {"contender": "asyncgrad", "lanes": None, "wait_each": True},
        comp1: {"contender": "asyncgrad", "lanes": 1, "compiled": True},
        comp: {"contender": "asyncgrad", "lanes": None, "compiled": True},
        "torch": {"contender": "torch"},
        "HIPS autograd": {"contender": "autograd", "steps": 5},
    }

    # same work: 3 steps from the same start, parameters compared with the floor's
    say("  checking that every contender computes the same training (3 steps from the same start)...")
    ref = NumpyMLP()
    for _ in range(CHECK_STEPS):
        ref.step()
    ref_p = ref.params()
    checks: dict[str, str] = {}
    for name in contenders:
        if name.startswith("numpy"):
            continue
        try:
            if name.startswith("asyncgrad"):
                got = ag_check(1 if "lanes=1" in name else None, compiled="compiled" in name)
            else:
                m = {"torch": TorchMLP, "HIPS autograd": HipsMLP}[name]()
                for _ in range(CHECK_STEPS):
                    m.step()
                got = m.params()
            err = max(float(np.max(np.abs(a - b))) for a, b in zip(got, ref_p))
            checks[name] = f"max |param - floor| = {err:.1e}" + ("" if err < 1e-4 else "  << DIFFERS")
        except Exception as e:
            checks[name] = str(Failed(e))
        say(f"    {name}: {checks[name]}")

    say("  timing (interleaved)...")
    res = interleave(contenders, rounds, pause=0.1, log=say)

    say("  peak RSS (each contender alone in a fresh child process, 20 steps)...")
    rss: dict[str, dict[str, Any]] = {}
    for name in contenders:
        if name == "numpy, 1 BLAS thread":
            rss[name] = rss["numpy (floor)"]  # the same program
            continue
        rss[name] = run_child("w1_mlp_step", "rss_child", rss_args[name], timeout=300)

    fl = res["numpy (floor)"]
    fl_med = median(fl) if not isinstance(fl, Failed) and fl else float("nan")
    fl_best = max(fl) if not isinstance(fl, Failed) and fl else float("nan")
    fl_rss = rss["numpy (floor)"].get("peak_mb", float("nan"))
    rows = []
    out: dict[str, Any] = {"rounds": rounds, "steps_per_round": n, "loss": loss_name, "contenders": {}}
    for name, r in res.items():
        rs = rss[name]
        rss_txt = fmt(rs.get("peak_mb"), ".0f") if "error" not in rs else "err"
        info = extra.get(name, {})
        bl = info.get("blas_threads", blas_info()[0].get("num_threads") if blas_info() else "?")
        if name == "numpy, 1 BLAS thread":
            bl = 1
        if name == "torch":
            import torch

            bl = f"{torch.get_num_threads()}(MKL)"
        if isinstance(r, Failed):
            rows.append([name, str(r)])
            out["contenders"][name] = {"error": str(r)}
            continue
        med, best = median(r), max(r)
        # each round's rate over the floor's in the same round (they ran seconds apart): a drift of the
        # shared machine between rounds cancels out of this one
        paired = median([a / f for a, f in zip(r, fl)]) if not isinstance(fl, Failed) and fl else float("nan")
        rows.append(
            [
                name,
                fmt(med, ".1f"),
                fmt(best, ".1f"),
                fmt(med / fl_med, ".2f") + "x",
                fmt(best / fl_best, ".2f") + "x",
                fmt(paired, ".2f") + "x",
                rss_txt,
                fmt(rs.get("peak_mb", float("nan")) / fl_rss, ".2f") + "x" if "error" not in rs else "-",
                str(bl),
            ]
        )
        out["contenders"][name] = {
            "steps_per_s": r,
            "median": med,
            "best": best,
            "ratio_median_vs_floor": med / fl_med,
            "ratio_best_vs_floor": best / fl_best,
            "ratio_paired_median_vs_floor": paired,
            "rss": rs,
            "blas_threads": bl,
            "check": checks.get(name, "reference"),
        }
    say()
    say(table(["contender", "steps/s med", "best", "/floor med", "/floor best", "/floor paired", "peakRSS MB",
               "RSS/floor", "BLAS thr"], rows))
    for name, rs in rss.items():
        if "error" in rs:
            say(f"  RSS child for {name}: {rs['error']}")
    say("  alone in a fresh process (the RSS children, glibc malloc left dynamic; steps 4-20, one run each):")
    for name, rs in rss.items():
        if "steps_per_s" in rs and name != "numpy, 1 BLAS thread":
            say(f"    {name:36s} {rs['steps_per_s']:7.1f} steps/s  {rs['faults_per_step']:7.0f} minor page faults/step")
    noisy = fl_med == fl_med and fl_best / fl_med > 1.3
    if noisy:
        from _common import load_line

        say(f"  NOISY: the floor's best is {fl_best / fl_med:.1f}x its median ({load_line()}); other work "
            "shares the cores and 2-thread BLAS collapses under it, so these ratios are not a verdict: rerun")
    out["floor_best_over_median"] = fl_best / fl_med
    ag_def = out["contenders"].get(default, {})
    ag_1 = out["contenders"].get("asyncgrad lanes=1", {})
    verdict = " (not judged: NOISY)" if noisy else ""
    for key, label in (
        ("ratio_median_vs_floor", "medians"),
        ("ratio_best_vs_floor", "best-of-N"),
        ("ratio_paired_median_vs_floor", "median of per-round ratios"),
    ):
        d, o = ag_def.get(key, float("nan")), ag_1.get(key, float("nan"))
        best_ag = max(d, o)
        # three decimals: 0.8988 must not print as a "0.90x" that is then called NOT met
        say(f"  target: asyncgrad >= 0.90x the floor ({label}) -> default lanes {d:.3f}x, lanes=1 {o:.3f}x "
            f"({'met' if best_ag >= 0.9 else 'NOT met'}){verdict}")
    one = out["contenders"].get("numpy, 1 BLAS thread", {})
    if "median" in one and "median" in ag_def:
        say(f"  like for like (1 BLAS thread per kernel): asyncgrad default lanes / numpy 1 BLAS thread = "
            f"{ag_def['median'] / one['median']:.2f}x (medians), {ag_def['best'] / one['best']:.2f}x (best)")
    tr = res.get("torch")
    if isinstance(tr, list) and tr:
        # issue 21's bar: asyncgrad's steps/s at least torch's, each round's rate over torch's in that round
        vs: dict[str, float] = {}
        for name, r in res.items():
            if name.startswith("asyncgrad") and isinstance(r, list) and r:
                vs[name] = median([a / b for a, b in zip(r, tr)])
        out["paired_vs_torch"] = vs
        if vs:
            best_name = max(vs, key=lambda k: vs[k])
            say("  vs torch (median of per-round ratios): "
                + ", ".join(f"{k.removeprefix('asyncgrad ')} {v:.3f}x" for k, v in vs.items()))
            say(f"  target: asyncgrad >= torch's steps/s -> best {best_name} {vs[best_name]:.3f}x "
                f"({'met' if vs[best_name] >= 1.0 else 'NOT met'}){verdict}")
    return out
