#!/usr/bin/env python3
"""Start-up costs: ``import asyncgrad`` in a fresh interpreter, and the demo's wall time with a cold and a
warm compiled-kernel cache, beside the same with compiled kernels off (``ASYNCGRAD_JIT=0``).

    python3 benchmarks/startup.py                 # import best of 5; the demo (--quick) cold, warm, JIT off
    python3 benchmarks/startup.py --full-demo     # the full demo instead of its --quick form (~1 min each)
    python3 benchmarks/startup.py --repeats 9

Each figure is a fresh interpreter. A cold cache is an empty ``ASYNCGRAD_CACHE_DIR`` (every kernel the run
uses compiles); warm reuses the directory the cold run filled. Run by hand; absolute times drift on a
shared machine, so the three demo variants alternate, round by round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env(root: Path = ROOT, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("ASYNCGRAD_JIT", "ASYNCGRAD_CACHE_DIR", "NUMBA_CACHE_DIR")}
    e["PYTHONPATH"] = str(root)
    e.update(extra)
    return e


def _which(env: dict[str, str]) -> str:
    code = "import asyncgrad, os; print(os.path.dirname(os.path.dirname(asyncgrad.__file__)))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          cwd=env["PYTHONPATH"]).stdout.strip()


def import_ms(env: dict[str, str]) -> float:
    code = "import time; t = time.perf_counter(); import asyncgrad; print((time.perf_counter() - t) * 1000)"
    # (run in the checkout: `python -c` puts the working directory first on sys.path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=env["PYTHONPATH"])
    return float(out.stdout.strip())


def demo_s(env: dict[str, str], full: bool, root: Path = ROOT) -> float:
    args = [sys.executable, str(root / "examples" / "train_many.py"), "--no-progress"]
    if not full:
        args.append("--quick")
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        subprocess.run([*args, "--out", str(Path(out) / "curves.png")], env=env, cwd=root, check=True,
                       stdout=subprocess.DEVNULL)
        return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="import timings (best of) and demo rounds")
    ap.add_argument("--full-demo", action="store_true", help="time the full demo, not --quick")
    ap.add_argument("--old", metavar="DIR", help="another checkout (e.g. a git worktree of an older commit): "
                    "its import and demo are timed too, alternating with this one's")
    a = ap.parse_args()
    old = Path(a.old).resolve() if a.old else None
    if old is not None and _which(_env(old)) != str(old):
        ap.error(f"{old}: PYTHONPATH={old} does not import that checkout's asyncgrad")
    imp, imp_old = [], []
    for _ in range(a.repeats):
        imp.append(import_ms(_env()))
        if old is not None:
            imp_old.append(import_ms(_env(old)))
    print(f"import asyncgrad: best {min(imp):.0f} ms, median {statistics.median(imp):.0f} ms "
          f"({a.repeats} fresh interpreters; target <= 250 ms)")
    if imp_old:
        print(f"import asyncgrad of {old}: best {min(imp_old):.0f} ms, median {statistics.median(imp_old):.0f} ms")
    rounds = max(1, a.repeats // 2)
    cold: list[float] = []
    warm: list[float] = []
    off: list[float] = []
    before: list[float] = []
    for _ in range(rounds):
        if old is not None:
            before.append(demo_s(_env(old), a.full_demo, old))
        with tempfile.TemporaryDirectory(prefix="asyncgrad-cache-") as cache:
            cold.append(demo_s(_env(ASYNCGRAD_CACHE_DIR=cache), a.full_demo))
            warm.append(demo_s(_env(ASYNCGRAD_CACHE_DIR=cache), a.full_demo))
        off.append(demo_s(_env(ASYNCGRAD_JIT="0"), a.full_demo))
    which = "demo" if a.full_demo else "demo --quick"
    rows = [("compiled kernels, cold cache", cold), ("compiled kernels, warm cache", warm),
            ("ASYNCGRAD_JIT=0 (numpy twins)", off)]
    if before:
        rows.append((f"the old checkout {old}", before))
    for name, xs in rows:
        print(f"{which}, {name}: median {statistics.median(xs):.2f} s, best {min(xs):.2f} s ({len(xs)} rounds)")
    print(f"ratios of medians: cold / JIT off {statistics.median(cold) / statistics.median(off):.2f}x, "
          f"warm / JIT off {statistics.median(warm) / statistics.median(off):.2f}x")
    if before:
        b = statistics.median(before)
        print(f"against the old checkout: cold {statistics.median(cold) / b:.2f}x, "
              f"warm {statistics.median(warm) / b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
