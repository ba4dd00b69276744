"""The pipelines kdist reads front to back: tf.data, and functions yielding batches.

Each is a source of `kdist.inputs` (see its docstring for the interface);
`kdist.inputs.pydatasets` reads a `keras.utils.PyDataset` by index. Their batches
may hold any number of rows; kdist re-cuts them into global batches. The
rules, per kind:

- `tf.data.Dataset`, batched (as for `fit`); read once per epoch, as `fit`
  does. Every worker reads the whole pipeline and keeps its slice of every
  global batch (TensorFlow's `AutoShardPolicy.DATA`), so the pipeline must
  give every worker the same elements (seed its shuffle). A pipeline whose
  options ask for `AutoShardPolicy.FILE` is sharded by file instead
  (`kdist.inputs.tfdata.file_share`): each worker reads only its files, in
  batches of its rows of each global batch, and the epoch ends where any
  worker's share runs out. A resume replays the position: the epoch's
  iterator is the (epoch + 1)-th this source makes after the one that read
  its first batch, so a `shuffle(seed=...)` that reshuffles at every
  iteration gives the resumed epoch its order again; the batches already
  trained are skipped (`skip` where the batch size is static, else read and
  dropped). kdist reads several global batches at a time
  (`tfdata.for_reading`) where the element shapes allow it.
- A function returning an iterator of batches: called at the start of
  every epoch, with the epoch (from 0) if it takes an argument, and once
  more at the start to read the first batch; evaluation calls it as epoch
  0. Every worker reads the whole stream and keeps its slice, unless the
  function has a `shard` parameter: then it returns this worker's share. A resume
  calls it for the stopped epoch and reads and drops the batches already
  trained: exact if the function yields the same batches for the same
  epoch at every call (deterministic, or seeded by the epoch), otherwise
  the resumed epoch trains on whatever follows.

Infinite pipelines (`repeat()`) are refused: an epoch is one pass over the data.
"""

import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from kdist import tree
from kdist.errors import DataError
from kdist.inputs import base, batching, tfdata


class _StreamSource(batching.CheckedSource):
    """A source read front to back, once per epoch; subclasses open the epoch's
    pass (`_open`), which may skip whole batches itself, and say whether
    several workers each read a share of their own (`own_shares`)."""

    own_shares = False

    def __init__(self, what):
        self.what = what
        self.check = batching.BatchCheck(what)
        self._first = None

    if TYPE_CHECKING:
        def _open(self, epoch: int | None, skip: int, rows: int | None,
                  shard: tuple[int, int] = (0, 1)) -> tuple[Iterator, int]:
            """(An iterator over epoch `epoch`'s batches, or worker `shard`'s share of
            them, the rows it skipped of the first `skip`); `rows` is the unit read."""

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
        """This worker's slices of the epoch's global batches; with several workers
        and `own_shares`, its own share, read by it alone and cut into batches of
        its rows of each global batch, the epoch ending where any share runs out."""
        del seed  # The pipeline's order is its own.
        own = self.own_shares and shard[1] > 1
        rows = global_batch // shard[1] if own else global_batch

        def slices():
            skip = start_step * rows
            batches, skipped = self._open(epoch, skip, rows, shard if own else (0, 1))
            # Only a source of static batches (`batch`) skips whole batches itself.
            first = skipped // cast(int, getattr(self, "batch", None)) if skipped else 0
            pairs = batching.drop_rows(self._checked(batches, first), skip - skipped)
            if own:
                yield from batching.local_batches(pairs, rows, start_step, limit, self.what,
                                                  epoch)
            else:
                yield from batching.train_slices(batching.cut(pairs, global_batch), global_batch,
                                               start_step, limit, shard, self.what, epoch)

        return base.Stream(slices(), shared_end=own)

    def evaluate(self, global_batch, shard=(0, 1)):
        def slices():
            batches, _ = self._open(0, 0, global_batch)
            yield from batching.eval_slices(batching.cut(self._checked(batches), global_batch),
                                          global_batch, shard, self.what)

        return base.Stream(slices())


