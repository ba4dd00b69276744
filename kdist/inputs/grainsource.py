"""Grain datasets (`pip install kdist[grain]`): sources of `kdist.inputs`.

Grain (the `grain` package) is Google's data loading library for JAX and
Keras. kdist reads its two dataset kinds, batched as for Keras `fit`:

- `grain.MapDataset`, read by index as a PyDataset is
  (`kdist.inputs.pydatasets.PyDatasetSource`): each worker reads only the batches
  that hold its rows of each global batch, and a resume starts at the index
  of the first row not trained. Epoch `e` reads indices `e * len(dataset)`
  to `(e + 1) * len(dataset) - 1`, Grain's own numbering of a dataset's
  epochs, so a `shuffle(seed=...)` before `batch` gives every epoch its own
  order, replayed exactly on a resume. kdist adds no shuffle of its own.
- `grain.IterDataset`, read front to back once per epoch as a tf.data
  pipeline is: every worker reads it whole and keeps its slice of each
  global batch; a resume iterates it again and drops the batches already
  trained (exact: a Grain pipeline is deterministic). Each epoch iterates it
  anew, in the same order unless its pipeline changes it; for an order per
  epoch pass a `MapDataset`, or a function of the epoch returning an
  `IterDataset`.

A `grain.DataLoader` is refused with the way to write it as a dataset, as
are infinite datasets (`repeat()` without a count) and a `MapDataset`
whose `filter` drops batches.
"""

import sys

import numpy as np

from kdist.errors import DataError, UsageError
from kdist.inputs import pipelines, pydatasets


def is_grain(given):
    grain = sys.modules.get("grain")  # Loaded by whoever built a Grain dataset.
    return grain is not None and isinstance(
        given, (grain.MapDataset, grain.IterDataset, grain.DataLoader))


def source_for(given, what):
    """The source of a Grain dataset (`is_grain(given)`)."""
    import grain

    if isinstance(given, grain.DataLoader):
        raise UsageError(f"{what} is a grain.DataLoader; kdist shards and resumes the data "
                         "itself: pass its dataset, e.g. grain.MapDataset.source(source)"
                         ".shuffle(seed=0).map(...).batch(64)")
    if _infinite(given):
        raise DataError(f"{what} is an infinite Grain dataset (repeat() without a count); "
                        "an epoch is one pass over the data: drop repeat() "
                        "(steps_per_epoch limits an epoch)")
    if isinstance(given, grain.MapDataset):
        return GrainMapSource(given, what)
    return GrainIterSource(given, what)


def _infinite(dataset):
    """Whether `dataset` or a `MapDataset` it reads has an infinite length."""
    import grain

    if isinstance(dataset, grain.MapDataset) and len(dataset) >= sys.maxsize:
        return True
    return any(_infinite(parent) for parent in dataset.parents)


class GrainMapSource(pydatasets.PyDatasetSource):
    """A batched grain.MapDataset, read by index (see the module docstring)."""

    kind = "grain.MapDataset"

    def _count(self):
        return len(self.dataset)

    def _get(self, index, epoch):
        batch = self.dataset[epoch * len(self.dataset) + index]
        if batch is None:
            raise DataError(f"{self.what}: Grain batch {index} is None (dropped by a "
                            "filter()); a MapDataset is read by index and needs every batch: "
                            "filter after to_iter_dataset()")
        return batch

    def _order(self, seed, epoch):
        del seed  # The dataset's order is its own (Grain numbers each epoch's indices).
        return np.arange(len(self.sizes))


class GrainIterSource(pipelines.GeneratorSource):
    """A batched grain.IterDataset, iterated anew at every epoch."""

    kind = "grain.IterDataset"

    def __init__(self, dataset, what):
        super().__init__(lambda: dataset, what)
