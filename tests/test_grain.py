"""Grain datasets as kdist inputs (kdist.inputs.grainsource), as tests/test_inputs.py checks
the other kinds: they train like the same batches, each worker reads only its
batches of a MapDataset, evaluation counts every example once, a resume is
exact, bad input is one clear error. Skipped only where grain is not installed
(the nox test sessions install it: the `test` extra).
"""

import numpy as np
import pytest
from test_inputs import (
    SEED,
    TEST,
    TRAIN,
    check_evaluation_shards,
    final_weights,
    in_batches,
    max_difference,
    resume_matches,
    train,
)

from kdist.errors import DataError, UsageError
from kdist.inputs import base, sources

grain = pytest.importorskip("grain", reason="grain is not installed (pip install kdist[grain])")


def examples(x, y):
    """A grain.MapDataset of (x, y) examples."""
    return grain.MapDataset.source(list(zip(x, y)))


def test_a_shuffled_map_dataset_trains_on_grains_order_of_each_epoch(tmp_path):
    """Epoch e reads Grain's indices e * len .. (e + 1) * len - 1: the shuffle's
    order for epoch e, which a function of the epoch yields for comparison."""
    x, y = TRAIN
    train(tmp_path, "grain", base.Inputs(examples(x, y).shuffle(seed=3).batch(25), TEST))
    orders = [[grain.MapDataset.range(400).shuffle(seed=3)[e * 400 + i] for i in range(400)]
              for e in (0, 1)]
    assert orders[0] != orders[1] and sorted(orders[0]) == list(range(400))
    train(tmp_path, "its order", base.Inputs(
        lambda epoch: iter(in_batches(x[orders[epoch]], y[orders[epoch]], 25)), TEST))
    worst = max_difference(final_weights(tmp_path, "grain"), final_weights(tmp_path, "its order"))
    print(f"\nmax weight difference {worst:.3g}")
    assert worst <= 1e-6, worst


def test_each_worker_reads_only_the_map_dataset_batches_holding_its_rows():
    x, y = TRAIN
    read = []
    dataset = examples(x, y).batch(8).map_with_index(lambda i, batch: read.append(i) or batch)
    source = sources.source_for(dataset, "train")  # Reads batches 0 and 49.
    read.clear()
    slices = list(source.train(32, seed=SEED, epoch=1, shard=(1, 2)))
    assert len(slices) == 12 and read == [50 + s * 4 + j for s in range(12) for j in (2, 3)]
    np.testing.assert_array_equal(slices[0][0], x[16:32])


def test_a_function_told_its_shard_reads_only_its_slice_of_an_iter_dataset():
    """Grain's own sharding, chosen by the function: worker 1 of 2 slices the source
    `[1::2]` and reads only those examples, cut into its rows of each global batch."""
    x, y = TRAIN
    read = []

    def share(epoch, shard):
        index, count = shard
        rows = grain.MapDataset.range(400)[index::count]
        return (rows.map(lambda i: read.append(i) or (x[i], y[i])).batch(10)
                .to_iter_dataset())

    source = sources.source_for(share, "train")
    read.clear()
    slices = list(source.train(32, seed=SEED, epoch=0, shard=(1, 2)))
    assert len(slices) == 12 and all(len(batch[0]) == 16 for batch in slices)
    assert len(read) <= 200 and all(i % 2 == 1 for i in read)  # Its half, nothing else.
    np.testing.assert_array_equal(slices[0][0], x[1:32:2])


@pytest.mark.parametrize("kind", ["MapDataset", "IterDataset"])
def test_evaluation_splits_full_batches_and_shares_the_tail(kind):
    x, y = TEST
    dataset = examples(x, y).batch(64)
    source = sources.source_for(dataset if kind == "MapDataset" else dataset.to_iter_dataset(),
                               "test")
    assert source.kind == f"grain.{kind}"
    check_evaluation_shards(source, x)


def test_a_map_dataset_resumes_mid_epoch_exactly(tmp_path):
    banner = resume_matches(tmp_path, lambda: base.Inputs(
        examples(*TRAIN).shuffle(seed=3).batch(25), examples(*TEST).batch(64)))
    assert "Data: train grain.MapDataset, test grain.MapDataset" in banner


def test_an_iter_dataset_resumes_mid_epoch_exactly(tmp_path):
    resume_matches(tmp_path, lambda: base.Inputs(
        examples(*TRAIN).shuffle(seed=3).to_iter_dataset().batch(30), TEST))


@pytest.mark.parametrize("given, error, message", [
    (lambda: examples(*TRAIN).batch(25).repeat(), DataError,
     r"the train data is an infinite Grain dataset \(repeat\(\) without a count\)"),
    (lambda: examples(*TRAIN).batch(25).to_iter_dataset(), None, None),
    (lambda: examples(*TRAIN), DataError,
     "the train data: batch 0 has a scalar y, a single example; give batches"),
    (lambda: examples(*TRAIN).batch(25).filter(lambda batch: len(batch[0]) > 25),
     DataError, r"the train data: Grain batch 0 is None \(dropped by a filter\(\)\)"),
    (lambda: examples(*TRAIN).map(lambda e: (e[0][: 8 - e[1] % 2], e[1])).to_iter_dataset()
     .batch(1), DataError, r"the train data: batch \d+ changes shape"),
    (lambda: examples(*TRAIN).batch(10).slice(slice(0, 0)), DataError,
     "the train data is empty"),
    (lambda: grain.DataLoader(data_source=list(range(4)), sampler=grain.samplers.IndexSampler(
        4, num_epochs=1), operations=[]), UsageError,
     "the train data is a grain.DataLoader; kdist shards and resumes the data itself"),
])
def test_bad_grain_input_is_one_clear_error(given, error, message):
    if error is None:  # The good case of the same shape: prepared without error.
        assert sources.prepare(base.Inputs(given(), TEST)).train.kind == "grain.IterDataset"
        return
    with pytest.raises(error, match=message):
        prepared = sources.prepare(base.Inputs(given(), TEST))
        list(prepared.train.train(32, seed=0, epoch=0))
