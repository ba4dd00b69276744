"""Train the tutorial CNN data-parallel: `KERAS_BACKEND=jax python scripts/train.py --help`.

The same as `kdist-train`; needs kdist installed (`pip install -e .`).
"""

import sys

from kdist.cli.train import main  # Imports no framework: the flags set devices first.

if __name__ == "__main__":
    sys.exit(main())
