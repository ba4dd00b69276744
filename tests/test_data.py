"""Fashion-MNIST loading (offline first, checked headers) and batching."""

import dataclasses
import gzip
import os
import struct

import numpy as np
import pytest

from kdist.datasets import fashion_mnist
from kdist.errors import DataError, UsageError
from kdist.inputs import arrays
from kdist.inputs.base import Inputs

# Nothing here depends on the backend (Fashion-MNIST files and NumPy batching): one session runs it.
pytestmark = pytest.mark.any_backend


def write_idx(path, array, magic, dims=None):
    dims = array.shape if dims is None else dims
    header = struct.pack(f">I{len(dims)}I", magic, *dims)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def make_dataset_dir(folder, n_train=6, n_test=4):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        write_idx(folder / f"{split}-images-idx3-ubyte.gz",
                  rng.integers(0, 256, (n, 28, 28)), 0x0803)
        write_idx(folder / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n), 0x0801)
    return folder


def test_loads_and_normalises_a_data_dir(tmp_path):
    folder = make_dataset_dir(tmp_path / "fm")
    ds = fashion_mnist.load_fashion_mnist(str(folder))
    assert ds.train_x.shape == (6, 28, 28, 1) and ds.test_x.shape == (4, 28, 28, 1)
    assert ds.train_x.dtype == np.float32 and 0.0 <= ds.train_x.min()
    assert ds.train_x.max() <= 1.0 and ds.train_y.dtype == np.int32
    assert ds.source == str(folder)


def test_data_dir_without_the_files_names_the_missing_ones(tmp_path):
    folder = make_dataset_dir(tmp_path / "fm")
    os.remove(folder / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(UsageError, match="lacks t10k-labels-idx1-ubyte.gz"):
        fashion_mnist.load_fashion_mnist(str(folder))


def test_truncated_file_is_named(tmp_path):
    folder = make_dataset_dir(tmp_path / "fm")
    path = folder / "train-images-idx3-ubyte.gz"
    write_idx(path, np.zeros((6, 28, 28)), 0x0803, dims=(7, 28, 28))  # Header claims 7.
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz.*truncated"):
        fashion_mnist.load_fashion_mnist(str(folder))


def test_wrong_magic_and_non_gzip_are_named(tmp_path):
    folder = make_dataset_dir(tmp_path / "fm")
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.zeros(6), 0x0803, dims=(6,))
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz: IDX magic"):
        fashion_mnist.load_fashion_mnist(str(folder))
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz: cannot read"):
        fashion_mnist.load_fashion_mnist(str(folder))


def test_mismatched_counts_are_an_error(tmp_path):
    folder = make_dataset_dir(tmp_path / "fm")
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.zeros(5), 0x0801)
    with pytest.raises(DataError, match="6 images but 5 labels"):
        fashion_mnist.load_fashion_mnist(str(folder))


def test_search_order_keras_cache_then_debian(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    debian = make_dataset_dir(tmp_path / "debian", n_train=3)
    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", str(debian))
    assert fashion_mnist.load_fashion_mnist().source == str(debian)
    cache = make_dataset_dir(tmp_path / "keras" / "datasets" / "fashion-mnist", n_train=2)
    assert fashion_mnist.load_fashion_mnist().source == str(cache)


def test_nothing_found_and_no_download_names_the_three_ways(tmp_path, monkeypatch):
    import keras

    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", str(tmp_path / "nowhere"))

    def offline():
        raise OSError("network unreachable")

    monkeypatch.setattr(keras.datasets.fashion_mnist, "load_data", offline)
    with pytest.raises(DataError) as error:
        fashion_mnist.load_fashion_mnist()
    message = str(error.value)
    assert "Pass data_dir (a folder" in message and str(tmp_path / "keras") in message
    assert "apt-get install dataset-fashion-mnist" in message


def test_train_batches_are_full_shuffled_and_reproducible():
    images = np.arange(100, dtype=np.float32).reshape(100, 1, 1, 1)
    labels = np.arange(100, dtype=np.int32)
    epoch0 = list(arrays.train_batches(images, labels, None, 32, seed=1, epoch=0, steps=3))
    again = list(arrays.train_batches(images, labels, None, 32, seed=1, epoch=0, steps=3))
    epoch1 = list(arrays.train_batches(images, labels, None, 32, seed=1, epoch=1, steps=3))
    assert [len(b[1]) for b in epoch0] == [32, 32, 32]
    assert len(set(np.concatenate([b[1] for b in epoch0]))) == 96
    assert all((a[1] == b[1]).all() for a, b in zip(epoch0, again))
    assert not (epoch0[0][1] == epoch1[0][1]).all()
    resumed = list(arrays.train_batches(images, labels, None, 32, seed=1, epoch=0, steps=3,
                                      start_step=2))
    assert (resumed[0][1] == epoch0[2][1]).all()


def test_shards_of_a_global_batch_partition_it():
    images = np.zeros((64, 1, 1, 1), np.float32)
    labels = np.arange(64, dtype=np.int32)
    whole = next(arrays.train_batches(images, labels, None, 32, seed=0, epoch=0, steps=1))
    parts = [next(arrays.train_batches(images, labels, None, 32, seed=0, epoch=0, steps=1,
                                     shard=(i, 2))) for i in range(2)]
    assert (np.concatenate([p[1] for p in parts]) == whole[1]).all()


def test_evaluation_is_full_batches_then_the_rest_whole():
    images = np.ones((10, 28, 28, 1), np.float32)
    labels = np.arange(10, dtype=np.int32)
    weights = np.linspace(0.1, 1.0, 10).astype(np.float32)
    batches = list(arrays.eval_batches(images, labels, weights, 4))
    assert [b[0].shape[0] for b in batches] == [4, 4]
    tail = arrays.eval_tail(images, labels, weights, 4)
    assert tail[1].tolist() == [8, 9] and tail[2].tolist() == weights[8:].tolist()
    seen = np.concatenate([b[1] for b in batches] + [tail[1]])
    assert seen.tolist() == list(range(10))  # Each example once, none padded.
    shards = [next(arrays.eval_batches(images, labels, None, 4, shard=(i, 2))) for i in range(2)]
    assert [s[1].tolist() for s in shards] == [[0, 1], [2, 3]]
    assert arrays.eval_tail(images[:8], labels[:8], None, 4) is None


def test_batches_keep_the_structure_of_inputs_and_targets():
    x = {"image": np.zeros((6, 2), np.float32), "side": np.arange(6, dtype=np.float32)}
    y = (np.arange(6, dtype=np.int32), np.arange(6, dtype=np.float32) * 2)
    batch = next(arrays.train_batches(x, y, None, 4, seed=0, epoch=0, steps=1))
    assert set(batch[0]) == {"image", "side"} and isinstance(batch[1], tuple)
    np.testing.assert_array_equal(batch[0]["side"], batch[1][0])  # Rows stay aligned.
    np.testing.assert_array_equal(batch[1][1], batch[1][0] * 2)
    assert batch[2] is None


def test_data_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="file is not a folder"):
        fashion_mnist.load_fashion_mnist(str(tmp_path / "file"))


