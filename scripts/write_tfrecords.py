"""Write Fashion-MNIST as TFRecord files: `python scripts/write_tfrecords.py DIR --help`.

Then `python scripts/train.py --tfrecords DIR` streams them (kdist.datasets.ondisk).
"""

import sys

from kdist.cli.write_data import write_main

if __name__ == "__main__":
    sys.exit(write_main())
