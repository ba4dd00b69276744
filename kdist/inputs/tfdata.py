"""tf.data under the sources: reading several global batches at a time, NumPy
batches off TensorFlow's threads, and a pipeline's own sharding by file.

A pipeline whose options ask for file sharding
(`options.experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE`)
is sharded as `tf.distribute` shards it: TensorFlow's own rewrite
(`AutoShardDataset`) puts a `shard` before the pipeline's file reader, so that
worker i of W reads only files i, i + W, ... (`file_share`). Any other policy
leaves the pipeline whole, and the source keeps each worker's rows of every
global batch (`kdist.inputs.pipelines`).
"""

import re
import sys
import threading

from kdist.errors import DataError


def is_tf_dataset(given):
    tf = sys.modules.get("tensorflow")  # Loaded by whoever built a tf.data.Dataset.
    return tf is not None and isinstance(given, tf.data.Dataset)


# How much kdist reads from a tf.data pipeline at a time: each read is a call
# from Python into TensorFlow and a hand-over from its threads, and one read
# per batch slowed training on a 2-core CPU whose cores the step keeps busy
# (docs/performance.md, "Input pipelines"). READ_BATCHES global batches per
# read, fewer where that would exceed READ_BYTES.
READ_BATCHES = 8
READ_BYTES = 64 * 2**20


def for_reading(dataset, global_batch):
    """`dataset` re-cut to several global batches' rows per element
    (`Dataset.rebatch`, inside tf.data) where every part's shape past the batch
    axis is known, so that such elements cannot change shape; else `dataset`."""
    rows = read_rows(dataset.element_spec, global_batch)
    return dataset if rows is None else dataset.rebatch(rows)


def read_rows(spec, global_batch):
    """Rows per read of a dataset of elements `spec` (None: one element per read)."""
    import tensorflow as tf

    specs = tf.nest.flatten(spec)
    if global_batch is None or not all(s.shape[1:].is_fully_defined() for s in specs):
        return None
    batch_bytes = global_batch * sum(s.shape[1:].num_elements() * s.dtype.size for s in specs)
    return global_batch * max(1, min(READ_BATCHES, READ_BYTES // max(batch_bytes, 1)))


def numpy_batches(dataset, what):
    """An iterator over a tf.data.Dataset's elements as NumPy arrays. An element
    whose parts hold different numbers of rows (which `rebatch` finds), or a
    share of fewer files than workers (`file_share`), ends the read with one
    DataError.

    When the read ends (run out, or dropped at an epoch's step limit), the
    tf.data iterator is deleted on a thread of its own (`delete_later`)."""
    import tensorflow as tf

    held = [dataset.as_numpy_iterator()]  # Its only reference, for `delete_later`.
    try:
        yield from held[0]
    except Exception as error:  # Not GeneratorExit: a generator closed at exit has no tf.errors.
        if not isinstance(error, tf.errors.InvalidArgumentError):
            raise
        files = re.search(r"only has (\d+) file\(s\).* (\d+) shards/workers", str(error))
        if files:
            raise DataError(f"{what} asks to be sharded by file but has {files[1]} file(s) "
                            f"for {files[2]} workers, and a worker reads whole files; split "
                            "it into at least as many files as workers, or leave the policy "
                            "at AUTO, with which every worker reads the whole pipeline") from None
        if "same batch size in each component" not in str(error):
            raise
        detail = str(error).split("}}")[-1].strip().splitlines()[0]
        raise DataError(f"{what}: a batch holds arrays of different lengths ({detail}); x, y "
                        "and the sample weights need one row per example") from None
    finally:
        delete_later(held)


def delete_later(held):
    """Empties `held`, a list holding the only reference to a tf.data iterator,
    on a daemon thread, where the iterator is then deleted. Deleting one waits
    for its autotuning thread to wake, which sleeps for ever longer periods:
    on a busy CPU that blocked the reading thread for seconds at the end of
    an epoch (docs/performance.md, "Input pipelines"). The deleting thread
    holds no Python lock while it waits."""
    threading.Thread(target=held.clear, name="kdist-delete-iterator", daemon=True).start()


def asks_file_sharding(dataset):
    """Whether `dataset`'s options ask for sharding by file (AutoShardPolicy.FILE)."""
    import tensorflow as tf

    policy = dataset.options().experimental_distribute.auto_shard_policy
    return policy == tf.data.experimental.AutoShardPolicy.FILE


def file_share(dataset, shard, what):
    """Worker `shard[0]` of `shard[1]`'s share of `dataset`, sharded by file by
    TensorFlow's own rewrite, as `tf.distribute` does with AutoShardPolicy.FILE.
    The share keeps the pipeline's state (a seeded `shuffle` reshuffles for both
    as one). A pipeline that reads no files is one DataError naming `what`."""
    import tensorflow as tf

    specs = tf.nest.flatten(dataset.element_spec)
    try:
        variant = tf.raw_ops.AutoShardDataset(
            input_dataset=tf.data.experimental.to_variant(dataset), num_workers=shard[1],
            index=shard[0], auto_shard_policy=int(tf.data.experimental.AutoShardPolicy.FILE),
            num_replicas=shard[1], output_types=[s.dtype for s in specs],
            output_shapes=[s.shape for s in specs])
    except tf.errors.NotFoundError as error:
        if "unshardable source dataset" not in str(error):
            raise
        raise DataError(f"{what} asks to be sharded by file (auto_shard_policy FILE) but "
                        "reads no files TensorFlow can shard (it starts from "
                        f"{_source_op(error)}); start it from a list of files (e.g. "
                        "tf.data.Dataset.list_files, then interleave a reader), or leave "
                        "the policy at AUTO, with which every worker reads the whole "
                        "pipeline") from None
    return tf.data.experimental.from_variant(variant, dataset.element_spec)


def _source_op(error):
    """The op TensorFlow names in an unshardable-source error (its node's `op:` line)."""
    ops = [line.split('"')[1] for line in str(error).splitlines()
           if line.startswith('op: "')]
    return ops[0] if ops else "a dataset that is not a file reader"
