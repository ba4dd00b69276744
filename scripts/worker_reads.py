"""How many examples each of 2 workers reads for one epoch, per input kind.

Each worker's source is made as a worker makes it and reads its share of epoch 0
(`train(..., shard=(index, 2))`) in this process; a counter inside each pipeline
(a PyDataset's `__getitem__`, a Grain or tf.data `map`, a TFRecords transform, a
function's loop) counts the examples it produced; for arrays, the rows each takes.
Prints a table: examples read by one process, by each worker, and the larger
worker's share of one process's.

    KERAS_BACKEND=tensorflow python scripts/worker_reads.py [--examples 4096]
"""

import argparse
import tempfile

import numpy as np

from kdist.runtime import startup

BATCH, GLOBAL_BATCH, FILES = 32, 64, 8


def kinds(x, y, folder):
    """({kind: a function making that input}, the one-item list its counter adds to)."""
    import grain
    import keras
    import tensorflow as tf

    from kdist.inputs import tfrecords

    count = [0]

    def counted(*parts):
        count[0] += len(parts[0]) if np.ndim(parts[0]) > 1 else 1
        return parts

    class Counted(keras.utils.PyDataset):
        def __len__(self):
            return len(x) // BATCH

        def __getitem__(self, i):
            return counted(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])

    def tf_counted(a, b):
        a, b = tf.numpy_function(counted, [a, b], [a.dtype, b.dtype], stateful=True)
        return tf.ensure_shape(a, [None, *x.shape[1:]]), tf.ensure_shape(b, [None])

    tfrecords.write(folder, "train", x, y, shards=FILES)
    paths = []  # The same examples as plain files of serialized (x, y) rows.
    for i, rows in enumerate(np.array_split(np.arange(len(x)), FILES)):
        paths.append(f"{folder}/plain-{i}.tfrecord")
        with tf.io.TFRecordWriter(paths[-1]) as writer:
            for row in rows:
                row = np.append(x[row], y[row]).astype(np.float32)
                writer.write(tf.io.serialize_tensor(row).numpy())

    def file_pipeline():
        def parse(serialized):
            row = tf.io.parse_tensor(serialized, tf.float32)
            return row[:-1], tf.cast(row[-1], tf.int64)

        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.FILE)
        return (tf.data.Dataset.from_tensor_slices(paths)
                .interleave(tf.data.TFRecordDataset, cycle_length=2).map(parse)
                .batch(BATCH).map(tf_counted).with_options(options))

    def generator(shard=None):
        rows = np.arange(len(x)) if shard is None else np.arange(shard[0], len(x), shard[1])
        step = BATCH if shard is None else BATCH // shard[1]
        for start in range(0, len(rows) - step + 1, step):
            take = rows[start:start + step]
            yield counted(x[take], y[take])

    def grain_examples():
        return grain.MapDataset.source(list(zip(x, y))).map(lambda e: counted(*e)[0:2])

    def arrays():
        return x, y

    made = {
        "arrays": arrays,
        "keras.utils.PyDataset": Counted,
        "tf.data": lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).map(
            tf_counted),
        "tf.data, AutoShardPolicy.FILE": file_pipeline,
        "kdist.TFRecords": lambda: tfrecords.TFRecords(folder, transform=tf_counted),
        "function": lambda: lambda: generator(),
        "function with `shard`": lambda: lambda epoch, shard: generator(shard),
        "grain.MapDataset": lambda: grain_examples().batch(BATCH),
        "grain.IterDataset": lambda: grain_examples().to_iter_dataset().batch(BATCH),
    }
    return made, count


def reads(make, count, shard):
    """Examples read for epoch 0 by worker `shard`, after the run's first-batch sample."""
    from kdist.inputs import sources

    source = sources.source_for(make(), "train")
    source.sample()
    count[0] = taken = 0
    for batch in source.train(GLOBAL_BATCH, seed=0, epoch=0, shard=shard):
        taken += len(batch[1])
    return count[0] if make.__name__ != "arrays" else taken  # Arrays: the rows it takes.


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=4096)
    args = parser.parse_args(argv)
    startup.prepare_environment()
    rng = np.random.default_rng(0)
    x = rng.random((args.examples, 8), np.float32)
    y = rng.integers(0, 4, args.examples).astype(np.int64)
    with tempfile.TemporaryDirectory() as folder:
        made, count = kinds(x, y, folder)
        print(f"{args.examples} examples, global batch {GLOBAL_BATCH}, 2 workers\n")
        print("| input | one process | worker 0 | worker 1 | largest share |")
        print("|---|---|---|---|---|")
        for kind, make in made.items():
            one = reads(make, count, (0, 1))
            workers = [reads(make, count, (w, 2)) for w in (0, 1)]
            print(f"| {kind} | {one:,} | {workers[0]:,} | {workers[1]:,} | "
                  f"{max(workers) / one:.2f} |", flush=True)


if __name__ == "__main__":
    main()
