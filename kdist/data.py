"""Fashion-MNIST loading and batching, shared by every backend.

Everything here is NumPy: the engines only ever see fixed-shape global batches
``(images, labels, weights)``. Train batches are full (the last partial batch of
an epoch is dropped, as in the tutorial); eval batches cover every example
exactly once, with the last batch padded and its padding given weight 0.
"""

import dataclasses
import gzip
import os
import struct

import numpy as np

from kdist.errors import DataError, UsageError
from kdist.startup import keras_home

FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10
_IDX_MAGIC = {"images": (0x0803, 3), "labels": (0x0801, 1)}


@dataclasses.dataclass
class Dataset:
    """Train and test arrays plus where they came from."""

    train_images: np.ndarray  # float32, (N, 28, 28, 1), in [0, 1]
    train_labels: np.ndarray  # int32, (N,)
    test_images: np.ndarray
    test_labels: np.ndarray
    source: str


def keras_cache_dir():
    """The folder where `keras.datasets.fashion_mnist` caches its files."""
    return os.path.join(keras_home(), "datasets", "fashion-mnist")


def missing_files(directory):
    """The Fashion-MNIST file names that `directory` lacks."""
    return [
        name
        for name in FILES.values()
        if not os.path.isfile(os.path.join(directory, name))
    ]


def check_data_dir(directory):
    """Raises UsageError unless `directory` is a folder holding all four files."""
    if not os.path.isdir(directory):
        raise UsageError(f"--data-dir {directory} is not a folder; point it at a folder with "
                         "the four Fashion-MNIST .gz files")
    missing = missing_files(directory)
    if missing:
        raise UsageError(f"--data-dir {directory} lacks {', '.join(missing)}; "
                         "point it at a folder with all four Fashion-MNIST .gz files")


def read_idx(path, kind):
    """Reads one gzipped IDX file, checking its header against its size.

    Args:
        path: the `.gz` file.
        kind: "images" (3 dims) or "labels" (1 dim).
    """
    expected_magic, expected_dims = _IDX_MAGIC[kind]
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read it as gzip ({e}); "
                        "re-download or reinstall the data set") from e
    header_size = 4 + 4 * expected_dims
    if len(raw) < header_size:
        raise DataError(f"{path}: too short for an IDX {kind} header "
                        f"({len(raw)} bytes); the file is truncated")
    (magic,) = struct.unpack(">I", raw[:4])
    if magic != expected_magic:
        raise DataError(f"{path}: IDX magic number is {magic:#010x}, expected "
                        f"{expected_magic:#010x} for {kind}; wrong or corrupt file")
    dims = struct.unpack(f">{expected_dims}I", raw[4:header_size])
    expected_bytes = int(np.prod(dims))
    if len(raw) - header_size != expected_bytes:
        raise DataError(f"{path}: header says {dims} ({expected_bytes} bytes) but "
                        f"the file holds {len(raw) - header_size}; it is truncated or corrupt")
    return np.frombuffer(raw, np.uint8, offset=header_size).reshape(dims)


def load_from_directory(directory):
    """Loads the four IDX files of `directory` into a `Dataset`."""
    arrays = {}
    for key, name in FILES.items():
        arrays[key] = read_idx(os.path.join(directory, name), key.split("_")[1])
    for split in ("train", "test"):
        n_images = len(arrays[f"{split}_images"])
        n_labels = len(arrays[f"{split}_labels"])
        if n_images != n_labels:
            raise DataError(f"{directory}: {split} has {n_images} images but "
                            f"{n_labels} labels; the files do not belong together")
    return _normalise(arrays, source=os.path.abspath(directory))


def _normalise(arrays, source):
    def images(a):
        return (a.astype(np.float32) / np.float32(255.0))[..., None]

    return Dataset(
        train_images=images(arrays["train_images"]),
        train_labels=arrays["train_labels"].astype(np.int32),
        test_images=images(arrays["test_images"]),
        test_labels=arrays["test_labels"].astype(np.int32),
        source=source,
    )


def load_fashion_mnist(data_dir=None):
    """Finds Fashion-MNIST offline first, and downloads it only as a last resort.

    Order: `data_dir` (if given, it must be a folder holding all four files, else
    UsageError), the Keras cache
    (`$KERAS_HOME/datasets/fashion-mnist`, default `~/.keras`), the Debian
    package folder `/usr/share/datasets/fashion-mnist`, then
    `keras.datasets.fashion_mnist.load_data()`.
    """
    if data_dir is not None:
        check_data_dir(data_dir)
        return load_from_directory(data_dir)
    for directory in (keras_cache_dir(), DEBIAN_DIR):
        if os.path.isdir(directory) and not missing_files(directory):
            return load_from_directory(directory)
    try:
        import keras

        (xtr, ytr), (xte, yte) = keras.datasets.fashion_mnist.load_data()
    except Exception as e:  # Any failure here means: no data available.
        raise DataError(
            "Fashion-MNIST not found. Pass --data-dir DIR (a folder with the four "
            f"IDX .gz files), or put them in {keras_cache_dir()}, or install the "
            "Debian package: apt-get install dataset-fashion-mnist "
            f"(download also failed: {type(e).__name__}: {e})"
        ) from e
    arrays = dict(train_images=xtr, train_labels=ytr, test_images=xte, test_labels=yte)
    return _normalise(arrays, source=keras_cache_dir() + " (downloaded)")


