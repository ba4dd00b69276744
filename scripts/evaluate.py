"""Evaluate the newest checkpoint without distribution: `python scripts/evaluate.py --help`.

The same as `kdist-evaluate`; needs kdist installed (`pip install -e .`).
"""

import sys

from kdist.cli import evaluate_main

if __name__ == "__main__":
    sys.exit(evaluate_main())
