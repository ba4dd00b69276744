"""Bad values in streamed data: every input kind checks each batch as it comes for
non-finite x, y and sample weights, and for labels outside the model's classes,
and stops with one `kdist.DataError` naming the batch, the field and the value,
before the step that would use it (tests/test_inputs.py checks the shapes)."""

import importlib.util
import os

import keras
import numpy as np
import pytest
from test_inputs import TEST, TRAIN, Batches, in_batches, make_mlp, tf_data, train

import kdist
from kdist.errors import DataError
from kdist.inputs import base, sources, tfrecords
from kdist.loop import building

HAS_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAS_TF, reason="read with tf.data")
needs_grain = pytest.mark.skipif(importlib.util.find_spec("grain") is None,
                                 reason="grain is not installed")


def grain_map(x, y, w):
    import grain

    return grain.MapDataset.source(list(zip(x, y, w))).batch(50)


def records(x, y, w, folder):
    tfrecords.write(str(folder), "train", x, y, shards=2)
    return tfrecords.TFRecords(str(folder))


# Each kind holds TRAIN (with sample weights where it can) in batches of 50, in order.
KINDS = {
    "arrays": lambda x, y, w, folder: (x, y, w),
    "generator": lambda x, y, w, folder: lambda: iter(
        [(a, b, c) for (a, b), c in zip(in_batches(x, y, 50), np.split(w, 8))]),
    "PyDataset": lambda x, y, w, folder: Batches(x, y, 50),
    "tf.data": lambda x, y, w, folder: tf_data(x, y, 50),
    "grain.MapDataset": lambda x, y, w, folder: grain_map(x, y, w),
    "grain.IterDataset": lambda x, y, w, folder: grain_map(x, y, w).to_iter_dataset(),
    "TFRecords": records,
}
MARKS = {"tf.data": [needs_tf], "TFRecords": [needs_tf], "grain.MapDataset": [needs_grain],
         "grain.IterDataset": [needs_grain]}
WEIGHTED = ("arrays", "generator", "grain.MapDataset", "grain.IterDataset")


def spoiled(field):
    """TRAIN and sample weights with one bad value in row 263 (batch 5, row 13)."""
    x, y, w = TRAIN[0].copy(), TRAIN[1].copy(), np.ones(len(TRAIN[0]), "float32")
    if field == "x":
        x[263, 2] = np.nan
    elif field == "y":
        y[263] = 7
    else:
        w[263] = np.inf
    return x, y, w


def expected(kind, field):
    if kind == "arrays":  # Checked as a whole, before anything is built.
        return {"x": r"kdist.Inputs: train input \(example 263\) holds nan \(1 such",
                "y": r"the train data: label 7 \(example 263\) is not a class of the model, "
                     r"which has 4 \(0..3\)",
                "sample weight": r"kdist.Inputs: train sample weight \(example 263\) holds "
                                 r"inf \(1 such"}[field]
    # tf.data and TFRecords are read several global batches at a time, TFRecord files
    # in an order of their own: the batch and row are counted as kdist reads them.
    where, row = ("the train data: batch 5", "13") if kind not in ("tf.data", "TFRecords") \
        else (r"the train data: batch \d+ as kdist reads it", r"\d+")
    return {"x": where + rf": x holds nan in row {row} \(1 non-finite values\)",
            "y": where + rf": label 7 \(row {row}\) is not a class of the model, which has 4 "
                         r"\(0..3\); 1 labels are out of range",
            "sample weight": where + rf": sample weight holds inf in row {row}"}[field]


CASES = [pytest.param(kind, field, marks=MARKS.get(kind, []), id=f"{kind}-{field}")
         for kind in KINDS for field in ("x", "y", "sample weight")
         if field != "sample weight" or kind in WEIGHTED]


@pytest.mark.any_backend
@pytest.mark.parametrize("kind, field", CASES)
def test_each_kind_names_the_batch_the_field_and_the_value(tmp_path, kind, field):
    """Read as the loop reads them (the training slices of an epoch, after the
    model's classes are told), each kind stops at the bad batch."""
    model = make_mlp()
    prepared = None
    with pytest.raises(DataError, match=expected(kind, field)):
        prepared = sources.prepare(base.Inputs(KINDS[kind](*spoiled(field), tmp_path), TEST))
        prepared.train.expect_classes(model.output_shape[-1])
        for _ in prepared.train.train(50, seed=0, epoch=0):
            pass