class TfDataSource(_StreamSource):
    """A batched tf.data.Dataset of (x, y) or (x, y, sample_weight); one whose
    options ask for AutoShardPolicy.FILE gives each worker its own files."""

    kind = "tf.data.Dataset"

    def __init__(self, dataset, what):
        import tensorflow as tf

        super().__init__(what)
        self.check = batching.BatchCheck(what, regrouped=True)
        self.dataset = dataset
        spec = dataset.element_spec
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise DataError(f"{what} is a tf.data.Dataset of {spec}; kdist needs elements "
                            f"(x, y) or (x, y, sample_weight) ({batching.X_ALONE})")
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
        self.own_shares = tfdata.asks_file_sharding(dataset)
        self._made = 0  # Iterators made so far: the first reads the sample.
        self._read_as = {}  # (rows, shard) -> the dataset read (`_reading`), made once.

    def size(self):
        if self.batch is None or self.batches is None:
            return None
        return self.batch * self.batches

    def steps_per_epoch(self, global_batch, limit=None):
        if self.own_shares:
            return None  # It depends on the workers' files: learned from the first epoch.
        return super().steps_per_epoch(global_batch, limit)

    def _open(self, epoch, skip, rows, shard=(0, 1)):
        """The (epoch + 1)-th iterator after the sample's, made after throw-away ones
        if needed, so a pipeline that reshuffles at every iteration replays (a
        worker's file share reshuffles with the pipeline it shares)."""
        if epoch is not None:
            while self._made < 1 + epoch:
                iter(self.dataset)
                self._made += 1
        whole = skip // self.batch if self.batch else 0
        self._made += 1
        if whole:
            dataset = tfdata.for_reading(self._share(shard).skip(whole), rows)
        else:
            dataset = self._reading(rows, shard)
        return tfdata.numpy_batches(dataset, self.what), whole * (self.batch or 0)

    def _share(self, shard):
        return self.dataset if shard[1] == 1 else tfdata.file_share(self.dataset, shard, self.what)

    def _reading(self, rows, shard=(0, 1)):
        """The dataset (or worker `shard`'s file share) read `rows` at a time
        (`tfdata.for_reading`), made once: tf.data optimises a new dataset's
        graph at its first iterator, a cost that a dataset made per epoch would
        pay every epoch (docs/performance.md, "Input pipelines")."""
        if (rows, shard) not in self._read_as:
            self._read_as[rows, shard] = tfdata.for_reading(self._share(shard), rows)
        return self._read_as[rows, shard]

    def evaluate(self, global_batch, shard=(0, 1)):
        def slices():
            batches = tfdata.numpy_batches(self._reading(global_batch), self.what)  # Any order.
            yield from batching.eval_slices(batching.cut(self._checked(batches), global_batch),
                                          global_batch, shard, self.what)

        return base.Stream(slices())


class GeneratorSource(_StreamSource):
    """A function returning an iterator of batches, called once per epoch; one with
    a `shard` parameter, (index, count), returns that worker's share."""

    kind = "function"

    def __init__(self, make, what):
        super().__init__(what)
        self.make = make
        self.takes_epoch = _takes_argument(make)
        self.own_shares = _has_parameter(make, "shard")

    def _open(self, epoch, skip, rows, shard=(0, 1)):
        args = (epoch or 0,) if self.takes_epoch else ()
        made = self.make(*args, shard=shard) if self.own_shares else self.make(*args)
        if tfdata.is_tf_dataset(made):  # A tf.data.Dataset made for the epoch.
            made = tfdata.numpy_batches(tfdata.for_reading(made, rows), self.what)
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


def _has_parameter(function, name):
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def resume_note(source, step_in_epoch, global_batch, workers=1):
    """What the banner adds when `source` resumes mid-epoch by reading and
    dropping what was trained: a function's batches may differ from call to call.
    A function told its shard drops its share of the `workers`' global batches."""
    if not step_in_epoch or source.kind != "function":
        return ""
    dropped = step_in_epoch * global_batch // (workers if source.own_shares else 1)
    return (f"; the train function is called again and its first {dropped:,} examples "
            "dropped: exact if it yields the same batches as before")
