"""W9's kernels one by one, this checkout's against another's, alternating in one process (1 BLAS thread).

    python benchmarks/w9_kernels.py --old DIR [--repeats N]

``DIR`` is another checkout (e.g. ``git worktree`` / ``git archive`` of the commit before a change): its
``asyncgrad`` package is copied to a temporary folder as ``asyncgrad_old``, so both versions' ops tables
load side by side. Every case calls a registered op's forward kernel or backward rule directly on numpy
arrays of a W9 model's shapes, old and new in turn, and prints the medians and their ratio (new / old),
after checking that both give the same values.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import ROOT, load_line, say, table

Case = tuple[str, str, str, Callable[[Any], tuple[Any, ...]]]  # label, op, "kernel"/"rule", args builder


def _cases() -> list[Case]:
    r = np.random.default_rng(0)

    def f32(*s: int) -> np.ndarray:
        return r.standard_normal(s, dtype=np.float32)

    conv = {"stride": (1, 1), "padding": (0, 0, 0, 0), "dilation": (1, 1), "groups": 1}
    x1, w1, b1 = f32(64, 1, 28, 28), f32(32, 1, 3, 3), f32(32)
    x2, w2, b2 = f32(64, 32, 26, 26), f32(64, 32, 3, 3), f32(64)
    g1, g2 = f32(64, 32, 26, 26), f32(64, 64, 24, 24)
    xp = np.maximum(f32(64, 64, 24, 24), 0)
    gp = f32(64, 64, 12, 12)
    a_gelu, g_gelu = f32(16, 16, 128), f32(16, 16, 128)
    x_ln, w_ln, b_ln, g_ln = f32(16, 16, 32), f32(32), f32(32), f32(16, 16, 32)
    q, k, v, g_at = f32(16, 2, 16, 16), f32(16, 2, 16, 16), f32(16, 2, 16, 16), f32(16, 2, 16, 16)
    x_lin, w_lin, b_lin, g_lin = f32(35, 20, 200), f32(10000, 200) * 0.05, f32(10000), f32(35, 20, 10000)
    x_dr = f32(64, 9216)
    x_rn, h0, c0 = f32(35, 20, 200), np.zeros((20, 200), np.float32), np.zeros((20, 200), np.float32)
    wih, whh, bih, bhh = f32(800, 200) * 0.07, f32(800, 200) * 0.07, f32(800) * 0.07, f32(800) * 0.07
    pool = {"kernel": (2, 2), "stride": (2, 2), "dilation": (1, 1), "padding": (0, 0, 0, 0), "out": (12, 12),
            "pool_pad": (0, 0)}

    def rule(g: Any, args: tuple[Any, ...], kw: dict[str, Any], needs: tuple[bool, ...], out: Any = None) -> Any:
        return lambda pkg: (pkg.NP, g, args, out, kw, needs)

    def rnn_rule(pkg: Any) -> tuple[Any, ...]:
        kw = {"mode": "lstm", "reverse": False}
        op = pkg.OPS["recurrent_layer"]
        out = op.kernel(x_rn, h0, c0, wih, whh, bih, bhh, None, **kw)
        g = np.random.default_rng(1).standard_normal(out.shape, dtype=np.float32)
        return (pkg.NP, g, [x_rn, h0, c0, wih, whh, bih, bhh, None], out, kw, (True,) * 7 + (False,))

    def gelu_rule(pkg: Any) -> tuple[Any, ...]:
        # with the forward's output, as a training step's backward gets it (a rule may read it)
        out = pkg.OPS["gelu"].kernel(a_gelu, "none")
        return (pkg.NP, g_gelu, (a_gelu,), out, {"approximate": "none"}, (True,))

    sdpa = {"scale": 0.25, "causal": True, "p": 0.0, "seed": 0}
    return [
        ("conv1 forward", "conv2d", "kernel", lambda pkg: (x1, w1, b1, *conv.values())),
        ("conv1 weight grad", "conv2d_weight_grad", "kernel", lambda pkg: (x1, g1, w1.shape, *conv.values())),
        ("conv2 forward", "conv2d", "kernel", lambda pkg: (x2, w2, b2, *conv.values())),
        ("conv2 input grad", "conv2d_input_grad", "kernel", lambda pkg: (g2, w2, x2.shape, *conv.values())),
        ("conv2 weight grad", "conv2d_weight_grad", "kernel", lambda pkg: (x2, g2, w2.shape, *conv.values())),
        ("max_pool2d backward", "max_pool2d", "rule", rule(gp, (xp,), {"geom": pool}, (True,))),
        ("dropout forward (fc1)", "dropout", "kernel", lambda pkg: (x_dr, 0.5, 7)),
        ("gelu forward", "gelu", "kernel", lambda pkg: (a_gelu, "none")),
        ("gelu backward", "gelu", "rule", gelu_rule),
        ("layer_norm backward", "layer_norm", "rule",
         rule(g_ln, (x_ln, w_ln, b_ln), {"axes": (2,), "eps": 1e-5}, (True, True, True))),
        ("sdpa forward (causal)", "scaled_dot_product_attention", "kernel", lambda pkg: (q, k, v, None)),
        ("sdpa backward (causal)", "scaled_dot_product_attention", "rule",
         rule(g_at, (q, k, v, None), sdpa, (True, True, True, False))),
        ("linear forward (LSTM decoder)", "linear", "kernel", lambda pkg: (x_lin, w_lin, b_lin)),
        ("linear backward (LSTM decoder)", "linear", "rule",
         rule(g_lin, (x_lin, w_lin, b_lin), {}, (True, True, True))),
        ("LSTM layer forward", "recurrent_layer", "kernel",
         lambda pkg: (x_rn, h0, c0, wih, whh, bih, bhh, None, "lstm", False)),
        ("LSTM layer backward", "recurrent_layer", "rule", rnn_rule),
    ]


class _Pkg:
    def __init__(self, name: str) -> None:
        self.OPS = importlib.import_module(f"{name}.runtime._op").OPS
        self.NP = importlib.import_module(f"{name}.runtime._xp").NP


def _call(pkg: _Pkg, op: str, kind: str, args: tuple[Any, ...]) -> Any:
    o = pkg.OPS[op]
    if kind == "kernel":
        if op == "scaled_dot_product_attention":
            return o.kernel(*args, scale=0.25, causal=True, p=0.0, seed=0)
        return o.kernel(*args)
    return o.rule(*args)


def _values(res: Any) -> list[np.ndarray]:
    items = res if isinstance(res, tuple) else (res,)
    return [np.asarray(a) for a in items if a is not None]


def _rel_diff(x: np.ndarray, y: np.ndarray) -> float:
    """max |x - y| / (1 + max |x|), after summing a broadcast gradient down to the other's shape (a rule may
    leave that sum to the engine)."""
    if x.shape != y.shape:
        x, y = (x, y) if x.size > y.size else (y, x)
        x = x.reshape(-1, *y.shape).sum(0)
    return float(np.max(np.abs(x.astype(np.float64) - y))) / (1.0 + float(np.max(np.abs(x))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="another checkout (its asyncgrad/ is compared)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    tmp = tempfile.mkdtemp(prefix="w9k-")
    try:
        shutil.copytree(os.path.join(args.old, "asyncgrad"), os.path.join(tmp, "asyncgrad_old"))
        sys.path.insert(0, tmp)
        old, new = _Pkg("asyncgrad_old"), _Pkg("asyncgrad")
        say(f"W9 kernels: {ROOT} (new) against {args.old} (old), 1 BLAS thread, {args.repeats} alternating "
            f"repeats; {load_line()}")
        rows = []
        with threadpool_limits(limits=1, user_api="blas"):
            for label, op, kind, build in _cases():
                a_old, a_new = build(old), build(new)
                r_old, r_new = _call(old, op, kind, a_old), _call(new, op, kind, a_new)
                vo, vn = _values(r_old), _values(r_new)
                err = max((_rel_diff(x, y) for x, y in zip(vo, vn)), default=0.0)
                to, tn, co, cn = [], [], [], []
                for _ in range(args.repeats):
                    for res, cpu, pkg, a in ((to, co, old, a_old), (tn, cn, new, a_new)):
                        t, c = time.perf_counter(), time.thread_time()
                        _call(pkg, op, kind, a)
                        cpu.append(time.thread_time() - c)
                        res.append(time.perf_counter() - t)
                mo, mn = statistics.median(to) * 1e3, statistics.median(tn) * 1e3
                # the kernels run on this thread (one BLAS thread): its CPU time is what descheduling by other
                # processes on a loaded machine does not inflate
                cpo, cpn = statistics.median(co) * 1e3, statistics.median(cn) * 1e3
                rows.append([label, f"{mo:.3f}", f"{mn:.3f}", f"{mn / mo:.2f}x", f"{cpo:.3f}", f"{cpn:.3f}",
                             f"{cpn / cpo:.2f}x", f"{err:.1e}"])
                say(f"  {label}: old {mo:.3f} ms, new {mn:.3f} ms (CPU {cpo:.3f} / {cpn:.3f} ms)")
        say(table(["kernel", "old ms (median)", "new ms", "new/old", "old CPU ms", "new CPU ms", "CPU new/old",
                   "rel. diff"], rows))
        say(f"  {load_line()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
