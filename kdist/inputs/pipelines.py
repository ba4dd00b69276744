"""The pipelines kdist reads front to back: tf.data, and functions yielding batches.

Each is a source of `kdist.inputs` (see its docstring for the interface);
`kdist.inputs.pydatasets` reads a `keras.utils.PyDataset` by index. Their batches
may hold any number of rows; kdist re-cuts them into global batches. The
rules, per kind:

- `tf.data.Dataset`, batched (as for `fit`); read once per epoch, as `fit`
  does. Every worker reads the whole pipeline and keeps its slice of every
  global batch (TensorFlow's `AutoShardPolicy.DATA`), so the pipeline must
  give every worker the same elements (seed its shuffle). A resume replays
  the position: the epoch's iterator is the (epoch + 1)-th this source makes
  after the one that read its first batch, so a `shuffle(seed=...)` that
  reshuffles at every iteration gives the resumed epoch its order again;
  the batches already trained are skipped (`skip` where the batch size is
  static, else read and dropped). kdist reads several global batches at a
  time (`_for_reading`) where the element shapes allow it.
- A function returning an iterator of batches: called at the start of
  every epoch, with the epoch (from 0) if it takes an argument, and once
  more at the start to read the first batch; evaluation calls it as epoch
  0. Every worker reads the whole stream and keeps its slice. A resume
  calls it for the stopped epoch and reads and drops the batches already
  trained: exact if the function yields the same batches for the same
  epoch at every call (deterministic, or seeded by the epoch), otherwise
  the resumed epoch trains on whatever follows.

Infinite pipelines (`repeat()`) are refused: an epoch is one pass over the data.
"""

import inspect
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from kdist import tree
from kdist.errors import DataError
from kdist.inputs import base


def is_tf_dataset(given):
    tf = sys.modules.get("tensorflow")  # Loaded by whoever built a tf.data.Dataset.
    return tf is not None and isinstance(given, tf.data.Dataset)


class _StreamSource(base.CheckedSource):
    """A source read front to back, once per epoch; subclasses open the epoch's
    pass (`_open`), which may skip whole batches itself."""

    def __init__(self, what):
        self.what = what
        self.check = base.BatchCheck(what)
        self._first = None

    if TYPE_CHECKING:
        def _open(self, epoch: int | None, skip: int, global_batch: int | None
                  ) -> tuple[Iterator, int]: ...  # Each subclass's.

    def size(self) -> int | None:
        return None

    def sample(self, rows=2):
        if self._first is None:
            batches, _ = self._open(None, 0, None)
            first = next(batches, None)
            if first is None:
                raise DataError(f"{self.what} is empty")
            self._first, _ = self.check(first, 0)
        return tree.take_rows(self._first, slice(0, rows))

    def steps_per_epoch(self, global_batch, limit=None):
        size = self.size()
        return None if size is None else base.steps_per_epoch(size, global_batch, limit)

    def eval_steps(self, global_batch):
        size = self.size()
        return None if size is None else base.eval_steps(size, global_batch)

    def _checked(self, batches, first=0):
        """(batch, rows) of each batch, checked; `first` numbers the first in errors."""
        for index, batch in enumerate(batches, first):
            yield self.check(batch, index)

    def train(self, global_batch, *, seed, epoch, start_step=0, limit=None, shard=(0, 1)):
        del seed  # The pipeline's order is its own.

        def slices():
            skip = start_step * global_batch
            batches, skipped = self._open(epoch, skip, global_batch)
            # Only a source of static batches (`batch`) skips whole batches itself.
            first = skipped // cast(int, getattr(self, "batch", None)) if skipped else 0
            pairs = base.drop_rows(self._checked(batches, first), skip - skipped)
            yield from base.train_slices(base.cut(pairs, global_batch), global_batch,
                                           start_step, limit, shard, self.what)

        return base.Stream(slices())

    def evaluate(self, global_batch, shard=(0, 1)):
        def slices():
            batches, _ = self._open(0, 0, global_batch)
            yield from base.eval_slices(base.cut(self._checked(batches), global_batch),
                                          global_batch, shard, self.what)

        return base.Stream(slices())


class TfDataSource(_StreamSource):
    """A batched tf.data.Dataset of (x, y) or (x, y, sample_weight)."""

    kind = "tf.data.Dataset"

    def __init__(self, dataset, what):
        import tensorflow as tf

        super().__init__(what)
        self.check = base.BatchCheck(what, regrouped=True)
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
        self._read_as = {}  # Global batch -> the dataset read (`_for_reading`), made once.

    def size(self):
        if self.batch is None or self.batches is None:
            return None
        return self.batch * self.batches

    def _open(self, epoch, skip, global_batch):
        """(An iterator over epoch `epoch`'s batches, the rows it skipped): the
        (epoch + 1)-th iterator after the sample's, made after throw-away ones
        if needed, so a pipeline that reshuffles at every iteration replays.
        Given `global_batch`, it reads several at a time (`_for_reading`)."""
        if epoch is not None:
            while self._made < 1 + epoch:
                iter(self.dataset)
                self._made += 1
        whole = skip // self.batch if self.batch else 0
        self._made += 1
        if whole:
            dataset = _for_reading(self.dataset.skip(whole), global_batch)
        else:
            dataset = self._reading(global_batch)
        return numpy_batches(dataset, self.what), whole * (self.batch or 0)

    def _reading(self, global_batch):
        """The dataset read for `global_batch` (`_for_reading`), made once:
        tf.data optimises a new dataset's graph at its first iterator, a cost
        that a dataset made per epoch would pay every epoch (docs/performance.md,
        "Input pipelines")."""
        if global_batch not in self._read_as:
            self._read_as[global_batch] = _for_reading(self.dataset, global_batch)
        return self._read_as[global_batch]

    def evaluate(self, global_batch, shard=(0, 1)):
        def slices():
            batches = numpy_batches(self._reading(global_batch), self.what)  # Any order.
            yield from base.eval_slices(base.cut(self._checked(batches), global_batch),
                                          global_batch, shard, self.what)

        return base.Stream(slices())


