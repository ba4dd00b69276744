"""The pipelines kdist reads: tf.data, keras.utils.PyDataset, and functions yielding batches.

Each is a source of `kdist.inputs` (see its docstring for the interface).
Their batches may hold any number of rows; kdist re-cuts them into global
batches. The rules, per kind:

- `tf.data.Dataset`, batched (as for `fit`); read once per epoch, as `fit`
  does. Every worker reads the whole pipeline and keeps its slice of every
  global batch (TensorFlow's `AutoShardPolicy.DATA`), so the pipeline must
  give every worker the same elements (seed its shuffle). A resume replays
  the position: the epoch's iterator is the (epoch + 1)-th this source makes
  after the one that read its first batch, so a `shuffle(seed=...)` that
  reshuffles at every iteration gives the resumed epoch its order again;
  the batches already trained are skipped (`skip` where the batch size is
  static, else read and dropped).
- `keras.utils.PyDataset`: read by index. Its batches are taken in an order
  shuffled by (seed, epoch), as `fit` shuffles a PyDataset's batches; every
  batch but the last must hold as many examples as the first. A worker reads
  only the batches that hold its rows of each global batch; a resume starts
  at its rows' index. `on_epoch_begin` / `on_epoch_end` are called around
  each epoch's steps; `workers`, `use_multiprocessing` and `max_queue_size`
  are not used (kdist reads one chunk ahead on one thread).
- A function returning an iterator of batches: called at the start of
  every epoch, with the epoch (from 0) if it takes an argument, and once
  more at the start to read the first batch; evaluation calls it as epoch
  0. Every worker reads the whole stream and keeps its slice. A resume
  calls it for the stopped epoch and reads and drops the batches already
  trained: exact if the function yields the same batches for the same
  epoch at every call (deterministic, or seeded by the epoch), otherwise
  the resumed epoch trains on whatever follows.

Infinite pipelines (`repeat()`, a PyDataset without an end) are refused: an
epoch is one pass over the data.
"""

import inspect
import sys

import numpy as np

from kdist import data, inputs
from kdist.errors import DataError


def is_tf_dataset(given):
    tf = sys.modules.get("tensorflow")  # Loaded by whoever built a tf.data.Dataset.
    return tf is not None and isinstance(given, tf.data.Dataset)


def is_py_dataset(given):
    import keras

    return isinstance(given, keras.utils.PyDataset)


class _StreamSource:
    """A source read front to back, once per epoch; subclasses open the epoch's
    pass (`_open`), which may skip whole batches itself."""

    def __init__(self, what):
        self.what = what
        self.check = inputs.BatchCheck(what)
        self._first = None

    def size(self):
        return None

    def sample(self, rows=2):
        if self._first is None:
            batches, _ = self._open(None, 0)
            first = next(batches, None)
            if first is None:
                raise DataError(f"{self.what} is empty")
            self._first, _ = self.check(first, 0)
        return data.take_rows(self._first, slice(0, rows))

    def steps_per_epoch(self, global_batch, limit=None):
        size = self.size()
        return None if size is None else data.steps_per_epoch(size, global_batch, limit)

    def eval_steps(self, global_batch):
        size = self.size()
        return None if size is None else data.eval_steps(size, global_batch)

    def _checked(self, batches, first=0):
        """(batch, rows) of each batch, checked; `first` numbers the first in errors."""
        for index, batch in enumerate(batches, first):
            yield self.check(batch, index)

    def train(self, global_batch, *, seed, epoch, start_step=0, limit=None, shard=(0, 1)):
        del seed  # The pipeline's order is its own.

        def slices():
            skip = start_step * global_batch
            batches, skipped = self._open(epoch, skip)
            first = skipped // getattr(self, "batch", None) if skipped else 0
            pairs = inputs.drop_rows(self._checked(batches, first), skip - skipped)
            yield from inputs.train_slices(inputs.cut(pairs, global_batch), global_batch,
                                           start_step, limit, shard, self.what)

        return inputs.Stream(slices())

    def evaluate(self, global_batch, shard=(0, 1)):
        def slices():
            batches, _ = self._open(0, 0)
            yield from inputs.eval_slices(inputs.cut(self._checked(batches), global_batch),
                                          global_batch, shard, self.what)

        return inputs.Stream(slices())


