"""Data sets larger than memory: TFRecord shard files, written once, streamed by tf.data.

`write(folder, split, x, y, shards)` writes one split's examples into
`shards` files `SPLIT-00000-of-0000N.tfrecord` (each example a
`tf.train.Example` of x's and y's raw bytes) and records in
`kdist-records.json` each file's examples and the arrays' dtypes and example
shapes. `TFRecords(folder, split)` is a kdist input
(`kdist.Inputs(train=TFRecords(d, "train"), test=TFRecords(d, "test"))`):
read with tf.data (TensorFlow must be installed, on either backend), never
held in memory whole.

- Training, with W workers and at least W files: worker i opens only files
  i, i + W, ... (file-level sharding) and its batches of global batch / W
  examples are its slices of the global batches. Every worker trains as
  many steps as the worker with the fewest examples has batches (the
  metadata tells each how many), so a count of files that W divides, of
  equal sizes, uses every example. With fewer files than workers (and with
  one worker), every worker reads every file and keeps its slice of each
  global batch, as for a tf.data pipeline.
- Order: each epoch a worker reads its files in an order shuffled by (seed,
  epoch, worker) through a shuffle buffer of `shuffle_buffer` examples
  seeded alike; `shuffle_buffer=0` reads the files and examples in the
  order written. A resume skips the batches already trained: the pipeline
  is the same at every call, so it is exact.
- Evaluation: every worker reads every file in order and keeps its slice of
  each full global batch; the examples after the last run whole: every
  example once.
- `transform`, a function of the batch's (x, y) tensors returning (x, y),
  runs in the pipeline (`scale_images` turns uint8 pixels into float32 / 255).
"""

import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from kdist import tree
from kdist.errors import DataError, UsageError
from kdist.inputs import base, batching, tfdata

INDEX = "kdist-records.json"
READ_BUFFER = 1 << 20  # Bytes read ahead per file.


def _spec(array):
    return {"dtype": array.dtype.name, "shape": list(array.shape[1:])}


def write(folder, split, x, y, shards=8):
    """Writes arrays `x` and `y` (one row per example, any sliceable arrays,
    e.g. `np.load(..., mmap_mode="r")`) as split `split` of `folder` in
    `shards` files of equal sizes (to one example); returns their paths."""
    n = len(x)
    if len(y) != n or not 1 <= shards <= n:
        raise DataError(f"{split}: {n} x rows, {len(y)} y rows in {shards} files; x and y "
                        "need one row per example and every file at least one")
    bounds = np.linspace(0, n, shards + 1).astype(int)
    return write_files(folder, split, ((x[a:b], y[a:b]) for a, b in zip(bounds, bounds[1:])),
                       shards)


def write_files(folder, split, chunks, count):
    """Writes each (x, y) of `chunks` (`count` of them) as one file of split `split`."""
    import tensorflow as tf

    os.makedirs(folder, exist_ok=True)
    files: list[dict[str, Any]] = []
    spec: dict[str, str] | None = None
    for index, (x, y) in enumerate(chunks):
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        spec = spec or {"x": _spec(x), "y": _spec(y)}
        if {"x": _spec(x), "y": _spec(y)} != spec:
            raise DataError(f"{split}: file {index} holds {_spec(x)}, {_spec(y)}, the first "
                            f"{spec['x']}, {spec['y']}; every example needs one shape")
        name = f"{split}-{index:05d}-of-{count:05d}.tfrecord"
        with tf.io.TFRecordWriter(os.path.join(folder, name)) as writer:
            for row in range(len(x)):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    key: tf.train.Feature(bytes_list=tf.train.BytesList(value=[a[row].tobytes()]))
                    for key, a in (("x", x), ("y", y))})).SerializeToString())
        files.append({"file": name, "examples": len(x)})
    path = os.path.join(folder, INDEX)
    index = json.load(open(path)) if os.path.exists(path) else {"splits": {}}
    index["splits"][split] = dict(cast(dict, spec), files=files)  # No chunk: a TypeError.
    with open(path + ".tmp", "w") as f:
        json.dump(index, f, indent=1)
    os.replace(path + ".tmp", path)
    return [os.path.join(folder, f["file"]) for f in files]


def fashion_mnist(folder):
    """`kdist.Inputs` of the Fashion-MNIST files `scripts/write_tfrecords.py` writes
    in `folder` (uint8 pixels, scaled as `kdist.load_fashion_mnist` scales them)."""
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        raise UsageError(f"--tfrecords {folder} has no {INDEX}; write the files first: "
                         f"python scripts/write_tfrecords.py {folder}")
    train, test = (TFRecords(folder, split, transform=scale_images)
                   for split in ("train", "test"))
    return base.Inputs(train, test, source=os.path.abspath(folder))


def scale_images(x, y):
    """uint8 pixels as float32 in [0, 1], as `kdist.load_fashion_mnist` gives them."""
    import tensorflow as tf

    return tf.cast(x, tf.float32) / 255.0, y


