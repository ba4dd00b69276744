"""Data sets on disk for streaming: the writer of scripts/write_tfrecords.py and the
peak-memory check of scripts/rss_check.py.

`write_main` writes Fashion-MNIST (uint8 pixels, int32 labels) or synthetic
data of its shapes and any size to TFRecord files (`kdist.tfrecords`) or to
`.npy` files that training maps into memory (`np.load(mmap_mode="r")`).
`rss_main` writes such a set in a child process, trains one epoch from it and
prints the process's peak resident memory (`ru_maxrss`): streamed from disk,
it should not grow with the data set.
"""

import argparse
import os
import resource
import shutil
import subprocess
import sys

import numpy as np

from kdist import data

FASHION_TRAIN, FASHION_TEST = 60_000, 10_000


def fashion_mnist_uint8(data_dir=None):
    """((x, y) train, (x, y) test): Fashion-MNIST's uint8 pixels (N, 28, 28, 1)
    and int32 labels (found as `kdist.load_fashion_mnist` finds them)."""
    loaded = data.load_fashion_mnist(data_dir)
    return [(np.round(x * 255).astype(np.uint8), y)  # Undoes its exact / 255.
            for x, y, _ in (loaded.split("train"), loaded.split("test"))]


def synthetic_chunks(examples, chunks, seed=0):
    """`chunks` (x, y) parts of `examples` synthetic uint8 images of Fashion-MNIST's
    shapes (a faint class template, the same for every seed, under noise), made
    one part at a time."""
    templates = np.random.default_rng(0).integers(0, 64, (data.NUM_CLASSES,)  # Every set's.
                                                  + data.IMAGE_SHAPE)
    bounds = np.linspace(0, examples, chunks + 1).astype(int)
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        rng = np.random.default_rng([seed, index])
        labels = rng.integers(0, data.NUM_CLASSES, stop - start).astype(np.int32)
        noise = rng.integers(0, 192, (stop - start,) + data.IMAGE_SHAPE)
        yield (templates[labels] + noise).astype(np.uint8), labels


def write(folder, splits, shards, kind="tfrecord"):
    """Writes `splits`, {"train": chunks, "test": chunks} where chunks is a list
    or iterator of `shards` (x, y) parts, as TFRecord or .npy files in `folder`."""
    from kdist import tfrecords

    for split, chunks in splits.items():
        if kind == "tfrecord":
            tfrecords.write_files(folder, split, chunks, shards)
            continue
        chunks = list(chunks)
        os.makedirs(folder, exist_ok=True)
        for part, name in ((0, "x"), (1, "y")):
            first = chunks[0][part]
            rows = sum(len(c[part]) for c in chunks)
            out = np.lib.format.open_memmap(os.path.join(folder, f"{split}_{name}.npy"), "w+",
                                            first.dtype, (rows,) + first.shape[1:])
            start = 0
            for chunk in chunks:
                out[start:start + len(chunk[part])] = chunk[part]
                start += len(chunk[part])
            out.flush()


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
    parser.add_argument("--test-examples", type=int, default=FASHION_TEST, metavar="N",
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


def rescaled_cnn():
    """The CNN behind a rescaling of uint8 pixels to [0, 1]."""
    import keras

    from kdist.model import create_model

    return keras.Sequential([keras.Input(data.IMAGE_SHAPE), keras.layers.Rescaling(1 / 255),
                             create_model()])


def rss_main(argv=None):
    parser = argparse.ArgumentParser(
        prog="rss_check.py",
        description="Write a synthetic set of SCALE x Fashion-MNIST's 60,000 train examples "
                    "(28x28 uint8) to FOLDER in a child process, train one epoch streamed "
                    "from it, and print this process's peak resident memory.")
    parser.add_argument("folder")
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--format", choices=("tfrecord", "npy"), default="tfrecord")
    parser.add_argument("--steps", type=int, default=None, help="steps (default: the epoch)")
    args = parser.parse_args(argv)
    examples = args.scale * FASHION_TRAIN
    subprocess.run([sys.executable, "-m", "kdist.ondisk", args.folder, "--synthetic",
                    str(examples), "--shards", "16", "--format", args.format], check=True)
    import kdist

    shutil.rmtree(os.path.join(args.folder, "checkpoints"), ignore_errors=True)
    if args.format == "tfrecord":
        splits = [kdist.TFRecords(args.folder, split) for split in ("train", "test")]
    else:
        splits = [tuple(np.load(os.path.join(args.folder, f"{split}_{name}.npy"),
                                mmap_mode="r") for name in ("x", "y"))
                  for split in ("train", "test")]
    config = kdist.TrainConfig(epochs=1, steps_per_epoch=args.steps, progress=False,
                               checkpoint_dir=os.path.join(args.folder, "checkpoints"))
    kdist.train_and_evaluate(config, kdist.Inputs(*splits), model_fn=rescaled_cnn)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.format}, {examples:,} train examples: peak RSS {peak:,.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(write_main())
