"""One CPU thread per torch and OpenMP pool, in the test process and every process it starts.

`make unit` runs three pytest workers on CI's two cores, and many tests start engines and stacks
of their own. With torch's default pool (one thread per core) in each of them, OpenMP's threads
spin-wait against each other: on a 2-core machine `tests/scripts/test_seeded_checkpoint.py` took
17 s alone and 644 s inside the parallel suite. The environment is read when torch loads, so it
is set here, before any test module imports torch; a value already set is kept.
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
