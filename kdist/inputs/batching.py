"""A pipeline's batches, checked and re-cut into global batches.

A pipeline's batches may hold any number of rows: they are checked batch by
batch (`BatchCheck`) and re-cut (`cut`) into global batches of
batch_size_per_replica x replicas, of which each worker keeps its contiguous
slice (`worker_rows`).
"""

import numpy as np

from kdist import tree
from kdist.errors import DataError

PARTS = ("x", "y", "sample weight")


# Where a batch or split lacks y: `fit` takes x alone; kdist reads targets with every batch.
X_ALONE = ("kdist reads y with every batch, unlike fit, which also takes x alone: for a step "
           "of your own that uses only x, give y as zeros, one row per example")


class BatchCheck:
    """Checks a source's batches, one by one, against its first.

    A batch is a tuple (x, y) or (x, y, sample_weight), each an array or a
    tuple, list or dict of arrays, every array with the same number of rows;
    every batch holds examples of the first batch's structure, shapes and
    dtypes (only the number of rows may change), and values `check_values`
    accepts: finite floats, and labels of the model's `classes` once the
    source is told them (`expect_classes`).
    """

    def __init__(self, what, regrouped=False):
        self.what = what
        self.specs = None
        self.classes: int | None = None
        # Whether batches are counted as kdist reads them (tf.data and TFRecords re-cut
        # into several global batches per read), not as the pipeline made them.
        self.as_read = " as kdist reads it" if regrouped else ""

    def __call__(self, batch, index):
        """(batch as (x, y, sample_weight) of NumPy arrays, its rows); DataError if bad."""
        if isinstance(batch, list):
            batch = tuple(batch)
        if not isinstance(batch, tuple) or len(batch) not in (2, 3):
            what = (f"a tuple of {len(batch)}" if isinstance(batch, tuple)
                    else f"a {type(batch).__name__}")
            raise DataError(f"{self.what}: batch {index} is {what}; every batch must be a "
                            f"tuple (x, y) or (x, y, sample_weight) ({X_ALONE})")
        batch = tuple(tree.map_arrays(np.asarray, part) for part in batch)
        batch += (None,) * (3 - len(batch))
        lengths = [(name, a.shape[0] if a.ndim else None)
                   for name, part in zip(PARTS, batch) for a in tree.leaves(part)]
        if any(n is None for _, n in lengths):
            name = next(name for name, n in lengths if n is None)
            raise DataError(f"{self.what}: batch {index} has a scalar {name}, a single "
                            "example; give batches (a first axis of examples), as for fit")
        if len({n for _, n in lengths}) > 1:
            raise DataError(f"{self.what}: batch {index} holds arrays of different lengths (" +
                            ", ".join(f"{name} {n}" for name, n in lengths) + "); x, y and "
                            "the sample weights need one row per example")
        specs = tuple(tree.map_arrays(_spec, part) for part in batch)
        if self.specs is None:
            self.specs = specs
        elif specs != self.specs:
            name, now, first = next(p for p in zip(PARTS, specs, self.specs) if p[1] != p[2])
            raise DataError(f"{self.what}: batch {index} changes shape: its {name} holds "
                            f"{_show(now)} where the first batch's held {_show(first)}; every "
                            "batch needs the same example shapes and dtypes (only the number "
                            "of rows may vary)")
        check_values(batch, f"{self.what}: batch {index}{self.as_read}", self.classes)
        return batch, lengths[0][1]


class CheckedSource:
    """A source whose batches pass its `BatchCheck` as they stream."""

    check: BatchCheck

    def expect_classes(self, classes):
        self.check.classes = classes


def check_values(batch, where, classes=None):
    """Raises DataError, naming `where`, the field, the row and the value, for a
    non-finite float in x, y or the sample weights, or (with `classes`) a
    class-index label, y one integer array, outside 0..classes-1.

    The fast path reads each array once and copies nothing: a float array's
    sum is finite when all its values are (an overflowing sum is looked at
    value by value), and labels need their minimum and maximum."""
    for name, part in zip(PARTS, batch):
        for array in tree.leaves(part):
            if array.dtype.kind in "fc" and array.size and not np.isfinite(array.sum()):
                bad = np.argwhere(~np.isfinite(array))
                if len(bad):
                    raise DataError(
                        f"{where}: {name} holds {array[tuple(bad[0])]} in row {bad[0][0]} "
                        f"({len(bad)} non-finite values); inputs, labels and sample weights "
                        "must be finite")
    if classes is not None:
        check_class_labels(batch[1], classes, f"{where}: label", "row")


