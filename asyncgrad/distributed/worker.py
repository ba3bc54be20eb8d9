"""The worker entry point: ``python -m asyncgrad.distributed.worker --connect HOST:PORT --token-file FILE``.

See `asyncgrad.distributed._worker` for what a worker does.
"""

from __future__ import annotations

import sys

from ._worker import main

if __name__ == "__main__":
    sys.exit(main())
