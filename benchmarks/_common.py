"""Shared helpers of the benchmark runner: interleaved timing, statistics, BLAS info, child processes, tables.

Nothing here knows about a particular workload. Every workload module imports this one.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout whose asyncgrad the benchmarks import: this one, or another one for `--compare-with`
ROOT = os.environ.get("ASYNCGRAD_BENCH_ROOT") or os.path.dirname(HERE)
CHILD = os.path.join(HERE, "_child.py")
RESULT_MARK = "@@BENCH-RESULT "


def ensure_paths() -> None:
    """Make the checkout's `asyncgrad` and the benchmark modules importable (no install needed); the
    checkout goes first, ahead of an installed (or editable) asyncgrad."""
    for p in (ROOT, HERE):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)


ensure_paths()


# ---- optional contenders --------------------------------------------------------------------------


def have(module: str) -> bool:
    """True when ``module`` imports (torch, autograd, mygrad are optional anchors)."""
    try:
        __import__(module)
    except Exception:
        return False
    return True


# ---- BLAS / threading info ------------------------------------------------------------------------


def blas_info() -> list[dict[str, Any]]:
    """threadpoolctl's view of the BLAS libraries loaded in this process (numpy's OpenBLAS here)."""
    try:
        from threadpoolctl import threadpool_info
    except Exception:
        return [{"error": "threadpoolctl not installed"}]
    out = []
    for d in threadpool_info():
        if d.get("user_api") != "blas":
            continue
        out.append(
            {
                "internal_api": d.get("internal_api"),
                "version": d.get("version"),
                "num_threads": d.get("num_threads"),
                "architecture": d.get("architecture"),
                "threading_layer": d.get("threading_layer"),
                "prefix": d.get("prefix"),
            }
        )
    return out


def blas_line(info: list[dict[str, Any]] | None = None) -> str:
    info = blas_info() if info is None else info
    if not info:
        return "BLAS: none found by threadpoolctl"
    parts = []
    for d in info:
        if "error" in d:
            parts.append(d["error"])
            continue
        parts.append(
            f"{d['internal_api']} {d['version']} arch={d['architecture']} threads={d['num_threads']}"
            f" ({d['prefix']}, {d.get('threading_layer')})"
        )
    return "BLAS (numpy): " + "; ".join(parts)


def torch_blas_line() -> str:
    """What torch computes with (MKL / oneDNN are linked statically; threadpoolctl cannot see them)."""
    import torch

    cfg = torch.__config__.show()
    blas = "?"
    for line in cfg.splitlines():
        line = line.strip()
        if line.startswith("- BLAS_INFO=") or "BLAS_INFO=" in line:
            blas = line.split("BLAS_INFO=")[1].split(",")[0]
            break
    par = torch.__config__.parallel_info()
    mkl = next((ln.strip() for ln in par.splitlines() if "Math Kernel Library" in ln), "")
    mkl = mkl.replace("Intel(R) oneAPI Math Kernel Library Version ", "MKL ").split("-Product")[0]
    return (
        f"torch {torch.__version__}: BLAS={blas} {mkl} intra-op threads={torch.get_num_threads()}"
        f" inter-op={torch.get_num_interop_threads()}"
    )


def env_lines() -> list[str]:
    import numpy as np

    lines = [
        f"python {sys.version.split()[0]}  numpy {np.__version__}  cores={os.cpu_count()}"
        f"  OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}"
        f"  OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}"
        f"  OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}  {load_line()}",
        blas_line(),
    ]
    try:
        import trio

        import asyncgrad

        where = os.path.dirname(asyncgrad.__file__)
        lines.append(f"asyncgrad {asyncgrad.__version__} ({where}, {git_rev()})  trio {trio.__version__}")
    except Exception as e:
        lines.append(f"asyncgrad: import failed: {e}")
    return lines


def git_rev() -> str:
    """The checkout's commit, with "+dirty" when asyncgrad/ has uncommitted changes."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "asyncgrad"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "no git") + ("+dirty" if dirty else "")
    except Exception:
        return "no git"


def load_line() -> str:
    """The machine's load average: other work on a shared machine shows up here."""
    try:
        a, b, c = os.getloadavg()
        return f"load average {a:.2f} {b:.2f} {c:.2f}"
    except OSError:
        return "load average n/a"


# ---- the allocator ----------------------------------------------------------------------------------

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
STEADY_MMAP_BYTES = 32 << 20  # glibc's largest allowed mmap threshold on 64-bit
STEADY_TRIM_BYTES = 256 << 20


