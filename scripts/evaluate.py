"""Evaluate the newest checkpoint without distribution: `python scripts/evaluate.py --help`.

The same as `kdist-evaluate`; needs kdist installed (`pip install -e .`).
"""

import sys

from kdist.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
