"""The benchmark's inputs: the same arrays given directly, or through tf.data,
a `keras.utils.PyDataset` or Grain (`kdist-bench --input`).

Each kind is built so that it does per batch what kdist's NumPy path does,
and the benchmark weighs how kdist takes each kind, not the pipeline's own
work (`input_source`). `scripts/input_cost.py` and
`scripts/tfdata_delete_check.py` measure these pipelines on their own.
"""

import keras
import numpy as np

from kdist.inputs import sources
from kdist.inputs.arrays import ArraySource


def input_source(kind, arrays, global_batch, split):
    """The kdist source (`kdist.inputs`) of split `split`'s arrays (x, y,
    sample_weight) given as `kind` (one of `kdist.choices.INPUTS`), in batches of
    `global_batch`.

    Every pipeline does per batch what the NumPy path does: it gathers the
    batch's rows, a fixed random set of `global_batch` rows (the last batch
    holds the rest), and shuffles the order of the batches each epoch
    (tf.data's and Grain's own shuffle; kdist's for a PyDataset). So the
    comparison weighs how kdist takes each kind. A shuffle of single examples
    (the tutorial's `shuffle(buffer)` before `batch`, Grain's `shuffle` before
    `batch`) adds the pipeline's own cost per example, for `fit` as for kdist
    (docs/performance.md, "Input pipelines").
    """
    x, y, weights = arrays
    if kind == "numpy":
        return ArraySource(x, y, weights, f"the {split} data")
    order = np.random.default_rng(0).permutation(len(x))
    full, batches = len(x) // global_batch, -(-len(x) // global_batch)

    def rows(order, batch):  # A NumPy array or a tf.Tensor of row indices.
        return order[batch * global_batch:(batch + 1) * global_batch]

    if kind == "tfdata":
        import tensorflow as tf

        images, labels, table = tf.constant(x), tf.constant(y), tf.constant(order)
        given = (tf.data.Dataset.range(full).shuffle(full, seed=0)
                 .concatenate(tf.data.Dataset.range(full, batches))
                 .map(lambda batch: (tf.gather(images, rows(table, batch)),
                                     tf.gather(labels, rows(table, batch))))
                 .prefetch(tf.data.AUTOTUNE))
    elif kind == "pydataset":
        given = _Batches(batches, lambda batch: (x[rows(order, batch)], y[rows(order, batch)]))
    else:
        import grain

        given = grain.MapDataset.concatenate([grain.MapDataset.range(full).shuffle(seed=0),
                                              grain.MapDataset.range(full, batches)])
        given = given.map(lambda batch: (x[rows(order, batch)], y[rows(order, batch)]))
    return sources.source_for(given, split)


class _Batches(keras.utils.PyDataset):
    """`count` batches, batch `index` being `get(index)`."""

    def __init__(self, count, get):
        super().__init__()
        self.count, self.get = count, get

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return self.get(index)
