"""Data from anywhere, turned into kdist's batches in one place for every engine.

`Inputs(train=..., test=...)` takes, for each split, what Keras `fit` takes:
NumPy arrays `(x, y)` or `(x, y, sample_weight)`, a batched
`tf.data.Dataset`, a `keras.utils.PyDataset`, or a function that returns an
iterator of batches (called once per epoch); also a batched Grain dataset
(`kdist.grainsource`) and TFRecord files (`kdist.TFRecords`). Each becomes a *source*
(`source_for`) with one interface the loop uses on every backend:

- `train(global_batch, seed=, epoch=, start_step=, limit=, shard=)`: a
  `Stream` of this worker's slices of the epoch's full global batches,
  from global batch `start_step` on (a resume), at most up to `limit`;
- `evaluate(global_batch, shard)`: a `Stream` of (batch, whole): this
  worker's slices of the full global batches, then the examples after the
  last one, whole, as one smaller batch (every worker the same);
- `size()`, `steps_per_epoch(global_batch, limit)`, `eval_steps(global_batch)`:
  counts, or None where only reading everything would tell;
- `sample(rows)`: the first rows, which build the compiled loss and metrics.

A pipeline's batches may hold any number of rows: they are re-cut here
(`cut`) into global batches of batch_size_per_replica x replicas, checked
batch by batch (`BatchCheck`). The pipeline kinds live in `kdist.pipelines`,
`kdist.pydatasets`, `kdist.grainsource` and `kdist.tfrecords`.
"""

import dataclasses
from typing import Any

import numpy as np

from kdist import data
from kdist.errors import DataError, UsageError

PARTS = ("x", "y", "sample weight")


@dataclasses.dataclass
class Inputs:
    """Train and test data from tf.data, a PyDataset, a function or arrays.

    `train` and `test` each take one of: a batched `tf.data.Dataset` of
    (x, y) or (x, y, sample_weight); a batched Grain `MapDataset` or
    `IterDataset`; `kdist.TFRecords` (files streamed from disk); a
    `keras.utils.PyDataset`; a function
    returning an iterator of such batches (called at every epoch, with the
    epoch if it takes an argument); or NumPy arrays `(x, y)` or
    `(x, y, sample_weight)`. `source` names the data in the banner.
    `evaluate_checkpoint` needs only `test`.
    """

    train: Any = None
    test: Any = None
    source: str | None = None


@dataclasses.dataclass
class Prepared:
    """The sources of a run's splits (None where a split is not needed)."""

    train: Any
    test: Any
    source: str
    arrays: Any = None  # The `kdist.data.Dataset` it was made from, if any.

    def size(self, split):
        """The examples of `split`, or None if unknown before reading it."""
        source = getattr(self, split)
        return None if source is None else source.size()

    def sample(self, rows=2):
        """The first `rows` examples of the training data (else the test data)."""
        return (self.train or self.test).sample(rows)


def prepare(dataset, splits=("train", "test")):
    """The `Prepared` sources of a `kdist.Dataset` or `Inputs`, checked before work."""
    if isinstance(dataset, Prepared):
        return dataset
    if isinstance(dataset, data.Dataset):
        data.check_dataset(dataset)
        train, test = (ArraySource(*dataset.split(s), f"{dataset.source}: the {s} set")
                       for s in ("train", "test"))
        return Prepared(train, test, dataset.source, arrays=dataset)
    if not isinstance(dataset, Inputs):
        raise UsageError(f"the data is a {type(dataset).__name__}; pass a kdist.Dataset "
                         "(NumPy arrays) or kdist.Inputs(train=..., test=...)")
    sources = {}
    for split in ("train", "test"):
        given = getattr(dataset, split)
        if given is None and split in splits:
            raise UsageError(f"kdist.Inputs has no {split} data; pass {split}=...")
        sources[split] = None if given is None else source_for(given, split)
        if sources[split] is not None:
            sources[split].sample(1)  # Reads the first batch: an empty or bad one fails now.
    kinds = ", ".join(f"{s} {v.kind}" for s, v in sources.items() if v is not None)
    return Prepared(sources["train"], sources["test"], dataset.source or kinds)


