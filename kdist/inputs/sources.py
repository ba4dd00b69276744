"""Data from anywhere, turned into a source (`kdist.inputs.base`) for every engine.

`base.Inputs(train=..., test=...)` takes, for each split, what Keras `fit` takes:
NumPy arrays `(x, y)` or `(x, y, sample_weight)`, a batched
`tf.data.Dataset`, a `keras.utils.PyDataset`, or a function that returns an
iterator of batches (called once per epoch); also a batched Grain dataset
and TFRecord files (`kdist.TFRecords`). `source_for` picks the kind's
source: `kdist.inputs.arrays`, `pipelines` (tf.data and functions),
`pydatasets`, `grainsource` and `tfrecords`.
"""


from typing import Any

import numpy as np

from kdist import tree
from kdist.errors import UsageError
from kdist.inputs import (
    arrays,
    base,
    batching,
    grainsource,
    pipelines,
    pydatasets,
    tfdata,
    tfrecords,
)
from kdist.inputs.arrays import ArraySource


def prepare(dataset, splits=("train", "test")):
    """The `Prepared` sources of a `kdist.Dataset` or `Inputs`, checked before work."""
    if isinstance(dataset, base.Prepared):
        return dataset
    if isinstance(dataset, arrays.Dataset):
        arrays.check_dataset(dataset)
        train, test = (ArraySource(*dataset.split(s), f"{dataset.source}: the {s} set")
                       for s in ("train", "test"))
        return base.Prepared(train, test, dataset.source, arrays=dataset)
    if not isinstance(dataset, base.Inputs):
        raise UsageError(f"the data is a {type(dataset).__name__}; pass a kdist.Dataset "
                         "(NumPy arrays) or kdist.Inputs(train=..., test=...)")
    if dataset.test is dataset.train and type(dataset.train).__module__.startswith("tensorflow"):
        raise UsageError(
            "the train and test data are one tf.data pipeline: each evaluation's pass moves "
            "its reshuffling, so a resumed run would not replay the order trained; pass the "
            "test data as a pipeline of its own (the same code run again)")
    sources = {}
    for split in ("train", "test"):
        given = getattr(dataset, split)
        if given is None and split in splits:
            raise UsageError(f"kdist.Inputs has no {split} data; pass {split}=...")
        source = None if given is None else source_for(given, split)
        if source is not None:
            source.sample(1)  # Reads the first batch: an empty or bad one fails now.
        sources[split] = source
    kinds = ", ".join(f"{s} {v.kind}" for s, v in sources.items() if v is not None)
    return base.Prepared(sources["train"], sources["test"], dataset.source or kinds)


def source_for(given: Any, split: str) -> base.Source:
    """The source that reads `given`, one split's data (see `Inputs`)."""
    what = f"the {split} data"
    if isinstance(given, tfrecords.TFRecords):
        return tfrecords.TFRecordSource(given, what)
    if tfdata.is_tf_dataset(given):
        return pipelines.TfDataSource(given, what)
    if pydatasets.is_py_dataset(given):
        return pydatasets.PyDatasetSource(given, what)
    if grainsource.is_grain(given):
        return grainsource.source_for(given, what)
    if _is_arrays(given):
        x, y, weights = tuple(given) + (None,) * (3 - len(given))
        arrays.check_split("kdist.Inputs", split, x, y, weights)
        return ArraySource(x, y, weights, what)
    if callable(given):
        return pipelines.GeneratorSource(given, what)
    if hasattr(given, "__next__"):
        raise UsageError(f"{what} is an iterator, which can be read only once; pass a "
                         "function that returns a new one for every epoch, e.g. "
                         f"{split}=lambda: my_batches()")
    if isinstance(given, tuple) and any(not isinstance(a, np.ndarray)
                                        for a in tree.leaves(given) if a is not None):
        kinds = ", ".join(sorted({type(a).__name__ for a in tree.leaves(given)
                                  if a is not None and not isinstance(a, np.ndarray)}))
        raise UsageError(f"{what} holds {kinds} values, not arrays; give NumPy arrays (x, "
                         "y[, sample_weight]): numpy.asarray(values)")
    raise UsageError(f"{what} is a {type(given).__name__}; kdist reads a batched "
                     "tf.data.Dataset or Grain MapDataset or IterDataset, a "
                     "keras.utils.PyDataset, a function returning an iterator of (x, y[, "
                     "sample_weight]) batches, or NumPy arrays (x, y[, sample_weight]) "
                     f"({batching.X_ALONE})")


def _is_arrays(given):
    return (isinstance(given, tuple) and len(given) in (2, 3) and given[1] is not None
            and all(isinstance(a, np.ndarray) for a in tree.leaves(given)))