def _corrupt(dataset, how):
    ds = arrays.Dataset(dataset.train_x.copy(), dataset.train_y.copy(),
                      dataset.test_x.copy(), dataset.test_y.copy(), source="toy")
    if how == "train label 10":
        ds.train_y[17] = 10
    elif how == "test label -1":
        ds.test_y[3] = -1
    elif how == "NaN":
        ds.train_x[5, 2, 2, 0] = np.nan
    elif how == "fewer labels":
        ds.train_y = ds.train_y[:-1]
    elif how == "empty test set":
        ds.test_x, ds.test_y = ds.test_x[:0], ds.test_y[:0]
    return ds


@pytest.mark.parametrize("how, message", [
    ("train label 10", r"toy: train label 10 \(example 17\) is not a class of the model, "
                       r"which has 10 \(0..9\)"),
    ("test label -1", r"toy: test label -1 \(example 3\) is not a class"),
    ("NaN", r"toy: train input \(example 5\) holds nan \(1 such examples\)"),
    ("fewer labels", r"toy: train arrays differ in length \(x 512, y 511\)"),
    ("empty test set", "toy: the test set is empty"),
])
def test_bad_data_is_one_error_before_training(tmp_path, small_dataset, how, message):
    from kdist.loop import training

    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=2,
                                  steps_per_epoch=2, checkpoint_dir=str(tmp_path / "ck"))
    lines = []
    with pytest.raises(DataError, match=message):
        training.train_and_evaluate(config, _corrupt(small_dataset, how), log=lines.append)
    assert lines == []  # Not even the banner: nothing ran.
    assert not os.path.exists(tmp_path / "ck") or not os.listdir(tmp_path / "ck")


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_split_of_x_alone_is_one_usage_error_before_training(tmp_path, small_dataset, split):
    # y=None was the backend's own ValueError from deep in building, worded per backend.
    from kdist.loop import training

    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, steps_per_epoch=2,
                                  checkpoint_dir=str(tmp_path / "ck"))
    dataset = dataclasses.replace(small_dataset, **{f"{split}_y": None})
    with pytest.raises(UsageError, match=f"the {split} set has no labels \\(y is None\\); "
                                         "kdist reads y with every batch"):
        training.train_and_evaluate(config, dataset, log=lambda line: None)
    assert not os.path.exists(tmp_path / "ck")


def test_python_lists_where_arrays_go_are_one_usage_error_before_training(tmp_path,
                                                                            small_dataset):
    # A Dataset of lists was Python's TypeError ("object of type 'float' has no len()"),
    # and Inputs of lists said it was "a tuple" where a tuple is what it takes.
    from kdist.loop import training

    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, steps_per_epoch=2,
                                  checkpoint_dir=str(tmp_path / "ck"))
    x, y = small_dataset.train_x[:64], small_dataset.train_y[:64]
    for dataset, match in (
            (dataclasses.replace(small_dataset, train_x=x.tolist(), train_y=y.tolist()),
             "the train x holds float values, not arrays; give NumPy arrays"),
            (Inputs(train=(x.tolist(), y.tolist())),
             "the train data holds float, int values, not arrays; give NumPy arrays")):
        with pytest.raises(UsageError, match=match):
            training.train_and_evaluate(config, dataset, log=lambda line: None)
    with pytest.raises(DataError, match=r"batch 0 is a tuple of 1; every batch must be a "
                                        r"tuple \(x, y\)"):  # Was "is a tuple; ...".
        training.train_and_evaluate(config, Inputs(train=lambda: iter([(x[:16],)] * 4)),
                                    log=lambda line: None)
    assert not os.path.exists(tmp_path / "ck")
