"""A `keras.utils.PyDataset` as a source of `kdist.inputs`, read by index.

Its batches are taken in an order shuffled by (seed, epoch), as `fit`
shuffles a PyDataset's batches; every batch but the last must hold as many
examples as the first. A worker reads only the batches that hold its rows of
each global batch; a resume starts at its rows' index. `on_epoch_begin` /
`on_epoch_end` are called around each epoch's steps, and, before a resumed
run's first epoch, once for each earlier epoch the object has not seen
(`_catch_up`), so one that reshuffles its rows there reads what an
uninterrupted run reads; `workers`,
`use_multiprocessing` and `max_queue_size` are not used (kdist reads one
chunk ahead on one thread). A PyDataset without a length, or an infinite
one (`num_batches` None), is refused: an epoch is one pass over the data.
`kdist.inputs.grainsource` reads a Grain `MapDataset` the same way.
"""

from typing import Any

import numpy as np

from kdist import tree
from kdist.errors import DataError
from kdist.inputs import arrays, base, batching

_SEEN = "_kdist_epochs_seen"  # On the object: the epochs whose hooks have run.


def is_py_dataset(given):
    import keras

    return isinstance(given, keras.utils.PyDataset)


class PyDatasetSource(base.SizedSource, batching.CheckedSource):
    """A keras.utils.PyDataset, read by index (see the module docstring); a subclass
    reads another indexed kind through `_count`, `_get` and `_order`."""

    kind = "PyDataset"

    def __init__(self, dataset, what):
        self.dataset, self.what = dataset, what
        self.check = batching.BatchCheck(what)
        count = self._count()
        if count == 0:
            raise DataError(f"{what} is empty (a {self.kind} of no batches)")
        self.first, self.batch = self.check(self._get(0, 0), 0)
        last = (self.first, self.batch) if count == 1 else self.check(
            self._get(count - 1, 0), count - 1)
        self.sizes = np.full(count, self.batch, np.int64)
        self.sizes[-1] = last[1]
        # ((epoch, index), batch) of the batch read last.
        self._cached: tuple[tuple[int, int] | None, Any] = (None, None)

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
        return arrays.epoch_order(len(self.sizes), seed, epoch)

    def size(self):
        return int(self.sizes.sum())

    def sample(self, rows=2):
        return tree.take_rows(self.first, slice(0, rows))

    def _read(self, index, epoch):
        """Batch `index` of epoch `epoch`, checked; the last one read is kept
        (neighbouring slices share it)."""
        index = int(index)
        if self._cached[0] != (epoch, index):
            batch, rows = self.check(self._get(index, epoch), index)
            if rows != self.sizes[index]:
                raise DataError(f"{self.what}: {self.kind} batch {index} holds {rows} "
                                f"examples; every batch but the last must hold {self.batch}, "
                                "as the first does (kdist finds each row's batch from that); "
                                "pass batches of other sizes as a function returning an "
                                "iterator of them")
            self._cached = ((epoch, index), batch)
        return self._cached[1]

    def _rows(self, order, starts, first, stop, epoch=0):
        """Rows [first, stop) of the pass that reads batches in `order`; `starts`
        holds where each begins (and the pass's end)."""
        parts = []
        position = int(np.searchsorted(starts, first, "right")) - 1
        while first < stop:
            end = min(stop, int(starts[position + 1]))
            parts.append(tree.take_rows(self._read(order[position], epoch),
                                        slice(first - starts[position], end - starts[position])))
            first, position = end, position + 1
        return batching.concat(parts)

    def _layout(self, order):
        return np.concatenate([[0], np.cumsum(self.sizes[order])])

    def train(self, global_batch, *, seed, epoch, start_step=0, limit=None, shard=(0, 1)):
        def slices():
            order = self._order(seed, epoch)
            starts = self._layout(order)
            steps = self.steps_per_epoch(global_batch, limit)
            rows = batching.worker_rows(global_batch, shard)
            self._cached = (None, None)
            self._catch_up(epoch)
            getattr(self.dataset, "on_epoch_begin", _nothing)()  # A PyDataset's hooks.
            for step in range(start_step, steps):
                offset = step * global_batch
                yield self._rows(order, starts, offset + rows.start, offset + rows.stop, epoch)
            getattr(self.dataset, "on_epoch_end", _nothing)()
            self._seen(epoch + 1)

        return base.Stream(slices())

    def _catch_up(self, epoch):
        """Calls the hooks of the epochs before `epoch` that the object has not seen
        (a resumed run's; the count is noted on the object, so one that trained
        them in this process is not moved again)."""
        for _ in range(getattr(self.dataset, _SEEN, 0), epoch):
            getattr(self.dataset, "on_epoch_begin", _nothing)()
            getattr(self.dataset, "on_epoch_end", _nothing)()
        self._seen(epoch)

    def _seen(self, epochs):
        """Notes on a dataset with hooks (a PyDataset) that it has seen `epochs`."""
        if hasattr(self.dataset, "on_epoch_end"):
            setattr(self.dataset, _SEEN, max(epochs, getattr(self.dataset, _SEEN, 0)))

    def evaluate(self, global_batch, shard=(0, 1)):
        def slices():
            order = np.arange(len(self.sizes))
            starts, size = self._layout(order), self.size()
            full, rows = self.eval_steps(global_batch), batching.worker_rows(global_batch, shard)
            for step in range(full):
                offset = step * global_batch
                yield self._rows(order, starts, offset + rows.start, offset + rows.stop), False
            if size > full * global_batch:
                yield self._rows(order, starts, full * global_batch, size), True

        return base.Stream(slices())


def _nothing():
    pass
