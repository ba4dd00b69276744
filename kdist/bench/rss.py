"""`scripts/rss_check.py`: the peak memory of an epoch streamed from disk.

`rss_main` writes a synthetic set in a child process (`kdist.cli.write_data`),
trains one epoch from it and prints the process's peak resident memory
(`ru_maxrss`): streamed from disk, it should not grow with the data set.
"""

import argparse
import os
import resource
import shutil
import subprocess
import sys
from typing import Any

import keras
import numpy as np

import kdist
from kdist.datasets import fashion_mnist
from kdist.datasets.sizes import FASHION_MNIST_TRAIN
from kdist.models.cnn import create_model


def rescaled_cnn():
    """The CNN behind a rescaling of uint8 pixels to [0, 1]."""
    return keras.Sequential([keras.Input(fashion_mnist.IMAGE_SHAPE),
                             keras.layers.Rescaling(1 / 255), create_model()])


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
    examples = args.scale * FASHION_MNIST_TRAIN
    subprocess.run([sys.executable, "-m", "kdist.cli.write_data", args.folder, "--synthetic",
                    str(examples), "--shards", "16", "--format", args.format], check=True)
    shutil.rmtree(os.path.join(args.folder, "checkpoints"), ignore_errors=True)
    splits: list[Any]  # Each split's TFRecords, or its (x, y) arrays.
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
