"""Evaluate the newest checkpoint without distribution: `python scripts/evaluate.py --help`."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdist import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.evaluate_main())
