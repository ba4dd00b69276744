"""Data streamed from TFRecord files (kdist.inputs.tfrecords, kdist.datasets.ondisk):
trains like the same batches in memory, each worker opens only its files, every
example is seen once per epoch and evaluated once, a resume is exact, bad folders
are one clear error; `scripts/train.py --tfrecords DIR` reads what
`scripts/write_tfrecords.py` writes. Needs TensorFlow (skipped without it).
"""

import json
import os

import numpy as np
import pytest
from test_inputs import (
    TEST,
    TRAIN,
    check_evaluation_shards,
    final_weights,
    in_batches,
    max_difference,
    resume_matches,
    train,
)

from kdist.cli import common, write_data
from kdist.cli import train as train_cli
from kdist.datasets import ondisk
from kdist.errors import DataError
from kdist.inputs import base, sources
from kdist.inputs.tfrecords import TFRecords, write

pytest.importorskip("tensorflow", reason="TFRecord files are read with tf.data")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """TRAIN in 4 files of 100 examples, ids (0..399) in 4 files, TEST in 3 files."""
    folder = str(tmp_path_factory.mktemp("records"))
    write(folder, "train", *TRAIN, shards=4)
    write(folder, "ids", TRAIN[0], np.arange(400), shards=4)
    write(folder, "test", *TEST, shards=3)
    return folder


def test_streamed_files_train_like_the_same_batches_in_memory(tmp_path, folder):
    """Files and examples as written (shuffle_buffer=0) against a function yielding
    the arrays in that order: SGD, 2 replicas, 2 epochs, to 1e-5."""
    x, y = TRAIN
    streamed = train(tmp_path, "files", base.Inputs(TFRecords(folder, shuffle_buffer=0),
                                                      TFRecords(folder, "test")))
    memory = train(tmp_path, "memory", base.Inputs(lambda: iter(in_batches(x, y, 50)), TEST))
    worst = max_difference(final_weights(tmp_path, "files"), final_weights(tmp_path, "memory"))
    print(f"\nmax weight difference {worst:.3g}")
    assert worst <= 1e-5, worst
    for mine, theirs in zip(streamed.epochs, memory.epochs):
        assert mine["test_loss"] == pytest.approx(theirs["test_loss"], abs=1e-5)
        assert mine["test_accuracy"] == pytest.approx(theirs["test_accuracy"], abs=1e-7)


def seen(source, global_batch, epoch, shard=(0, 1)):
    return np.concatenate([b[1] for b in source.train(global_batch, seed=3, epoch=epoch,
                                                      shard=shard)])


def test_every_example_once_per_epoch_in_a_new_order(folder):
    source = sources.source_for(TFRecords(folder, "ids", shuffle_buffer=64), "train")
    epochs = [seen(source, 40, e) for e in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(400))
    assert list(epochs[0]) != list(epochs[1])


def test_each_worker_opens_only_its_files_unless_files_are_fewer(folder):
    source = sources.source_for(TFRecords(folder, "ids"), "train")
    halves = [seen(source, 32, 0, (i, 2)) for i in range(2)]
    for index, rows in enumerate(halves):  # Files i and i + 2: ids 100 * file + row.
        assert len(rows) == 12 * 16 and set(rows // 100) == {index, index + 2}
    assert not set(halves[0]) & set(halves[1])
    eighths = [seen(source, 64, 0, (i, 8)) for i in range(8)]  # 8 workers, 4 files.
    assert sorted(np.concatenate(eighths)) == sorted(seen(source, 64, 0))


def test_evaluation_counts_every_example_once(folder):
    check_evaluation_shards(sources.source_for(TFRecords(folder, "test"), "test"), TEST[0])


def test_shuffled_files_resume_mid_epoch_exactly(tmp_path, folder):
    banner = resume_matches(tmp_path, lambda: base.Inputs(
        TFRecords(folder, shuffle_buffer=64), TFRecords(folder, "test")))
    assert "Data: train TFRecord files, test TFRecord files" in banner


def test_bad_folders_are_one_clear_error(tmp_path, folder):
    with pytest.raises(DataError, match=r"the train data: .*kdist-records.json has no split "
                                        r"'train' \(FileNotFoundError"):
        sources.prepare(base.Inputs(TFRecords(str(tmp_path)), TEST))
    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.load(open(os.path.join(folder, "kdist-records.json")))
    (broken / "kdist-records.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"the test data: .*test-00000-of-00003.tfrecord is "
                                        r"missing \(3 of 3 files\)"):
        sources.source_for(TFRecords(str(broken), "test"), "test")
    with pytest.raises(DataError, match="holds too few examples for one global batch of 512 "
                                        r"\(400 in 4 files for 1 workers\)"):
        list(sources.source_for(TFRecords(folder), "train").train(512, seed=0, epoch=0))


def test_train_script_reads_the_files_the_writer_writes(tmp_path, monkeypatch, capsys):
    folder = str(tmp_path / "data")
    assert write_data.write_main([folder, "--synthetic", "300", "--shards", "2",
                              "--test-examples", "100"]) == 0
    written = json.load(open(os.path.join(folder, "kdist-records.json")))["splits"]
    assert [f["examples"] for f in written["train"]["files"]] == [150, 150]
    assert sum(f["examples"] for f in written["test"]["files"]) == 100
    prepared = sources.prepare(common.load_data(train_cli.train_parser().parse_args(
        ["--tfrecords", folder])))
    first = next(ondisk.synthetic_chunks(300, 2))[0][:2]
    np.testing.assert_array_equal(prepared.sample(2)[0], first.astype("float32") / 255)
    monkeypatch.chdir(tmp_path)
    assert train_cli.main(["--tfrecords", folder, "--epochs", "1", "--steps-per-epoch", "2",
                     "--replicas", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"Data: {folder} (300 train, 100 test examples)" in out and "Restored" in out
    with pytest.raises(SystemExit, match="2"):
        train_cli.main(["--tfrecords", str(tmp_path)])
    assert "has no kdist-records.json; write the files first" in capsys.readouterr().err
