"""A tf.data pipeline that asks for AutoShardPolicy.FILE gives each worker only its files.

Each of 2 workers' share is read in one process here (`train(..., shard=)`), as the
worker would read it; that several workers end an epoch of own shares together is
test_input_workers.py's (a function told its shard).
"""

import importlib.util

import numpy as np
import pytest

from kdist.errors import DataError
from kdist.inputs import sources

pytestmark = [pytest.mark.any_backend,
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                 reason="tf.data needs TensorFlow, not installed here")]
FILES, PER_FILE = 4, 20  # Example i is in file i // PER_FILE.


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import tensorflow as tf

    folder = tmp_path_factory.mktemp("records")
    paths = [str(folder / f"part-{i}.tfrecord") for i in range(FILES)]
    for i, path in enumerate(paths):
        with tf.io.TFRecordWriter(path) as writer:
            for example in range(i * PER_FILE, (i + 1) * PER_FILE):
                writer.write(tf.io.serialize_tensor(tf.constant(example, tf.int64)).numpy())
    return paths


def pipeline(paths, policy="FILE"):
    """Examples (x: its number as 2 floats, y: its parity), shuffled with a seed at every
    iteration, in batches of 5; its options ask for `policy`."""
    import tensorflow as tf

    def parse(serialized):
        n = tf.io.parse_tensor(serialized, tf.int64)
        return tf.cast(tf.stack([n, n]), tf.float32), n % 2

    dataset = (tf.data.Dataset.from_tensor_slices(paths)
               .interleave(tf.data.TFRecordDataset, cycle_length=2).map(parse)
               .shuffle(64, seed=1).batch(5))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy)
    return dataset.with_options(options)


def worker_source(paths, policy="FILE"):
    """The source as a worker makes it, its first batch read as a run reads it first."""
    source = sources.source_for(pipeline(paths, policy), "train")
    source.sample()
    return source


def epoch_read(source, epoch, shard, start_step=0):
    """The example numbers of each batch worker `shard` trains on in `epoch`."""
    stream = source.train(16, seed=0, epoch=epoch, start_step=start_step, shard=shard)
    return [batch[0][:, 0].astype(int).tolist() for batch in stream]


def test_each_worker_reads_only_its_files_and_resumes_its_share_exactly(files):
    assert worker_source(files).steps_per_epoch(16) is None  # Known once the shares are read.
    epochs = {}
    for w in (0, 1):
        source = worker_source(files)
        epochs[w] = [epoch_read(source, e, (w, 2)) for e in (0, 1)]
    for w in (0, 1):
        mine = set(range(w * PER_FILE, (w + 1) * PER_FILE)) | set(
            range((w + 2) * PER_FILE, (w + 3) * PER_FILE))  # Files w and w + 2.
        for batches in epochs[w]:
            assert [len(b) for b in batches] == [8] * 5  # Its 8 rows of each global batch.
            assert sorted(sum(batches, [])) == sorted(mine)
        assert epochs[w][0] != epochs[w][1]  # Reshuffled at every epoch.

    assert epoch_read(worker_source(files), 1, (0, 2), start_step=2) == epochs[0][1][2:]


def test_one_worker_reads_every_file_and_a_pipeline_without_the_policy_is_read_whole(files):
    one = epoch_read(worker_source(files), 0, (0, 1))
    assert sorted(sum(one, [])) == list(range(FILES * PER_FILE))
    halves = [sum(epoch_read(worker_source(files, "AUTO"), 0, (w, 2)), []) for w in (0, 1)]
    assert sorted(halves[0] + halves[1]) == list(range(FILES * PER_FILE))
    assert {n // PER_FILE for n in halves[0]} == set(range(FILES))  # Rows from every file.


def test_file_sharding_of_a_pipeline_that_reads_no_files_is_one_data_error():
    import tensorflow as tf

    x = np.zeros((40, 2), np.float32)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    dataset = tf.data.Dataset.from_tensor_slices((x, x[:, 0])).batch(8).with_options(options)
    source = sources.source_for(dataset, "train")
    with pytest.raises(DataError, match=r"the train data asks to be sharded by file .* reads "
                                        r"no files TensorFlow can shard \(it starts from "
                                        r"TensorSliceDataset\)"):
        list(source.train(16, seed=0, epoch=0, shard=(0, 2)))


def test_fewer_files_than_workers_is_one_data_error_on_each_worker(files):
    """One file for 2 workers: TensorFlow refuses worker 0 (an InvalidArgumentError) and
    gives worker 1 nothing."""
    with pytest.raises(DataError, match=r"^the train data asks to be sharded by file but has "
                                        r"1 file\(s\) for 2 workers, and a worker reads whole "
                                        r"files; split it .* whole pipeline$"):
        epoch_read(worker_source(files[:1]), 0, (0, 2))
    with pytest.raises(DataError, match=r"^the train data gave this worker no examples: its "
                                        r"share is empty \(sharded by file, split the data "
                                        r"into at least as many files as workers\)$"):
        epoch_read(worker_source(files[:1]), 0, (1, 2))
