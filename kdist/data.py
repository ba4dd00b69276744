"""Data sets in memory, Fashion-MNIST loading, and batching, shared by every backend.

Everything here is NumPy: the engines only ever see batches ``(x, y,
sample_weight)``, where x and y are an array or a tuple, list or dict of
arrays (the model's inputs and targets) and `sample_weight` is the user's
(or None). Train batches are full global batches (the last partial batch of
an epoch is dropped, as in the tutorial); evaluation covers every example
exactly once: full global batches, then the rest as one smaller "tail"
batch, never padded, so every metric counts each example once.
"""

import dataclasses
import gzip
import os
import struct
from typing import Any

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
    """Train and test data in memory, plus where they came from.

    Each of x and y is a NumPy array or a tuple, list or dict of them (as
    Keras `fit` takes), every array with one row per example; sample
    weights are optional arrays of shape (N,).
    """

    train_x: Any
    train_y: Any
    test_x: Any
    test_y: Any
    source: str = "arrays in memory"
    train_sample_weight: np.ndarray | None = None
    test_sample_weight: np.ndarray | None = None

    def split(self, name):
        """(x, y, sample_weight) of split "train" or "test"."""
        return (getattr(self, f"{name}_x"), getattr(self, f"{name}_y"),
                getattr(self, f"{name}_sample_weight"))

    def size(self, name):
        """The examples of split "train" or "test"."""
        return num_examples(getattr(self, f"{name}_x"))


