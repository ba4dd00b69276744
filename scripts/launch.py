"""Start N local workers of scripts/train.py: `python scripts/launch.py --workers 2 -- --synthetic`."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdist import launch  # noqa: E402  (imports no framework)

if __name__ == "__main__":
    sys.exit(launch.main())
