"""Run a rank script of mpi_scripts/ on 2 ranks with the launcher, as a subprocess, under a timeout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "mpi_scripts"


def launch(script: str, out: Path, *args: str, timeout: float = 120.0, n: int = 2) -> subprocess.CompletedProcess[str]:
    """``python -m asyncgrad.distributed.launch -n 2 mpi_scripts/<script> <out> <args...>``; killed after
    ``timeout`` seconds (subprocess.TimeoutExpired then fails the test)."""
    cmd = [sys.executable, "-m", "asyncgrad.distributed.launch", "-n", str(n), str(SCRIPTS / script), str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
