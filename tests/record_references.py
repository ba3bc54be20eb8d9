"""Record the torch references of the test suite (``tests/references/``), or check that recording again
gives byte-identical files.

    python -m tests.record_references            # record every case anew (needs the compare extra: torch)
    python -m tests.record_references --check    # record into a temporary folder and compare byte for byte
    python -m tests.record_references tests/ops  # only the cases under some paths (pytest arguments)

It runs pytest over the suite with ``ASYNCGRAD_TORCH_REFERENCES=record``: each test that asks for
``torch_ref`` computes its torch values live and writes its case's file. A full recording also removes
the files of cases that no test asks for any more.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests._reference import ENV, ENV_DIR, REFERENCES

ROOT = Path(__file__).resolve().parent.parent


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*.safetensors")} if root.exists() else set()


def _record(into: Path, pytest_args: list[str]) -> int:
    env = dict(os.environ, **{ENV: "record", ENV_DIR: str(into)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="record into a temporary folder and compare bytes")
    ap.add_argument("pytest_args", nargs="*", help="test paths or pytest options (default: the whole suite)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("recording needs torch: python3 -m pip install -e '.[compare]'", file=sys.stderr)
        return 2
    partial = bool(args.pytest_args)
    pytest_args = args.pytest_args or ["tests"]
    with tempfile.TemporaryDirectory(prefix="asyncgrad-refs-") as tmp:
        into = Path(tmp) / "references"
        rc = _record(into, pytest_args)
        if rc not in (0, 1):  # 1: some asyncgrad assertion failed; the torch values are still recorded
            print(f"pytest exited {rc}: nothing copied", file=sys.stderr)
            return rc
        new, old = _files(into), _files(REFERENCES)
        if args.check:
            missing = sorted(old - new) if not partial else []
            extra = sorted(new - old)
            differ = sorted(p for p in new & old if not filecmp.cmp(into / p, REFERENCES / p, shallow=False))
            for what, paths in (("not recorded again", missing), ("not in the repository", extra),
                                ("differ", differ)):
                for p in paths:
                    print(f"{what}: {p}")
            print(f"{len(new)} cases recorded with torch {torch.__version__}: {len(new & old) - len(differ)} "
                  f"byte-identical, {len(differ)} differ, {len(extra)} new, {len(missing)} missing")
            return 1 if (missing or extra or differ or rc) else 0
        for p in new:
            (REFERENCES / p).parent.mkdir(parents=True, exist_ok=True)
            (REFERENCES / p).write_bytes((into / p).read_bytes())
        stale = sorted(old - new) if not partial else []
        for p in stale:
            (REFERENCES / p).unlink()
        print(f"recorded {len(new)} cases with torch {torch.__version__} into {REFERENCES} "
              f"({len(stale)} stale files removed)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