class GeneratorSource(_StreamSource):
    """A function returning an iterator of batches, called once per epoch; one with
    a `shard` parameter returns this worker's share (`train`)."""

    kind = "function"

    def __init__(self, make, what):
        super().__init__(what)
        self.make = make
        self.takes_epoch = _takes_argument(make)
        self.takes_shard = _has_parameter(make, "shard")

    def _open(self, epoch, skip, global_batch, shard=(0, 1)):
        args = (epoch or 0,) if self.takes_epoch else ()
        made = self.make(*args, shard=shard) if self.takes_shard else self.make(*args)
        if is_tf_dataset(made):  # A tf.data.Dataset made for the epoch.
            made = numpy_batches(_for_reading(made, global_batch), self.what)
        try:
            return iter(made), 0
        except TypeError:
            raise DataError(f"{self.what}: the function returned a {type(made).__name__}, "
                            "not an iterator of batches") from None

    def train(self, global_batch, *, seed, epoch, start_step=0, limit=None, shard=(0, 1)):
        """With `shard` (index, count) of several workers and a function that takes
        `shard`: its share, cut into this worker's rows of each global batch, read
        by it alone; the epoch ends where any worker's share runs out."""
        if not self.takes_shard or shard[1] == 1:
            return super().train(global_batch, seed=seed, epoch=epoch, start_step=start_step,
                                 limit=limit, shard=shard)
        local = global_batch // shard[1]

        def batches():
            made, _ = self._open(epoch, 0, global_batch, shard)
            pairs = base.drop_rows(self._checked(made), start_step * local)
            yield from base.local_batches(pairs, local, start_step, limit, self.what)

        return base.Stream(batches(), shared_end=True)


# How much kdist reads from a tf.data pipeline at a time: each read is a call
# from Python into TensorFlow and a hand-over from its threads, and one read
# per batch slowed training on a 2-core CPU whose cores the step keeps busy
# (docs/performance.md, "Input pipelines"). READ_BATCHES global batches per
# read, fewer where that would exceed READ_BYTES.
READ_BATCHES = 8
READ_BYTES = 64 * 2**20


def _for_reading(dataset, global_batch):
    """`dataset` re-cut to several global batches' rows per element
    (`Dataset.rebatch`, inside tf.data) where every part's shape past the batch
    axis is known, so that such elements cannot change shape; else `dataset`."""
    rows = _read_rows(dataset.element_spec, global_batch)
    return dataset if rows is None else dataset.rebatch(rows)


def _read_rows(spec, global_batch):
    """Rows per read of a dataset of elements `spec` (None: one element per read)."""
    import tensorflow as tf

    specs = tf.nest.flatten(spec)
    if global_batch is None or not all(s.shape[1:].is_fully_defined() for s in specs):
        return None
    batch_bytes = global_batch * sum(s.shape[1:].num_elements() * s.dtype.size for s in specs)
    return global_batch * max(1, min(READ_BATCHES, READ_BYTES // max(batch_bytes, 1)))


def numpy_batches(dataset, what):
    """An iterator over a tf.data.Dataset's elements as NumPy arrays. An element
    whose parts hold different numbers of rows (which `rebatch` finds) ends the
    read with one DataError.

    When the read ends (run out, or dropped at an epoch's step limit), the
    tf.data iterator is deleted on a thread of its own (`_delete_later`)."""
    import tensorflow as tf

    held = [dataset.as_numpy_iterator()]  # Its only reference, for `_delete_later`.
    try:
        yield from held[0]
    except Exception as error:  # Not GeneratorExit: a generator closed at exit has no tf.errors.
        if not (isinstance(error, tf.errors.InvalidArgumentError)
                and "same batch size in each component" in str(error)):
            raise
        detail = str(error).split("}}")[-1].strip().splitlines()[0]
        raise DataError(f"{what}: a batch holds arrays of different lengths ({detail}); x, y "
                        "and the sample weights need one row per example") from None
    finally:
        _delete_later(held)


def _delete_later(held):
    """Empties `held`, a list holding the only reference to a tf.data iterator,
    on a daemon thread, where the iterator is then deleted. Deleting one waits
    for its autotuning thread to wake, which sleeps for ever longer periods:
    on a busy CPU that blocked the reading thread for seconds at the end of
    an epoch (docs/performance.md, "Input pipelines"). The deleting thread
    holds no Python lock while it waits."""
    threading.Thread(target=held.clear, name="kdist-delete-iterator", daemon=True).start()


def _takes_argument(function):
    """Whether `function` has a positional parameter without a default."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               and p.default is p.empty for p in parameters)


def _has_parameter(function, name):
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def resume_note(source, step_in_epoch, global_batch):
    """What the banner adds when `source` resumes mid-epoch by reading and
    dropping what was trained: a function's batches may differ from call to call."""
    if not step_in_epoch or source.kind != "function":
        return ""
    return (f"; the train function is called again and its first "
            f"{step_in_epoch * global_batch:,} examples dropped: exact if it yields the "
            "same batches as before")
