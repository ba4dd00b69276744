"""Benchmark kdist against Keras fit: `KERAS_BACKEND=jax python scripts/bench.py --help`."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdist import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.bench_main())
