"""`scripts/write_tfrecords.py` (`python -m kdist.cli.write_data`): Fashion-MNIST
(uint8 pixels, int32 labels) or synthetic data of its shapes and any size,
written to TFRecord or `.npy` files (`kdist.datasets.ondisk`).
"""

import argparse
import os
import sys

import numpy as np

from kdist.datasets.ondisk import fashion_mnist_uint8, synthetic_chunks, write
from kdist.datasets.sizes import FASHION_MNIST_TEST


def write_main(argv=None):
    parser = argparse.ArgumentParser(
        prog="write_tfrecords.py",
        description="Write Fashion-MNIST (or synthetic data of its shapes) as TFRecord shard "
                    "files for `scripts/train.py --tfrecords DIR`, or as .npy files.")
    parser.add_argument("folder")
    parser.add_argument("--shards", type=int, default=8, help="train files (default: 8); "
                        "the test set goes in max(1, shards // 4)")
    parser.add_argument("--synthetic", type=int, default=None, metavar="N",
                        help="N synthetic train examples (and --test-examples) instead of "
                             "Fashion-MNIST")
    parser.add_argument("--test-examples", type=int, default=FASHION_MNIST_TEST, metavar="N",
                        help="synthetic test examples (default: %(default)s)")
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST's folder (default: "
                        "found as scripts/train.py finds it)")
    parser.add_argument("--format", choices=("tfrecord", "npy"), default="tfrecord")
    args = parser.parse_args(argv)
    test_shards = max(1, args.shards // 4)
    if args.synthetic:
        splits = {"train": synthetic_chunks(args.synthetic, args.shards),
                  "test": synthetic_chunks(args.test_examples, test_shards, seed=1)}
    else:
        train, test = fashion_mnist_uint8(args.data_dir)
        splits = {name: [tuple(np.array_split(a, shards)[i] for a in arrays)
                         for i in range(shards)]
                  for name, arrays, shards in (("train", train, args.shards),
                                               ("test", test, test_shards))}
    os.makedirs(args.folder, exist_ok=True)
    write(args.folder, {"train": splits["train"]}, args.shards, args.format)
    write(args.folder, {"test": splits["test"]}, test_shards, args.format)
    print(f"wrote {args.folder} ({args.format})")
    return 0


if __name__ == "__main__":
    sys.exit(write_main())