class TfDataSource(_StreamSource):
    """A batched tf.data.Dataset of (x, y) or (x, y, sample_weight)."""

    kind = "tf.data.Dataset"

    def __init__(self, dataset, what):
        import tensorflow as tf

        super().__init__(what)
        self.dataset = dataset
        spec = dataset.element_spec
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise DataError(f"{what} is a tf.data.Dataset of {spec}; kdist needs elements "
                            "(x, y) or (x, y, sample_weight), as fit")
        shapes = [s.shape for s in tf.nest.flatten(spec)]
        if any(shape.rank == 0 for shape in shapes):
            raise DataError(f"{what} is a tf.data.Dataset of single examples (a part of "
                            f"shape (), in {spec}): batch it, e.g. dataset.batch(64), as for "
                            "fit; kdist re-cuts its batches into global batches")
        leading = {shape[0] for shape in shapes if shape.rank is not None}
        self.batch = leading.pop() if len(leading) == 1 else None  # Static: drop_remainder.
        cardinality = int(dataset.cardinality())
        if cardinality == 0:
            raise DataError(f"{what} is empty (a tf.data.Dataset of no batches)")
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise DataError(f"{what} is an infinite tf.data.Dataset; an epoch is one pass "
                            "over the data: drop repeat() (steps_per_epoch limits an epoch)")
        self.batches = cardinality if cardinality > 0 else None
        self._made = 0  # Iterators made so far: the first reads the sample.

    def size(self):
        return None if None in (self.batch, self.batches) else self.batch * self.batches

    def _open(self, epoch, skip):
        """(An iterator over epoch `epoch`'s batches, the rows it skipped): the
        (epoch + 1)-th iterator after the sample's, made after throw-away ones
        if needed, so a pipeline that reshuffles at every iteration replays."""
        if epoch is not None:
            while self._made < 1 + epoch:
                iter(self.dataset)
                self._made += 1
        whole = skip // self.batch if self.batch else 0
        self._made += 1
        dataset = self.dataset.skip(whole) if whole else self.dataset
        return dataset.as_numpy_iterator(), whole * (self.batch or 0)

    def evaluate(self, global_batch, shard=(0, 1)):
        def slices():
            batches = self.dataset.as_numpy_iterator()  # Its order does not matter.
            yield from inputs.eval_slices(inputs.cut(self._checked(batches), global_batch),
                                          global_batch, shard, self.what)

        return inputs.Stream(slices())


class GeneratorSource(_StreamSource):
    """A function returning an iterator of batches, called once per epoch."""

    kind = "function"

    def __init__(self, make, what):
        super().__init__(what)
        self.make = make
        self.takes_epoch = _takes_argument(make)

    def _open(self, epoch, skip):
        made = self.make(epoch or 0) if self.takes_epoch else self.make()
        if hasattr(made, "as_numpy_iterator"):  # A tf.data.Dataset made for the epoch.
            made = made.as_numpy_iterator()
        try:
            return iter(made), 0
        except TypeError:
            raise DataError(f"{self.what}: the function returned a {type(made).__name__}, "
                            "not an iterator of batches") from None


def _takes_argument(function):
    """Whether `function` has a positional parameter without a default."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               and p.default is p.empty for p in parameters)


def _nothing():
    pass


def resume_note(source, step_in_epoch, global_batch):
    """What the banner adds when `source` resumes mid-epoch by reading and
    dropping what was trained: a function's batches may differ from call to call."""
    if not step_in_epoch or source.kind != "function":
        return ""
    return (f"; the train function is called again and its first "
            f"{step_in_epoch * global_batch:,} examples dropped: exact if it yields the "
            "same batches as before")


