"""Run one benchmark function in a fresh interpreter: ``python _child.py MODULE FUNC JSON_KWARGS``.

Used for figures a shared process would spoil: peak RSS per contender, OS threads, and runs that may
crash or need a high recursion limit (torch's reentrant chain). Prints the result as one marked JSON line.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RESULT_MARK, ensure_paths, short_error

ensure_paths()


def main() -> None:
    module, func, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    try:
        result = getattr(importlib.import_module(module), func)(**kwargs)
    except BaseException as e:
        result = {"error": short_error(e, 300)}
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    # skip interpreter teardown (torch's thread pools, a deep chain of objects): the figures are out
    os._exit(0)


if __name__ == "__main__":
    main()
