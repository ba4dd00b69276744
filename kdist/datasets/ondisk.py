"""Data sets written to disk for streaming: Fashion-MNIST or synthetic data of its
shapes, of any size, as TFRecord files (`kdist.inputs.tfrecords`) or `.npy`
files that training maps into memory (`np.load(mmap_mode="r")`).
"""

import os

import numpy as np

from kdist.datasets import fashion_mnist
from kdist.inputs import tfrecords


def fashion_mnist_uint8(data_dir=None):
    """((x, y) train, (x, y) test): Fashion-MNIST's uint8 pixels (N, 28, 28, 1)
    and int32 labels (found as `kdist.load_fashion_mnist` finds them)."""
    loaded = fashion_mnist.load_fashion_mnist(data_dir)
    return [(np.round(np.asarray(x) * 255).astype(np.uint8), y)  # Undoes its exact / 255.
            for x, y, _ in (loaded.split("train"), loaded.split("test"))]


def synthetic_chunks(examples, chunks, seed=0):
    """`chunks` (x, y) parts of `examples` synthetic uint8 images of Fashion-MNIST's
    shapes (a faint class template, the same for every seed, under noise), made
    one part at a time."""
    templates = np.random.default_rng(0).integers(  # Every set's.
        0, 64, (fashion_mnist.NUM_CLASSES,) + fashion_mnist.IMAGE_SHAPE)
    bounds = np.linspace(0, examples, chunks + 1).astype(int)
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        rng = np.random.default_rng([seed, index])
        labels = rng.integers(0, fashion_mnist.NUM_CLASSES, stop - start).astype(np.int32)
        noise = rng.integers(0, 192, (stop - start,) + fashion_mnist.IMAGE_SHAPE)
        yield (templates[labels] + noise).astype(np.uint8), labels


def write(folder, splits, shards, kind="tfrecord"):
    """Writes `splits`, {"train": chunks, "test": chunks} where chunks is a list
    or iterator of `shards` (x, y) parts, as TFRecord or .npy files in `folder`."""
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
