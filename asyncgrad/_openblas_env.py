"""OpenBLAS reads its pool's spin from the environment when it loads. When ``import asyncgrad`` is what loads
numpy, numpy loads here with asyncgrad's spin (`devices._blas.POOL_SPIN_EXPONENT`, which says why) and the
variable is removed again, so the process's environment is as it was. With numpy loaded before, the first
runtime restarts the pool instead (`devices._blas.shorten_pool_spin`). A user's own
``OPENBLAS_THREAD_TIMEOUT`` is kept either way.
"""

import os
import sys

SPIN_EXPONENT = 22  # log2 TSC cycles (why: devices._blas)
SPIN_VAR = "OPENBLAS_THREAD_TIMEOUT"

_set_here = SPIN_VAR not in os.environ and "numpy" not in sys.modules
if _set_here:
    os.environ[SPIN_VAR] = str(SPIN_EXPONENT)
try:
    import numpy  # noqa: F401  (loads OpenBLAS, which reads the variable as it starts its pool)
finally:
    if _set_here:
        del os.environ[SPIN_VAR]