@dataclasses.dataclass
class TFRecords:
    """Split `split` of the TFRecord files in `folder` (written by `write`), as a
    kdist input; see the module docstring for sharding, order and resume."""

    folder: str
    split: str = "train"
    shuffle_buffer: int = 10_000
    transform: Callable[[Any, Any], tuple[Any, Any]] | None = None


class TFRecordSource(batching.CheckedSource):
    """The source that streams a `TFRecords` split (see `kdist.inputs`)."""

    kind = "TFRecord files"

    def __init__(self, records, what):
        self.records, self.what = records, what
        if importlib.util.find_spec("tensorflow") is None:
            raise UsageError(f"{what}: kdist.TFRecords reads with tf.data, and TensorFlow is "
                            "not installed: pip install tensorflow-cpu (any backend), or "
                            "load the data as arrays")
        path = os.path.join(records.folder, INDEX)
        try:
            with open(path) as f:
                split = json.load(f)["splits"][records.split]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{what}: {path} has no split {records.split!r} ({type(e).__name__}"
                            f": {e}); write the files with kdist.inputs.tfrecords.write or "
                            "scripts/write_tfrecords.py") from None
        self.files = [os.path.join(records.folder, f["file"]) for f in split["files"]]
        self.counts = [int(f["examples"]) for f in split["files"]]
        self.specs = split["x"], split["y"]
        missing = [p for p in self.files if not os.path.isfile(p)]
        if missing:
            raise DataError(f"{what}: {missing[0]} is missing ({len(missing)} of "
                            f"{len(self.files)} files); write the split again")
        if not sum(self.counts):
            raise DataError(f"{what} is empty")
        self.check = batching.BatchCheck(what, regrouped=True)

    def size(self):
        return sum(self.counts)

    def steps_per_epoch(self, global_batch, limit=None):
        return None  # It depends on the workers' count (`_steps`), known at `train`.

    def eval_steps(self, global_batch):
        return base.eval_steps(self.size(), global_batch)

    def sample(self, rows=2):
        batch = next(self._batches(self._examples(self.files[:1]), rows).as_numpy_iterator())
        return self.check(batch, 0)[0]

    def _examples(self, files, seed=None):
        """The serialized examples of `files`, shuffled by `seed` (none: as written)."""
        import tensorflow as tf

        if seed is not None and self.records.shuffle_buffer:
            rng = np.random.default_rng(seed)
            files = [files[i] for i in rng.permutation(len(files))]
            return tf.data.TFRecordDataset(files, buffer_size=READ_BUFFER).shuffle(
                self.records.shuffle_buffer, seed=int(rng.integers(2**31)))
        return tf.data.TFRecordDataset(files, buffer_size=READ_BUFFER)

    def _batches(self, examples, size, drop_remainder=False, skip=0, take=-1):
        import tensorflow as tf

        features = {key: tf.io.FixedLenFeature([], tf.string) for key in ("x", "y")}

        def parse(serialized):
            parsed = tf.io.parse_example(serialized, features)
            return tuple(tf.reshape(tf.io.decode_raw(parsed[key], tf.as_dtype(spec["dtype"])),
                                    [-1, *spec["shape"]])
                         for key, spec in zip(("x", "y"), self.specs))

        batches = examples.batch(size, drop_remainder).skip(skip).take(take)
        batches = batches.map(parse, tf.data.AUTOTUNE, deterministic=True)
        if self.records.transform is not None:
            batches = batches.map(self.records.transform, tf.data.AUTOTUNE, deterministic=True)
        return batches.prefetch(tf.data.AUTOTUNE)

    def _steps(self, global_batch, workers, limit):
        """(steps of an epoch, whether each worker reads only its files)."""
        if 1 < workers <= len(self.files):
            steps = min(sum(self.counts[i::workers]) for i in range(workers)) // (
                global_batch // workers)
        else:
            steps = self.size() // global_batch
        return (steps if limit is None else min(steps, limit)), 1 < workers <= len(self.files)

    def train(self, global_batch, *, seed, epoch, start_step=0, limit=None, shard=(0, 1)):
        index, workers = shard
        steps, sharded = self._steps(global_batch, workers, limit)
        if not steps:
            raise DataError(f"{self.what} holds too few examples for one global batch of "
                            f"{global_batch} ({self.size()} in {len(self.files)} files for "
                            f"{workers} workers); lower --batch-size-per-replica")

        def slices():
            files = self.files[index::workers] if sharded else self.files
            examples = self._examples(files, [seed, epoch, index if sharded else 0])
            size = global_batch // workers if sharded else global_batch
            batches = self._batches(examples, size, True, start_step, steps - start_step)
            for step, batch in enumerate(tfdata.numpy_batches(batches, self.what), start_step):
                batch, _ = self.check(batch, step)
                yield batch if sharded else tree.take_rows(
                    batch, batching.worker_rows(global_batch, shard))

        return base.Stream(slices())

    def evaluate(self, global_batch, shard=(0, 1)):
        def slices():
            batches = self._batches(self._examples(self.files), global_batch)
            pairs = (self.check(b, i)
                     for i, b in enumerate(tfdata.numpy_batches(batches, self.what)))
            yield from batching.eval_slices(pairs, global_batch, shard, self.what)

        return base.Stream(slices())
