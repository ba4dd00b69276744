"""`python -m kdist`: the training command, the same as `kdist-train` and `scripts/train.py`."""

import sys

from kdist.cli import train  # Imports no framework: the flags set devices first.

if __name__ == "__main__":
    sys.exit(train.main())