class PyDatasetSource:
    """A keras.utils.PyDataset, read by index (see the module docstring); a subclass
    reads another indexed kind through `_count`, `_get` and `_order`."""

    kind = "PyDataset"

    def __init__(self, dataset, what):
        self.dataset, self.what = dataset, what
        self.check = inputs.BatchCheck(what)
        count = self._count()
        if count == 0:
            raise DataError(f"{what} is empty (a {self.kind} of no batches)")
        self.first, self.batch = self.check(self._get(0, 0), 0)
        last = (self.first, self.batch) if count == 1 else self.check(
            self._get(count - 1, 0), count - 1)
        self.sizes = np.full(count, self.batch, np.int64)
        self.sizes[-1] = last[1]
        self._cached = (None, None)

    def _count(self):
        """The batches of an epoch; DataError if unknown or infinite."""
        try:
            count = self.dataset.num_batches
        except NotImplementedError:
            raise DataError(f"{self.what} is a PyDataset without a length; define __len__ "
                            "(its number of batches)") from None
        if count is None:
            raise DataError(f"{self.what} is an infinite PyDataset (num_batches None); an "
                            "epoch is one pass over the data: give it a length")
        return count

    def _get(self, index, epoch):
        """Batch `index` of epoch `epoch` (a PyDataset's are the same every epoch)."""
        return self.dataset[index]

    def _order(self, seed, epoch):
        """The batches in the order epoch `epoch` reads them: shuffled by (seed, epoch),
        as fit shuffles a PyDataset's batches."""
        return np.random.default_rng([seed, epoch]).permutation(len(self.sizes))

    def size(self):
        return int(self.sizes.sum())

    def sample(self, rows=2):
        return data.take_rows(self.first, slice(0, rows))

    def steps_per_epoch(self, global_batch, limit=None):
        return data.steps_per_epoch(self.size(), global_batch, limit)

    def eval_steps(self, global_batch):
        return data.eval_steps(self.size(), global_batch)

    def _read(self, index, epoch):
        """Batch `index` of epoch `epoch`, checked; the last one read is kept
        (neighbouring slices share it)."""
        index = int(index)
        if self._cached[0] != (epoch, index):
            batch, rows = self.check(self._get(index, epoch), index)
            if rows != self.sizes[index]:
                raise DataError(f"{self.what}: PyDataset batch {index} holds {rows} examples; "
                                f"every batch but the last must hold {self.batch}, as the "
                                "first does")
            self._cached = ((epoch, index), batch)
        return self._cached[1]

    def _rows(self, order, starts, first, stop, epoch=0):
        """Rows [first, stop) of the pass that reads batches in `order`; `starts`
        holds where each begins (and the pass's end)."""
        parts = []
        position = int(np.searchsorted(starts, first, "right")) - 1
        while first < stop:
            end = min(stop, int(starts[position + 1]))
            parts.append(data.take_rows(self._read(order[position], epoch),
                                        slice(first - starts[position], end - starts[position])))
            first, position = end, position + 1
        return inputs.concat(parts)

    def _layout(self, order):
        return np.concatenate([[0], np.cumsum(self.sizes[order])])

    def train(self, global_batch, *, seed, epoch, start_step=0, limit=None, shard=(0, 1)):
        def slices():
            order = self._order(seed, epoch)
            starts = self._layout(order)
            steps = self.steps_per_epoch(global_batch, limit)
            rows = inputs.worker_rows(global_batch, shard)
            self._cached = (None, None)
            getattr(self.dataset, "on_epoch_begin", _nothing)()  # A PyDataset's hooks.
            for step in range(start_step, steps):
                offset = step * global_batch
                yield self._rows(order, starts, offset + rows.start, offset + rows.stop, epoch)
            getattr(self.dataset, "on_epoch_end", _nothing)()

        return inputs.Stream(slices())

    def evaluate(self, global_batch, shard=(0, 1)):
        def slices():
            order = np.arange(len(self.sizes))
            starts, size = self._layout(order), self.size()
            full, rows = self.eval_steps(global_batch), inputs.worker_rows(global_batch, shard)
            for step in range(full):
                offset = step * global_batch
                yield self._rows(order, starts, offset + rows.start, offset + rows.stop), False
            if size > full * global_batch:
                yield self._rows(order, starts, full * global_batch, size), True

        return inputs.Stream(slices())