@pytest.mark.parametrize("kind, field", [("generator", "y"), ("PyDataset", "x")])
def test_a_bad_batch_stops_training_before_its_step_and_writes_nothing(tmp_path, kind, field):
    """The issue's case: a run resumed after one good epoch meets the bad batch in
    epoch 2; the checkpoint folder is as it was."""
    folder = tmp_path / "run"
    train(tmp_path, "run", base.Inputs(TRAIN, TEST), epochs=1)
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    with pytest.raises(DataError, match=expected(kind, field)):
        train(tmp_path, "run", base.Inputs(KINDS[kind](*spoiled(field), tmp_path), TEST),
              epochs=2)
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before


@pytest.mark.parametrize("loss, refused", [
    ("sparse_categorical_crossentropy", True),
    (keras.losses.SparseCategoricalCrossentropy(from_logits=True), True),
    (keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1), False),
    ("mse", False),
    # A list or dict of the one output's loss was not checked: on JAX it trained on.
    ([keras.losses.SparseCategoricalCrossentropy(from_logits=True)], True),
    ({"dense": "sparse_categorical_crossentropy"}, True)])
def test_labels_are_checked_as_classes_only_for_a_loss_that_reads_class_indices(loss, refused):
    # Two outputs; targets -1 (ignored) and 0..9: counts for MSE, not classes.
    x = np.zeros((6, 3), np.float32)
    y = np.array([[-1], [0], [9], [1], [2], [3]], np.int32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")])
    model.compile(optimizer="sgd", loss=loss)
    prepared = sources.prepare(kdist.Dataset(x, y if loss == "mse" else y[:, 0], x, y[:, 0],
                                             "labels"))
    if refused:
        with pytest.raises(DataError, match="label -1 .* is not a class of the model"):
            building.check_labels(prepared, model)
    else:
        building.check_labels(prepared, model)


@pytest.mark.parametrize("compiled", [True, False])
def test_one_output_unit_under_a_sparse_cross_entropy_is_refused(tmp_path, compiled):
    # Its loss is 0 for every label: on JAX a run (kdist's or fit's) trained nothing,
    # silently, whether the user compiled it so or kdist compiled it with its default.
    def binary():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        if compiled:
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model

    x = np.zeros((32, 3), np.float32)
    y = np.arange(32) % 2
    with pytest.raises(kdist.UsageError, match=r"has one output unit \(shape \(None, 1\)\), "
                       "and its loss, a sparse categorical cross-entropy, needs one per class"):
        kdist.train_and_evaluate(kdist.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=1,
                                                   checkpoint_dir=str(tmp_path / "run")),
                                 kdist.Dataset(x, y, x, y), model_fn=binary,
                                 log=lambda line: None)


def test_each_splits_labels_are_checked_whatever_the_others_dtype():
    """Integer and float labels are class indices (Keras' sparse losses cast floats
    to integers), checked split by split: a float training split does not exempt
    the test split, nor an integer one refuse float test labels; a float label out
    of range failed in TensorFlow's graph, or (JAX) trained on silently."""
    x = np.zeros((6, 3), np.float32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    classes = np.array([0, 1, 2, 0, 1, 2], np.int32)
    wrong = np.array([0, 1, 2, 0, 1, 7], np.int32)
    with pytest.raises(DataError, match=r"labels: test label 7 \(example 5\) is not a class"):
        building.check_labels(sources.prepare(kdist.Dataset(
            x, classes.astype(np.float32), x, wrong, "labels")), model)
    building.check_labels(sources.prepare(kdist.Dataset(
        x, classes, x, classes.astype(np.float32), "labels")), model)
    with pytest.raises(DataError, match=r"labels: train label 3.0 \(example 5\) is not a class"):
        building.check_labels(sources.prepare(kdist.Dataset(
            x, wrong.astype(np.float32) * 3 / 7, x, classes, "labels")), model)


def test_labels_per_pixel_are_checked_as_classes_in_arrays_and_streams(tmp_path):
    # A label per pixel (or time step) was not checked: on JAX a run trained on silently.
    def per_pixel():
        model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(3, 1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x = np.random.default_rng(0).normal(size=(64, 4, 4, 1)).astype(np.float32)
    y = (x[..., 0] > 0).astype(np.int32)
    y[37, 2, 3] = 3
    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=16, checkpoint_dir=str(
        tmp_path / "run"))
    for data, where in (
            (kdist.Dataset(x, y, x[:16], y[:16], "toy"), r"toy: train label 3 \(example 37\)"),
            (base.Inputs(Batches(x, y, 16)), r"the train data: batch 2: label 3 \(row 5\)")):
        with pytest.raises(DataError, match=where + " is not a class of the model, which has 3"):
            kdist.train_and_evaluate(config, data, model_fn=per_pixel, log=lambda line: None)
