"""Start N local training workers: `python scripts/launch.py --workers 2 -- --synthetic`.

The same as `kdist-launch`; needs kdist installed (`pip install -e .`).
"""

import sys

from kdist.cli.launch import main  # Imports no framework.

if __name__ == "__main__":
    sys.exit(main())
