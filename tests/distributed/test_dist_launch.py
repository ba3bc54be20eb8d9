"""The launcher's command line, and a plain ``mpiexec -n 2 python script.py`` start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")

from asyncgrad.distributed import launch

from ._launch import SCRIPTS


def test_command_has_what_small_machines_need() -> None:
    cmd = launch.command(2, ["script.py", "--x", "1"])
    assert Path(cmd[0]).name == "mpiexec" and Path(cmd[0]).exists()
    assert cmd[1:3] == ["-n", "2"]
    assert "--oversubscribe" in cmd and cmd[cmd.index("--bind-to") + 1] == "none"
    assert cmd[-5:] == ["-m", "mpi4py", "script.py", "--x", "1"]
    env = launch.environment({"PYTHONPATH": "/elsewhere"})
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(Path(launch.__file__).resolve().parents[2])
    assert env["PYTHONPATH"].endswith(":/elsewhere")


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="-n must be at least 1"):
        launch.command(0, ["s.py"])
    with pytest.raises(ValueError, match="give a script"):
        launch.command(2, [])
    p = subprocess.run([sys.executable, "-m", "asyncgrad.distributed.launch", "-n", "2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "give a script" in p.stderr


def test_plain_mpiexec_python_script_works(tmp_path: Path) -> None:
    script = str(SCRIPTS / "hello.py")
    cmd = [launch.mpiexec_path(), "-n", "2", "--oversubscribe", sys.executable, script, str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=launch.environment())
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "hello.txt").read_text() == "2 3.0"