def source_for(given, split):
    """The source that reads `given`, one split's data (see `Inputs`)."""
    from kdist import grainsource, pipelines, pydatasets, tfrecords  # Loads Keras.

    what = f"the {split} data"
    if isinstance(given, tfrecords.TFRecords):
        return tfrecords.TFRecordSource(given, what)
    if pipelines.is_tf_dataset(given):
        return pipelines.TfDataSource(given, what)
    if pydatasets.is_py_dataset(given):
        return pydatasets.PyDatasetSource(given, what)
    if grainsource.is_grain(given):
        return grainsource.source_for(given, what)
    if _is_arrays(given):
        x, y, weights = tuple(given) + (None,) * (3 - len(given))
        data.check_split("kdist.Inputs", split, x, y, weights)
        return ArraySource(x, y, weights, what)
    if callable(given):
        return pipelines.GeneratorSource(given, what)
    if hasattr(given, "__next__"):
        raise UsageError(f"{what} is an iterator, which can be read only once; pass a "
                         "function that returns a new one for every epoch, e.g. "
                         f"{split}=lambda: my_batches()")
    raise UsageError(f"{what} is a {type(given).__name__}; kdist reads a batched "
                     "tf.data.Dataset or Grain MapDataset or IterDataset, a "
                     "keras.utils.PyDataset, a function returning an iterator of (x, y[, "
                     "sample_weight]) batches, or NumPy arrays (x, y[, sample_weight])")


def _is_arrays(given):
    return (isinstance(given, tuple) and len(given) in (2, 3) and given[1] is not None
            and all(isinstance(a, np.ndarray) for a in data.leaves(given)))


class SizedSource:
    """A source that knows its number of examples (`size`): its steps follow."""

    def steps_per_epoch(self, global_batch, limit=None):
        return data.steps_per_epoch(self.size(), global_batch, limit)

    def eval_steps(self, global_batch):
        return data.eval_steps(self.size(), global_batch)


class ArraySource(SizedSource):
    """NumPy arrays in memory: shuffled by (seed, epoch), sliced per worker
    (`kdist.data.train_batches`)."""

    kind = "NumPy arrays"

    def __init__(self, x, y, sample_weight, what):
        self.arrays, self.what = (x, y, sample_weight), what

    def size(self):
        return data.num_examples(self.arrays[0])

    def sample(self, rows=2):
        return data.take_rows(self.arrays, slice(0, rows))

    def train(self, global_batch, *, seed, epoch, start_step=0, limit=None, shard=(0, 1)):
        return Stream(data.train_batches(
            *self.arrays, global_batch, seed=seed, epoch=epoch, start_step=start_step,
            steps=self.steps_per_epoch(global_batch, limit), shard=shard))

    def evaluate(self, global_batch, shard=(0, 1)):
        def batches():
            for batch in data.eval_batches(*self.arrays, global_batch, shard):
                yield batch, False
            tail = data.eval_tail(*self.arrays, global_batch)
            if tail is not None:
                yield tail, True

        return Stream(batches())


class Stream:
    """One pass over a source's batches, counting what it yields and whether it ran out.

    The loop learns from it whether an epoch ended (`finished`) without
    knowing the epoch's length beforehand.
    """

    def __init__(self, batches):
        self._batches = batches
        self.count = 0
        self.ended = False

    def __iter__(self):
        for batch in self._batches:
            self.count += 1
            yield batch
        self.ended = True

    def finished(self, consumed):
        """Whether the pass ran out and the consumer took all `consumed` of its batches."""
        return self.ended and consumed == self.count


