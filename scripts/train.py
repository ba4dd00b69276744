"""Train the tutorial CNN data-parallel: `KERAS_BACKEND=jax python scripts/train.py --help`."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdist import cli  # noqa: E402  (imports no framework: flags set devices first)

if __name__ == "__main__":
    sys.exit(cli.main())
