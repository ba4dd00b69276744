"""The one interface every input has for the loop (a *source*).

A source has, on every backend:

- `train(global_batch, seed=, epoch=, start_step=, limit=, shard=)`: a
  `Stream` of this worker's slices of the epoch's full global batches,
  from global batch `start_step` on (a resume), at most up to `limit`;
- `evaluate(global_batch, shard)`: a `Stream` of (batch, whole): this
  worker's slices of the full global batches, then the examples after the
  last one, whole, as one smaller batch (every worker the same);
- `size()`, `steps_per_epoch(global_batch, limit)`, `eval_steps(global_batch)`:
  counts, or None where only reading everything would tell;
- `sample(rows)`: the first rows, which build the compiled loss and metrics.

A pipeline's batches may hold any number of rows: `kdist.inputs.batching`
checks them and re-cuts them into global batches.
"""


import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable


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
    Without `test` a run trains and checkpoints with no evaluation;
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
    arrays: Any = None  # The `kdist.inputs.arrays.Dataset` it was made from, if any.

    def size(self, split):
        """The examples of `split`, or None if unknown before reading it."""
        source = getattr(self, split)
        return None if source is None else source.size()

    def sample(self, rows=2):
        """The first `rows` examples of the training data (else the test data)."""
        return (self.train or self.test).sample(rows)


def eval_steps(num_examples, global_batch_size):
    """The full global batches of `num_examples` (the rest is one smaller tail batch)."""
    return num_examples // global_batch_size


def steps_per_epoch(num_examples, global_batch_size, limit=None):
    """Full global batches per epoch, capped by `limit` (like `fit`'s steps_per_epoch)."""
    steps = num_examples // global_batch_size
    return steps if limit is None else min(steps, limit)


Batch = tuple[Any, Any, Any]
"""(x, y, sample_weight): x and y an array or a tuple, list or dict of arrays,
sample_weight an array of shape (N,) or None."""


@runtime_checkable
class Source(Protocol):
    """What the loop reads any input through, on every backend (the module's
    docstring says what each member returns). `kdist.inputs.sources.source_for`
    picks the kind's class; every input kind implements this."""

    kind: str
    """The input kind, for the banner ("NumPy arrays", "tf.data.Dataset", ...)."""

    def size(self) -> int | None:
        """The examples of the split, or None where only reading everything would tell."""
        ...

    def sample(self, rows: int = 2) -> Batch:
        """The first `rows` examples, which build the compiled loss and metrics."""
        ...

    def steps_per_epoch(self, global_batch: int, limit: int | None = None) -> int | None:
        """Full global batches per epoch, capped by `limit`; None where unknown."""
        ...

    def eval_steps(self, global_batch: int) -> int | None:
        """Full global batches of an evaluation pass; None where unknown."""
        ...

    def train(self, global_batch: int, *, seed: int, epoch: int, start_step: int = 0,
              limit: int | None = None, shard: tuple[int, int] = (0, 1)) -> "Stream":
        """This worker's slices of the epoch's full global batches, from `start_step` on."""
        ...

    def evaluate(self, global_batch: int, shard: tuple[int, int] = (0, 1)) -> "Stream":
        """(batch, whole) pairs: this worker's slices of the full global batches, then
        the rest, whole, as one smaller batch."""
        ...

    def expect_classes(self, classes: int) -> None:
        """Class-index labels must lie in 0..classes-1: checked batch by batch as
        they stream (`BatchCheck`), or at once where the source holds arrays."""
        ...


class SizedSource:
    """A source that knows its number of examples (`size`): its steps follow."""

    if TYPE_CHECKING:
        def size(self) -> int: ...  # Each subclass's.

    def steps_per_epoch(self, global_batch, limit=None):
        return steps_per_epoch(self.size(), global_batch, limit)

    def eval_steps(self, global_batch):
        return eval_steps(self.size(), global_batch)


class Stream:
    """One pass over a source's batches, counting what it yields and whether it ran out.

    The loop learns from it whether an epoch ended (`finished`) without
    knowing the epoch's length beforehand. A stream of this worker's own share
    (`shared_end`: the workers' shares may end at different steps) ends where
    the workers agree it does (`kdist.loop.chunks.run_steps` calls `end_agreed`).
    """

    def __init__(self, batches, shared_end=False):
        self._batches = batches
        self.count = 0
        self.ended = False
        self.shared_end = shared_end
        self._agreed = False

    def __iter__(self):
        for batch in self._batches:
            self.count += 1
            yield batch
        self.ended = True

    def end_agreed(self):
        """The workers agreed that the epoch ends here, where some worker's share ran out."""
        self._agreed = True

    def finished(self, consumed):
        """Whether the pass ran out (or the workers agreed it ended) and the consumer
        took all `consumed` of its batches."""
        return self._agreed or (self.ended and consumed == self.count)