def steady_malloc() -> str:
    """Pin glibc malloc's mmap and trim thresholds for this process; returns a line for the log.

    Left dynamic, glibc either serves a big numpy temporary (a 256 KB activation, a 1.6 MB gradient) from
    heap memory it kept, or maps fresh pages for it and unmaps them at free, and which one happens depends
    on the heap's history: the same numpy-by-hand W1 step measured ~120 steps/s with ~1500 minor page
    faults per step in a fresh process and ~230 steps/s with none once the heap had grown around it.
    Pinned, every in-process contender runs in the fast state. Child processes (RSS, OS threads) keep
    glibc's defaults.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_BYTES) and libc.mallopt(
            _M_TRIM_THRESHOLD, STEADY_TRIM_BYTES
        )
    except (OSError, AttributeError):  # not glibc
        return "malloc: not glibc, thresholds left as they are"
    if not ok:
        return "malloc: mallopt refused, thresholds left dynamic"
    return (f"malloc: glibc mmap threshold pinned at {STEADY_MMAP_BYTES >> 20} MiB, trim threshold at "
            f"{STEADY_TRIM_BYTES >> 20} MiB (in this process only; see _common.steady_malloc)")


def minor_faults() -> int:
    """Minor page faults of this process so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ---- timing ---------------------------------------------------------------------------------------


class Failed:
    """A contender that raised: the error text, shown in the table instead of a figure."""

    def __init__(self, exc: BaseException) -> None:
        self.kind = type(exc).__name__
        self.message = short_error(exc)
        self.tb = "".join(traceback.format_exception(exc))

    def __str__(self) -> str:
        return f"FAILED {self.kind}: {self.message}"


def short_error(exc: BaseException, n: int = 160) -> str:
    # unwrap trio's ExceptionGroups down to the first leaf
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    msg = f"{type(exc).__name__}: {exc}" if not isinstance(exc, BaseExceptionGroup) else str(exc)
    msg = " ".join(msg.split())
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def interleave(
    contenders: dict[str, Callable[[], Any]],
    rounds: int,
    *,
    pause: float = 0.05,
    log: Callable[[str], None] | None = None,
    budget_s: float | None = None,
) -> dict[str, list[Any] | Failed]:
    """Run one repeat of each contender per round, A,B,C then B,C,A then C,A,B ...

    Interleaving makes slow drifts of a shared machine hit every contender alike; rotating the order
    stops one contender from always running right after another (e.g. after torch's OpenMP threads).
    A contender that raises is marked `Failed` and skipped in later rounds. With ``budget_s``, a
    contender whose repeats have taken longer than that in all gets no further rounds (it keeps the
    repeats it has: a pathologically slow configuration must not eat the whole session).
    """
    names = list(contenders)
    results: dict[str, list[Any] | Failed] = {n: [] for n in names}
    spent = dict.fromkeys(names, 0.0)
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            res = results[name]
            if isinstance(res, Failed) or (budget_s is not None and spent[name] > budget_s):
                continue
            t0 = time.perf_counter()
            try:
                res.append(contenders[name]())
                spent[name] += time.perf_counter() - t0
            except Exception as e:
                results[name] = Failed(e)
                if log:
                    log(f"    {name}: {results[name]}")
            if pause:
                time.sleep(pause)
        if log:
            log(f"    round {r + 1}/{rounds} done")
    return results


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


# ---- child processes (fresh interpreters for peak RSS, threads, crashes) --------------------------


def run_child(
    module: str, func: str, kwargs: dict[str, Any], *, timeout: float, root: str | None = None
) -> dict[str, Any]:
    """Run ``module.func(**kwargs)`` in a fresh interpreter; return its JSON result or an error dict.

    ``root``: the checkout whose asyncgrad the child imports (default: this one).

    The child prints its result as one marked JSON line; a crash, a timeout or a missing line gives
    ``{"error": ...}`` with the tail of its stderr.
    """
    cmd = [sys.executable, CHILD, module, func, json.dumps(kwargs)]
    t = time.perf_counter()
    try:
        env = dict(os.environ, ASYNCGRAD_BENCH_ROOT=root or ROOT)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root or ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
    return {"error": f"child exited with rc={p.returncode}: {tail[-300:]}", "wall_s": time.perf_counter() - t}


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB.

    Read from VmHWM in /proc/self/status (the high-water mark of this process's own memory map). We do
    not use ``getrusage(RUSAGE_SELF).ru_maxrss`` alone: Linux carries the parent's peak across the
    vfork+exec that `subprocess` uses, so a fresh child would report its parent's peak (seen here:
    every child showed the 297 MB of the parent that had imported torch). `ru_maxrss_mb` gives that one.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return ru_maxrss_mb()


def ru_maxrss_mb() -> float:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in MB (Linux reports KiB); see `peak_rss_mb`."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def os_threads() -> int:
    """OS threads alive in this process (Linux)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


# ---- output ---------------------------------------------------------------------------------------


def fmt(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and x != x:
        return "-"
    return format(x, spec)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> str:
    """A plain-text table; cells are preformatted strings (long FAILED cells go last)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r[: len(headers)]):
            if not c.startswith("FAILED"):
                widths[i] = max(widths[i], len(c))
    def line(r: Sequence[str]) -> str:
        return indent + "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
    out = [line(list(headers)), indent + "  ".join("-" * w for w in widths)]
    for r in cells:
        if any(c.startswith("FAILED") for c in r):
            first_failed = next(i for i, c in enumerate(r) if c.startswith("FAILED"))
            out.append(line(r[:first_failed] + [""] * (len(headers) - first_failed)).rstrip())
            out.append(indent + "    " + r[first_failed])
        else:
            out.append(line(r))
    return "\n".join(out)


def say(msg: str = "") -> None:
    print(msg, flush=True)
