"""Write Fashion-MNIST as TFRecord files: `python scripts/write_tfrecords.py DIR --help`.

Then `python scripts/train.py --tfrecords DIR` streams them (kdist.ondisk).
"""

import sys

from kdist.ondisk import write_main

if __name__ == "__main__":
    sys.exit(write_main())
