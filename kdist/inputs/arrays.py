"""Data in memory: `kdist.Dataset`, its checks, and its batches for every engine.

Everything here is NumPy: the engines only ever see batches ``(x, y,
sample_weight)``, where x and y are an array or a tuple, list or dict of
arrays (the model's inputs and targets) and `sample_weight` is the user's
(or None). Train batches are full global batches (the last partial batch of
an epoch is dropped, as in the tutorial); evaluation covers every example
exactly once: full global batches, then the rest as one smaller "tail"
batch, never padded, so every metric counts each example once.
`ArraySource` is arrays as a source of `kdist.inputs.base`.
"""

import dataclasses
from collections.abc import Mapping

import numpy as np

from kdist.errors import DataError, UsageError
from kdist.inputs.base import SizedSource, Stream, eval_steps
from kdist.inputs.batching import X_ALONE, check_class_labels
from kdist.tree import Arrays, leaves, num_examples, take_rows


@dataclasses.dataclass
class Dataset:
    """Train and test data in memory, plus where they came from.

    Each of x and y is a NumPy array or a tuple, list or dict of them (as
    Keras `fit` takes), every array with one row per example; sample
    weights are optional arrays with a row per example, shaped as the loss
    takes them: (N,), or (N, H, W) for a loss per pixel, as in `fit`.
    """

    train_x: Arrays
    train_y: Arrays
    test_x: Arrays
    test_y: Arrays
    source: str = "arrays in memory"
    train_sample_weight: np.ndarray | None = None
    test_sample_weight: np.ndarray | None = None

    def split(self, name: str) -> tuple[Arrays, Arrays, np.ndarray | None]:
        """(x, y, sample_weight) of split "train" or "test"."""
        return (getattr(self, f"{name}_x"), getattr(self, f"{name}_y"),
                getattr(self, f"{name}_sample_weight"))

    def size(self, name: str) -> int:
        """The examples of split "train" or "test"."""
        return num_examples(getattr(self, f"{name}_x"))


def with_class_weight(dataset, class_weight):
    """`dataset` with training sample weights from `class_weight` ({class index:
    weight}; a class it lacks weighs 1), derived as `fit(class_weight=...)`
    derives them (Keras' `class_weight_to_sample_weights`: class indices of
    shape (N,) or (N, 1), one-hot rows by their argmax). The test split is
    unchanged: `fit` weighs no validation example by its class."""
    if not isinstance(dataset, Dataset):
        raise UsageError("class_weight takes a kdist.Dataset (arrays); for kdist.Inputs, "
                         "give each batch its sample weights (weights[y])")
    if not isinstance(class_weight, Mapping):
        raise UsageError(f"class_weight is {type(class_weight).__name__}; give a dict "
                         "{class index: weight}, as for fit")
    if dataset.train_sample_weight is not None:
        raise UsageError("the dataset has training sample weights; give class_weight or "
                         "sample weights, not both (as fit)")
    if not isinstance(dataset.train_y, np.ndarray):
        raise UsageError("class_weight takes one label array (a model with one output), "
                         "as fit does; for several, give sample weights")
    if dataset.train_y.ndim > 2:
        raise UsageError(f"class_weight weighs one label per example, and the labels are "
                         f"shaped {dataset.train_y.shape}; for labels per pixel or step, give "
                         "sample weights shaped as the labels (weights[y])")
    from keras.src.trainers.data_adapters import data_adapter_utils  # Keras' own rule.

    weights = data_adapter_utils.class_weight_to_sample_weights(dataset.train_y, class_weight)
    return dataclasses.replace(dataset, train_sample_weight=weights)


def check_dataset(dataset):
    """Raises DataError, naming `dataset.source`, for data no run can train on.

    Each split needs at least one example, the same number of rows in every
    array of x, y and the sample weights, and finite floats (no NaN or
    infinity) in each.
    """
    for split in ("train", "test"):
        check_split(dataset.source, split, *dataset.split(split))


def check_split(source, split, x, y, sample_weight):
    """`check_dataset` for one split's arrays; `source` names the data in errors."""
    if y is None and x is not None:
        raise UsageError(f"{source}: the {split} set has no labels (y is None); {X_ALONE}")
    parts = [("x", x), ("y", y), ("sample weight", sample_weight)]
    for name, part in parts:
        kinds = {type(a).__name__ for a in leaves(part) if not hasattr(a, "shape")}
        if kinds:  # A Python list of numbers: its leaves are the numbers.
            raise UsageError(f"{source}: the {split} {name} holds {', '.join(sorted(kinds))} "
                             "values, not arrays; give NumPy arrays: numpy.asarray(values)")
    lengths = [(name, len(a)) for name, part in parts for a in leaves(part)]
    if not lengths:
        raise DataError(f"{source}: the {split} set has no arrays")
    if len({n for _, n in lengths}) > 1:
        raise DataError(f"{source}: {split} arrays differ in length (" +
                        ", ".join(f"{name} {n}" for name, n in lengths) +
                        "); every array needs one row per example")
    if not lengths[0][1]:
        raise DataError(f"{source}: the {split} set is empty")
    for name, part in (("input", x), ("label", y), ("sample weight", sample_weight)):
        for values in leaves(part):
            if np.issubdtype(values.dtype, np.inexact) and not np.isfinite(values.sum()):
                bad = np.flatnonzero(~np.isfinite(values.reshape(len(values), -1)).all(axis=1))
                if len(bad):
                    row = values[bad[0]].reshape(-1)
                    value = row[~np.isfinite(row)][0]
                    raise DataError(f"{source}: {split} {name} (example {bad[0]}) holds "
                                    f"{value} ({len(bad)} such examples)")


def check_labels(dataset, num_classes, splits=("train", "test")):
    """Raises DataError where a split of `splits` has labels (class indices,
    integers or the floats Keras' sparse losses cast to them) outside
    0..num_classes-1, each split on its own (as streamed batches are checked).

    For a model with one output of `num_classes` values per example.
    """
    for split in splits:
        labels = dataset.split(split)[1]
        check_class_labels(labels, num_classes, f"{dataset.source}: {split} label", "example")


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


class ArraySource(SizedSource):
    """NumPy arrays in memory: shuffled by (seed, epoch), sliced per worker
    (`kdist.inputs.arrays.train_batches`)."""

    kind = "NumPy arrays"

    def __init__(self, x, y, sample_weight, what):
        self.arrays, self.what = (x, y, sample_weight), what

    def size(self):
        return num_examples(self.arrays[0])

    def sample(self, rows=2):
        return take_rows(self.arrays, slice(0, rows))

    def expect_classes(self, classes):
        check_class_labels(self.arrays[1], classes, f"{self.what}: label", "example")

    def train(self, global_batch, *, seed, epoch, start_step=0, limit=None, shard=(0, 1)):
        return Stream(train_batches(
            *self.arrays, global_batch, seed=seed, epoch=epoch, start_step=start_step,
            steps=self.steps_per_epoch(global_batch, limit), shard=shard))

    def evaluate(self, global_batch, shard=(0, 1)):
        def batches():
            for batch in eval_batches(*self.arrays, global_batch, shard):
                yield batch, False
            tail = eval_tail(*self.arrays, global_batch)
            if tail is not None:
                yield tail, True

        return Stream(batches())