def check_class_labels(labels, classes, what, unit):
    """Raises DataError for integer or float `labels` (one array; Keras' sparse
    losses cast floats to integers) outside 0..classes-1, naming the first
    (`what` VALUE (`unit` INDEX)), the model's classes and the count; other
    labels pass."""
    if (isinstance(labels, np.ndarray) and labels.dtype.kind in "iuf" and labels.size
            and (labels.min() < 0 or labels.max() >= classes)):
        wrong = np.flatnonzero((labels < 0) | (labels >= classes))
        index = np.unravel_index(wrong[0], labels.shape)[0]
        raise DataError(f"{what} {labels.flat[wrong[0]]} ({unit} {index}) is not a class of "
                        f"the model, which has {classes} (0..{classes - 1}); {len(wrong)} "
                        "labels are out of range")


def _spec(array):
    return f"{array.dtype} {tuple(array.shape[1:])}"


def _show(spec):
    found = tree.leaves(spec) if spec is not None else []
    return ", ".join(found) if found else "nothing"


def concat(batches):
    """Batches of one structure joined along their rows."""
    if len(batches) == 1:
        return batches[0]
    return tuple(tree.map_arrays(lambda *arrays: np.concatenate(arrays), *parts)
                 for parts in zip(*batches))


def drop_rows(checked, count):
    """(batch, rows) pairs after the first `count` rows of the stream."""
    for batch, rows in checked:
        if count >= rows:
            count -= rows
            continue
        if count:
            batch, rows, count = tree.take_rows(batch, slice(count, None)), rows - count, 0
        yield batch, rows


def cut(checked, size):
    """Re-cuts (batch, rows) pairs into batches of exactly `size` rows, then the rest."""
    parts, rows = [], 0
    for batch, count in checked:
        if not count:
            continue
        parts.append(batch)
        rows += count
        while rows >= size:
            whole = concat(parts)
            yield tree.take_rows(whole, slice(0, size)), size
            rows -= size
            parts = [tree.take_rows(whole, slice(size, None))] if rows else []
    if rows:
        yield concat(parts), rows


def worker_rows(global_batch, shard):
    """The rows of a global batch that worker `shard[0]` of `shard[1]` feeds."""
    index, count = shard
    local = global_batch // count
    return slice(index * local, (index + 1) * local)


def train_slices(global_batches, global_batch, start_step, limit, shard, what, epoch=0):
    """This worker's slices of full global batches numbered from `start_step`, up to
    `limit` (nothing read beyond it); DataError if a pass from the start has not
    one full global batch (naming `epoch`, counted from 0, after the first)."""
    step, short, pairs = start_step, 0, iter(global_batches)
    while limit is None or step < limit:
        batch, rows = next(pairs, (None, 0))
        if rows < global_batch:
            short = rows
            break
        yield tree.take_rows(batch, worker_rows(global_batch, shard))
        step += 1
    if step == 0 and epoch:
        raise DataError(f"epoch {epoch + 1} of {what} " + (
            f"holds {short} examples, fewer than one global batch of {global_batch}"
            if short else "is empty") + ": every epoch of a stream needs one global batch")
    if step == 0:
        raise DataError(f"{what} is empty" if not short else
                        f"{what} holds {short} examples, fewer than one global batch of "
                        f"{global_batch}; lower --batch-size-per-replica")


def local_batches(pairs, local, start_step, limit, what, epoch=0):
    """A worker's own share, read by it alone: full batches of `local` rows (its rows
    of each global batch), from `start_step` up to `limit`; DataError if a pass from
    the start has not one, naming an empty share as such, and `epoch` after the first."""
    step, read = start_step, False
    for batch, rows in cut(pairs, local):
        read = True
        if (limit is not None and step >= limit) or rows < local:
            break
        yield batch
        step += 1
    if step == 0 and not read:
        raise DataError(f"{what} gave this worker no examples: its share is empty (sharded "
                        "by file, split the data into at least as many files as workers)")
    if step == 0 and epoch:
        raise DataError(f"epoch {epoch + 1} of {what} yielded fewer than {local} examples, "
                        "this worker's rows of one global batch: every epoch of a stream "
                        "needs one global batch")
    if step == 0:
        raise DataError(f"{what} yielded fewer than {local} examples, this worker's rows "
                        "of one global batch; lower --batch-size-per-replica")


def eval_slices(global_batches, global_batch, shard, what):
    """(this worker's slice, False) of every full global batch, then (the rest
    whole, True); DataError if there is nothing to evaluate."""
    seen = False
    for batch, rows in global_batches:
        seen = True
        if rows < global_batch:
            yield batch, True
        else:
            yield tree.take_rows(batch, worker_rows(global_batch, shard)), False
    if not seen:
        raise DataError(f"{what} is empty")
