"""How compiled kernels are loaded: not at ``import asyncgrad``, compiled on first use into the user's cache
directory (never the package's), and off with ``ASYNCGRAD_JIT=0``. Each check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import asyncgrad

ROOT = Path(__file__).resolve().parent.parent.parent


def _run(code: str, **env: str) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("ASYNCGRAD_JIT", "NUMBA_CACHE_DIR")}
    e.update(env)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_asyncgrad_loads_neither_numba_nor_the_distributed_layer() -> None:
    out = _run(
        "import sys, asyncgrad; "
        "print(sorted(m for m in sys.modules if m == 'numba' or m.startswith(('asyncgrad.distributed', "
        "'asyncgrad.nn.parallel', 'asyncgrad.hosting'))))"
    )
    assert out == "[]"


@pytest.mark.skipif(not asyncgrad.kernels.JIT, reason="compiled kernels are off")
def test_kernels_compile_on_first_use_into_the_user_cache_dir(tmp_path: Path) -> None:
    code = (
        "import numpy as np, sys, asyncgrad as ag\n"
        "from asyncgrad.kernels import K, layer_norm_forward\n"
        "assert 'numba' not in sys.modules\n"
        "x = np.ones((2, 3), np.float32)\n"
        "layer_norm_forward(x, None, None, 1e-5, np.empty_like(x), np.empty(2, x.dtype), np.empty(2, x.dtype))\n"
        "import numba\n"
        "print(K.compiled, numba.config.CACHE_DIR)\n"
    )
    out = _run(code, ASYNCGRAD_CACHE_DIR=str(tmp_path))
    assert out == f"['ln_forward_rows'] {tmp_path / 'numba'}"
    cached = list((tmp_path / "numba").rglob("*.nbi"))
    assert cached, "no numba cache index written"
    pkg = Path(asyncgrad.__file__).parent
    assert not list(pkg.rglob("*.nbi")), "a cache file was written inside the package"
    # a second process loads the cached machine code instead of compiling again
    again = _run(code, ASYNCGRAD_CACHE_DIR=str(tmp_path))
    assert again == out


def test_asyncgrad_jit_0_selects_the_numpy_twins() -> None:
    out = _run(
        "import sys\n"
        "from asyncgrad import kernels\n"
        "from asyncgrad.kernels import _layer_norm, _softmax, _gelu\n"
        "print(kernels.JIT, kernels.layer_norm_forward is _layer_norm._forward_numpy, "
        "kernels.softmax_lastdim_ is _softmax._softmax_numpy, kernels.gelu32 is _gelu._gelu32_numpy)",
        ASYNCGRAD_JIT="0",
    )
    assert out == "False True True True"


@pytest.mark.skipif(not asyncgrad.kernels.JIT, reason="compiled kernels are off")
def test_processes_starting_together_on_a_cold_cache_compile_a_kernel_once(tmp_path: Path) -> None:
    """Two processes make a kernel's first call at the same moment (as a population's workers do): one
    compiles it and writes the cache, the other waits for it and loads the cached code."""
    go = tmp_path / "go"
    code = (
        "import os, sys, time, numpy as np\n"
        "from asyncgrad.kernels import K, layer_norm_forward\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.005)\n"
        "x = np.ones((2, 3), np.float32)\n"
        "layer_norm_forward(x, None, None, 1e-5, np.empty_like(x), np.empty(2, x.dtype), np.empty(2, x.dtype))\n"
        "st = K.ln_forward_rows.stats\n"
        "print(sum(st.cache_misses.values()), sum(st.cache_hits.values()))\n"
    )
    e = {k: v for k, v in os.environ.items() if k not in ("ASYNCGRAD_JIT", "NUMBA_CACHE_DIR")}
    e["ASYNCGRAD_CACHE_DIR"] = str(tmp_path / "cache")
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        go.touch()
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(tuple(int(v) for v in out.split()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(outs) == [(0, 1), (1, 0)], f"(misses, hits) per process: {outs}"
