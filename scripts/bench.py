"""Benchmark kdist against Keras fit: `KERAS_BACKEND=jax python scripts/bench.py --help`.

The same as `kdist-bench`; needs kdist installed (`pip install -e .`).
"""

import sys

from kdist.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