def synthetic_fashion_mnist(num_train=60000, num_test=10000, seed=0):
    """Random data of Fashion-MNIST's shapes that a CNN can partly learn.

    Each class is a faint random template under heavy noise, so accuracy
    rises over epochs without reaching 100% at once.
    """
    rng = np.random.default_rng(seed)
    templates = rng.normal(0.0, 0.12, (NUM_CLASSES,) + IMAGE_SHAPE).astype(np.float32)

    def make(n):
        labels = rng.integers(0, NUM_CLASSES, n).astype(np.int32)
        noise = rng.normal(0.5, 0.5, (n,) + IMAGE_SHAPE).astype(np.float32)
        return np.clip(templates[labels] + noise, 0.0, 1.0), labels

    train_images, train_labels = make(num_train)
    test_images, test_labels = make(num_test)
    return Dataset(train_images, train_labels, test_images, test_labels,
                   source=f"synthetic, seed {seed}")


def check_dataset(dataset):
    """Raises DataError, naming `dataset.source`, for data no run can train on.

    Each split needs as many labels as images, at least one example, and
    finite images (no NaN or infinity).
    """
    for split in ("train", "test"):
        images, labels = _split(dataset, split)
        if len(images) != len(labels):
            raise DataError(f"{dataset.source}: {split} has {len(images)} images but "
                            f"{len(labels)} labels; they must be as many")
        if not len(images):
            raise DataError(f"{dataset.source}: the {split} set is empty")
        if np.issubdtype(images.dtype, np.inexact):
            bad = np.flatnonzero(~np.isfinite(images.reshape(len(images), -1)).all(axis=1))
            if len(bad):
                raise DataError(f"{dataset.source}: {split} image {bad[0]} holds NaN or "
                                f"infinity ({len(bad)} such images)")


def check_labels(dataset, num_classes, splits=("train", "test")):
    """Raises DataError unless every label of `splits` is a class index below `num_classes`.

    `num_classes` is the size of the model's output (its last axis).
    """
    for split in splits:
        labels = _split(dataset, split)[1]
        if not np.issubdtype(labels.dtype, np.integer):
            raise DataError(f"{dataset.source}: {split} labels are {labels.dtype}; "
                            "class labels must be integers")
        bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
        if len(bad):
            raise DataError(f"{dataset.source}: {split} label {labels.flat[bad[0]]} (example "
                            f"{bad[0]}) is not a class of the model, which has {num_classes} "
                            f"(0..{num_classes - 1}); {len(bad)} labels are out of range")


def _split(dataset, split):
    return getattr(dataset, f"{split}_images"), getattr(dataset, f"{split}_labels")


def eval_steps(num_examples, global_batch_size):
    """Eval batches that cover `num_examples` (the last one padded)."""
    return -(-num_examples // global_batch_size)


def steps_per_epoch(num_examples, global_batch_size, limit=None):
    """Full global batches per epoch, capped by `limit` (like `fit`'s steps_per_epoch)."""
    steps = num_examples // global_batch_size
    return steps if limit is None else min(steps, limit)


def train_batches(images, labels, global_batch_size, *, seed, epoch, steps,
                  start_step=0, shard=(0, 1)):
    """Yields the shuffled global batches of one epoch as (x, y, weights).

    The order depends only on (seed, epoch), so a resumed run sees the same
    batches as an uninterrupted one. `shard=(index, count)` yields only this
    process's contiguous slice of each global batch.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(images))
    index, count = shard
    local = global_batch_size // count
    for step in range(start_step, steps):
        idx = order[step * global_batch_size:(step + 1) * global_batch_size]
        idx = idx[index * local:(index + 1) * local]
        yield images[idx], labels[idx], np.ones(len(idx), np.float32)


def eval_batches(images, labels, global_batch_size, shard=(0, 1)):
    """Yields every example once in fixed-shape batches; padding has weight 0."""
    index, count = shard
    local = global_batch_size // count
    for start in range(0, len(images), global_batch_size):
        x = images[start:start + global_batch_size]
        y = labels[start:start + global_batch_size]
        w = np.ones(len(x), np.float32)
        pad = global_batch_size - len(x)
        if pad:
            x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
            y = np.concatenate([y, np.zeros(pad, y.dtype)])
            w = np.concatenate([w, np.zeros(pad, np.float32)])
        part = slice(index * local, (index + 1) * local)
        yield x[part], y[part], w[part]
