"""The RPC example runs: it fans work out to workers and gathers tensors back."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rpc_workers_example_runs() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "rpc_workers.py"), "--shards", "4", "--steps", "50"],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "averaged weights" in proc.stdout
    err = float(proc.stdout.split("max |w - true w| = ")[1].split()[0])
    assert err < 0.05


def test_parameter_server_example_learns() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "parameter_server.py"), "--steps", "350"],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    acc = float(proc.stdout.split("held-out accuracy ")[1].split()[0])
    assert acc >= 0.95
