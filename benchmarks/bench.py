#!/usr/bin/env python3
"""asyncgrad's benchmark runner: each workload does the same work with asyncgrad and with the anchors
(numpy by hand = the floor; PyTorch CPU when importable; HIPS autograd and mygrad when installed) side by
side in one invocation, and prints absolute figures, ratios measured in the same run, and the BLAS kernel.

    python3 benchmarks/bench.py                 # all workloads (W1..W8, LOAD)
    python3 benchmarks/bench.py W1 W2 --quick   # some, with fewer repeats
    python3 benchmarks/bench.py --json out.json

Workloads are defined in benchmarks/README.md. Run by hand; nothing here is part of the test suite.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import blas_info, env_lines, have, load_line, say, short_error, steady_malloc, torch_blas_line

WORKLOADS = {
    "W1": "w1_mlp_step",
    "W2": "w2_node_overhead",
    "W3": "w3_many_trainings",
    "W4": "w4_reentrant_chain",
    "W5": "w5_loop_stall",
    "W5M": "w5_mechanisms",
    "W6": "w6_rpc",
    "W7": "w7_ddp",
    "W8": "w8_dist_autograd",
    "W9": "w9_real_models",
    "CAPTURE": "wc_capture",
    "LOAD": "load_steps",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", metavar="W", help="workloads to run: W1..W8, LOAD (default: all)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes (~2 min for all)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    ap.add_argument("--compare-with", metavar="DIR", help="W1/W2 only (W9: counted only): asyncgrad of "
                    "this checkout against the one in DIR (another checkout), in alternating fresh interpreters")
    ap.add_argument("--instructions", action="store_true", help="with --compare-with: also count the "
                    "instructions per W1 step, per W2 node and per W9 char GPT replay of both (valgrind's "
                    "callgrind; a few minutes)")
    ap.add_argument("--depth", type=int, default=None, help="W4 depth (default 100000; 10000 with --quick)")
    args = ap.parse_args(argv)
    chosen = [w.upper() for w in args.workloads] or list(WORKLOADS)
    bad = [w for w in chosen if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown workload(s) {bad}; choose from {list(WORKLOADS)}")

    if args.compare_with:
        import _compare

        say("asyncgrad benchmarks: new against old code" + (" (--quick)" if args.quick else ""))
        for line in env_lines():
            say("  " + line)
        picked = [w for w in chosen if w in ("W1", "W2", "W9")] or ["W1", "W2"]
        if "W9" in picked and not args.instructions:
            ap.error("--compare-with W9 counts instructions only: add --instructions")
        res = _compare.run(args.compare_with, picked, quick=args.quick, count=args.instructions)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return 0
    say("asyncgrad benchmarks" + (" (--quick)" if args.quick else ""))
    env = [*env_lines(), steady_malloc()]
    for line in env:
        say("  " + line)
    report: dict[str, object] = {"quick": args.quick, "env": env, "blas": blas_info()}
    report["workloads"] = {}
    if have("torch"):
        tl = torch_blas_line()
        say("  " + tl)
        report["torch"] = tl
    else:
        say("  torch: not importable (pip install torch==2.13.0 for the PyTorch anchors)")
    for opt in ("autograd", "mygrad"):
        say(f"  {opt}: {'installed' if have(opt) else 'not installed (skipped)'}")
    t_all = time.perf_counter()
    failed = []
    for w in chosen:
        say()
        t = time.perf_counter()
        try:
            mod = importlib.import_module(WORKLOADS[w])
            kw = {"depth": args.depth} if w == "W4" else {}
            res = mod.run(quick=args.quick, **kw)
        except Exception as e:  # a broken workload must not hide the others
            say(f"{w}: FAILED {short_error(e, 400)}")
            traceback.print_exc()
            res = {"error": short_error(e, 400)}
            failed.append(w)
        res["wall_s"] = time.perf_counter() - t  # type: ignore[index]
        report["workloads"][w] = res  # type: ignore[index]
        say(f"  [{w} took {res['wall_s']:.0f} s; {load_line()}]")  # type: ignore[index]
    say()
    crashed = f"; workloads that crashed: {failed}" if failed else ""
    say(f"done in {time.perf_counter() - t_all:.0f} s{crashed}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        say(f"figures written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
