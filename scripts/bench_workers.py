"""Workers on loopback against one process, and their communication share:
`KERAS_BACKEND=jax python scripts/bench_workers.py --help`.

The same as `python -m kdist.bench.workers`; needs kdist installed (`pip install -e .`).
"""

import sys

from kdist.bench.workers import main

if __name__ == "__main__":
    sys.exit(main())