def map_arrays(fn, *structures):
    """`fn` over the arrays of same-shaped structures (tuple, list, dict, None)."""
    first = structures[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {key: map_arrays(fn, *(s[key] for s in structures)) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(map_arrays(fn, *parts) for parts in zip(*structures))
    return fn(*structures)


def leaves(structure):
    """The arrays of a structure, in order."""
    found = []
    map_arrays(found.append, structure)
    return found


def num_examples(structure):
    return len(leaves(structure)[0])


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
        train_x=images(arrays["train_images"]),
        train_y=arrays["train_labels"].astype(np.int32),
        test_x=images(arrays["test_images"]),
        test_y=arrays["test_labels"].astype(np.int32),
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


def synthetic_fashion_mnist(num_train=60000, num_test=None, seed=0):
    """Random data of Fashion-MNIST's shapes that a CNN can partly learn
    (`synthetic_images`); `num_test` None: a sixth of `num_train` (at least 1),
    Fashion-MNIST's 10,000 for its 60,000."""
    if num_test is None:
        num_test = max(1, num_train // 6)
    return synthetic_images(num_train, num_test, seed, IMAGE_SHAPE)


def synthetic_images(num_train, num_test, seed, image_shape, num_classes=NUM_CLASSES):
    """Random images of `image_shape` in [0, 1] and integer labels below `num_classes`.

    Each class is a faint random template under heavy noise, so accuracy
    rises over epochs without reaching 100% at once.
    """
    rng = np.random.default_rng(seed)
    templates = rng.normal(0.0, 0.12, (num_classes,) + tuple(image_shape)).astype(np.float32)

    def make(n):
        labels = rng.integers(0, num_classes, n).astype(np.int32)
        noise = rng.normal(0.5, 0.5, (n,) + tuple(image_shape)).astype(np.float32)
        return np.clip(templates[labels] + noise, 0.0, 1.0), labels

    train_images, train_labels = make(num_train)
    test_images, test_labels = make(num_test)
    return Dataset(train_images, train_labels, test_images, test_labels,
                   source=f"synthetic, seed {seed}")


def check_dataset(dataset):
    """Raises DataError, naming `dataset.source`, for data no run can train on.

    Each split needs at least one example, the same number of rows in every
    array of x, y and the sample weights, and finite floats (no NaN or
    infinity) in x.
    """
    for split in ("train", "test"):
        check_split(dataset.source, split, *dataset.split(split))


def check_split(source, split, x, y, sample_weight):
    """`check_dataset` for one split's arrays; `source` names the data in errors."""
    parts = [("x", x), ("y", y), ("sample weight", sample_weight)]
    lengths = [(name, len(a)) for name, part in parts for a in leaves(part)]
    if not lengths:
        raise DataError(f"{source}: the {split} set has no arrays")
    if len({n for _, n in lengths}) > 1:
        raise DataError(f"{source}: {split} arrays differ in length (" +
                        ", ".join(f"{name} {n}" for name, n in lengths) +
                        "); every array needs one row per example")
    if not lengths[0][1]:
        raise DataError(f"{source}: the {split} set is empty")
    for images in leaves(x):
        if np.issubdtype(images.dtype, np.inexact):
            bad = np.flatnonzero(~np.isfinite(images.reshape(len(images), -1)).all(axis=1))
            if len(bad):
                raise DataError(f"{source}: {split} input {bad[0]} holds NaN or "
                                f"infinity ({len(bad)} such examples)")


def check_labels(dataset, num_classes, splits=("train", "test")):
    """Raises DataError unless every label of `splits` is a class index below `num_classes`.

    For targets that are class indices (one integer array) against a model
    with one output of `num_classes` values per example.
    """
    for split in splits:
        labels = dataset.split(split)[1]
        if not np.issubdtype(labels.dtype, np.integer):
            raise DataError(f"{dataset.source}: {split} labels are {labels.dtype}; "
                            "class labels must be integers")
        bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
        if len(bad):
            raise DataError(f"{dataset.source}: {split} label {labels.flat[bad[0]]} (example "
                            f"{bad[0]}) is not a class of the model, which has {num_classes} "
                            f"(0..{num_classes - 1}); {len(bad)} labels are out of range")


def eval_steps(num_examples, global_batch_size):
    """The full global batches of `num_examples` (the rest is one smaller tail batch)."""
    return num_examples // global_batch_size


def steps_per_epoch(num_examples, global_batch_size, limit=None):
    """Full global batches per epoch, capped by `limit` (like `fit`'s steps_per_epoch)."""
    steps = num_examples // global_batch_size
    return steps if limit is None else min(steps, limit)


def epoch_order(count, seed, epoch):
    """The order of `count` items (examples, or a PyDataset's batches) in epoch
    `epoch`: a permutation that depends only on (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(count)


def train_batches(x, y, sample_weight, global_batch_size, *, seed, epoch, steps,
                  start_step=0, shard=(0, 1)):
    """Yields the shuffled global batches of one epoch as (x, y, sample_weight).

    The order depends only on (seed, epoch), so a resumed run sees the same
    batches as an uninterrupted one. `shard=(index, count)` yields only this
    process's contiguous slice of each global batch.
    """
    order = epoch_order(num_examples(x), seed, epoch)
    index, count = shard
    local = global_batch_size // count
    for step in range(start_step, steps):
        idx = order[step * global_batch_size:(step + 1) * global_batch_size]
        idx = idx[index * local:(index + 1) * local]
        yield take_rows((x, y, sample_weight), idx)


def take_rows(batch, rows):
    """The `rows` (an index array or a slice) of every array of `batch`."""
    return tuple(map_arrays(lambda a: a[rows], part) for part in batch)


def eval_batches(x, y, sample_weight, global_batch_size, shard=(0, 1)):
    """Yields the full global batches of an evaluation set, in order, as (x, y,
    sample_weight); `shard` as for `train_batches`. `eval_tail` has the rest."""
    index, count = shard
    local = global_batch_size // count
    for step in range(eval_steps(num_examples(x), global_batch_size)):
        start = step * global_batch_size + index * local
        yield take_rows((x, y, sample_weight), slice(start, start + local))


def eval_tail(x, y, sample_weight, global_batch_size):
    """The examples after the last full global batch, whole (every worker's
    copy), as one (x, y, sample_weight) batch; None if there are none."""
    start = eval_steps(num_examples(x), global_batch_size) * global_batch_size
    if start == num_examples(x):
        return None
    return take_rows((x, y, sample_weight), slice(start, None))
