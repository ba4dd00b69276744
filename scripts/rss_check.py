"""Peak memory of one epoch streamed from disk: `python scripts/rss_check.py DIR --scale 10`.

Writes a synthetic set of SCALE x 60,000 examples to DIR first (kdist.datasets.ondisk).
"""

import sys

from kdist.bench.rss import rss_main

if __name__ == "__main__":
    sys.exit(rss_main())
