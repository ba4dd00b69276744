"""Plot train/test loss and accuracy per epoch: `python scripts/plot.py METRICS -o curves.png`.

The same as `kdist-plot`; needs kdist installed (`pip install -e .`).
"""

import sys

from kdist.cli.plot import main

if __name__ == "__main__":
    sys.exit(main())