class BatchCheck:
    """Checks a source's batches, one by one, against its first.

    A batch is a tuple (x, y) or (x, y, sample_weight), each an array or a
    tuple, list or dict of arrays, every array with the same number of rows;
    every batch holds examples of the first batch's structure, shapes and
    dtypes (only the number of rows may change).
    """

    def __init__(self, what):
        self.what = what
        self.specs = None

    def __call__(self, batch, index):
        """(batch as (x, y, sample_weight) of NumPy arrays, its rows); DataError if bad."""
        if isinstance(batch, list):
            batch = tuple(batch)
        if not isinstance(batch, tuple) or len(batch) not in (2, 3):
            raise DataError(f"{self.what}: batch {index} is a {type(batch).__name__}; every "
                            "batch must be a tuple (x, y) or (x, y, sample_weight), as for fit")
        batch = tuple(data.map_arrays(np.asarray, part) for part in batch)
        batch += (None,) * (3 - len(batch))
        lengths = [(name, a.shape[0] if a.ndim else None)
                   for name, part in zip(PARTS, batch) for a in data.leaves(part)]
        if any(n is None for _, n in lengths):
            name = next(name for name, n in lengths if n is None)
            raise DataError(f"{self.what}: batch {index} has a scalar {name}, a single "
                            "example; give batches (a first axis of examples), as for fit")
        if len({n for _, n in lengths}) > 1:
            raise DataError(f"{self.what}: batch {index} holds arrays of different lengths (" +
                            ", ".join(f"{name} {n}" for name, n in lengths) + "); x, y and "
                            "the sample weights need one row per example")
        specs = tuple(data.map_arrays(_spec, part) for part in batch)
        if self.specs is None:
            self.specs = specs
        elif specs != self.specs:
            name, now, first = next(p for p in zip(PARTS, specs, self.specs) if p[1] != p[2])
            raise DataError(f"{self.what}: batch {index} changes shape: its {name} holds "
                            f"{_show(now)} where the first batch's held {_show(first)}; every "
                            "batch needs the same example shapes and dtypes (only the number "
                            "of rows may vary)")
        return batch, lengths[0][1]


def _spec(array):
    return f"{array.dtype} {tuple(array.shape[1:])}"


def _show(spec):
    found = data.leaves(spec) if spec is not None else []
    return ", ".join(found) if found else "nothing"


def concat(batches):
    """Batches of one structure joined along their rows."""
    if len(batches) == 1:
        return batches[0]
    return tuple(data.map_arrays(lambda *arrays: np.concatenate(arrays), *parts)
                 for parts in zip(*batches))


def drop_rows(checked, count):
    """(batch, rows) pairs after the first `count` rows of the stream."""
    for batch, rows in checked:
        if count >= rows:
            count -= rows
            continue
        if count:
            batch, rows, count = data.take_rows(batch, slice(count, None)), rows - count, 0
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
            yield data.take_rows(whole, slice(0, size)), size
            rows -= size
            parts = [data.take_rows(whole, slice(size, None))] if rows else []
    if rows:
        yield concat(parts), rows


def worker_rows(global_batch, shard):
    """The rows of a global batch that worker `shard[0]` of `shard[1]` feeds."""
    index, count = shard
    local = global_batch // count
    return slice(index * local, (index + 1) * local)


def train_slices(global_batches, global_batch, start_step, limit, shard, what):
    """This worker's slices of full global batches numbered from `start_step`, up to
    `limit` (nothing read beyond it); DataError if a pass from the start has not
    one full global batch."""
    step, short, pairs = start_step, 0, iter(global_batches)
    while limit is None or step < limit:
        batch, rows = next(pairs, (None, 0))
        if rows < global_batch:
            short = rows
            break
        yield data.take_rows(batch, worker_rows(global_batch, shard))
        step += 1
    if step == 0:
        raise DataError(f"{what} is empty" if not short else
                        f"{what} holds {short} examples, fewer than one global batch of "
                        f"{global_batch}; lower batch_size_per_replica")


def eval_slices(global_batches, global_batch, shard, what):
    """(this worker's slice, False) of every full global batch, then (the rest
    whole, True); DataError if there is nothing to evaluate."""
    seen = False
    for batch, rows in global_batches:
        seen = True
        if rows < global_batch:
            yield batch, True
        else:
            yield data.take_rows(batch, worker_rows(global_batch, shard)), False
    if not seen:
        raise DataError(f"{what} is empty")
