"""Fashion-MNIST: found on disk (the Keras cache, Debian's dataset-fashion-mnist) or
downloaded by Keras, checked, and scaled to [0, 1]; or generated in its shapes."""

import gzip
import os
import struct

import numpy as np

from kdist import hints
from kdist.datasets.sizes import FASHION_MNIST_TRAIN
from kdist.datasets.synthetic import synthetic_images
from kdist.errors import DataError, UsageError
from kdist.inputs.arrays import Dataset
from kdist.runtime.startup import keras_home

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


def load_from_directory(directory: str) -> Dataset:
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


def _normalise(arrays: dict[str, np.ndarray], source: str) -> Dataset:
    def images(a):
        return (a.astype(np.float32) / np.float32(255.0))[..., None]

    return Dataset(
        train_x=images(arrays["train_images"]),
        train_y=arrays["train_labels"].astype(np.int32),
        test_x=images(arrays["test_images"]),
        test_y=arrays["test_labels"].astype(np.int32),
        source=source,
    )


@hints.library_terms
def load_fashion_mnist(data_dir: str | None = None) -> Dataset:
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
            "Fashion-MNIST not found. Pass --data-dir (a folder with the four "
            f"IDX .gz files), or put them in {keras_cache_dir()}, or install the "
            "Debian package: apt-get install dataset-fashion-mnist "
            f"(download also failed: {type(e).__name__}: {e})"
        ) from e
    arrays = dict(train_images=xtr, train_labels=ytr, test_images=xte, test_labels=yte)
    return _normalise(arrays, source=keras_cache_dir() + " (downloaded)")


def synthetic_fashion_mnist(num_train: int = FASHION_MNIST_TRAIN, num_test: int | None = None,
                            seed: int = 0) -> Dataset:
    """Random data of Fashion-MNIST's shapes that a CNN can partly learn
    (`synthetic_images`); `num_test` None: a sixth of `num_train` (at least 1),
    Fashion-MNIST's 10,000 for its 60,000."""
    if num_test is None:
        num_test = max(1, num_train // 6)
    return synthetic_images(num_train, num_test, seed, IMAGE_SHAPE)
