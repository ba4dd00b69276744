"""Keras callbacks in `train_and_evaluate`, each against `fit` with the same callback.

Both sides start from the same weights and see the same batches in the same
order (kdist's epoch order, fed to `fit` by a PyDataset) with plain SGD,
chunks of 4 steps (`steps_per_execution=4` on both; 1 on torch, whose `fit`
takes no other) and 2 replicas for kdist: so the callbacks see the same
logs, make the same decisions, and the runs end with the same weights.
"""

import csv
import importlib.util
import shutil

import keras
import numpy as np
import pytest
from test_fit_parity import BATCH, classification_data, regularized_classifier

import kdist
from kdist.checkpoints import CheckpointManager
from kdist.inputs import arrays, base

REPLICAS, SEED, EPOCHS = 2, 3, 4
CHUNK = 1 if keras.backend.backend() == "torch" else 4  # Steps per compiled call.
TRAIN_X, TRAIN_Y = classification_data(1000, seed=4)  # 15 global batches of 64, and 40 rows.
TEST_X, TEST_Y = classification_data(301, seed=5)


class KdistOrder(keras.utils.PyDataset):
    """kdist's batches of each epoch, in its order, for `fit`; its callback `follow`
    tells it the epoch."""

    def __init__(self):
        super().__init__()
        self.epoch, self.steps = 0, base.steps_per_epoch(len(TRAIN_X), BATCH)
        self.follow = keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: setattr(self, "epoch", epoch))

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        order = arrays.epoch_order(len(TRAIN_X), SEED, self.epoch)
        rows = order[index * BATCH:(index + 1) * BATCH]
        return TRAIN_X[rows], TRAIN_Y[rows]


RECORDED = []  # A module's list that a callback's function appends to.


def record_loss(epoch, logs):
    RECORDED.append(logs["loss"])


class Recorder(keras.callbacks.Callback):
    """A user's own callback: the calls it gets, the learning rate at each epoch,
    and the epochs ended, in a dict of the caller's (`store`)."""

    def __init__(self, store=None):
        super().__init__()
        self.calls, self.rates, self.store = [], [], {} if store is None else store

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("batch_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch, sorted(logs)))

    def on_test_begin(self, logs=None):
        self.calls.append(("test_begin",))

    def on_test_end(self, logs=None):
        self.calls.append(("test_end", sorted(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, sorted(logs)))
        self.store["epochs"] = epoch + 1

    def on_train_end(self, logs=None):
        self.calls.append(("train_end", sorted(logs)))


def model_fn():
    model = regularized_classifier()
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=model.loss, metrics=["accuracy"],
                  steps_per_execution=CHUNK)
    return model


def on_kdist(callbacks, folder, model=model_fn, **settings):
    """kdist's result of `model` with `callbacks`, checkpoints in `folder`."""
    config = kdist.TrainConfig(epochs=EPOCHS, seed=SEED, replicas=REPLICAS,
                               batch_size_per_replica=BATCH // REPLICAS,
                               steps_per_execution=CHUNK, checkpoint_dir=str(folder), **settings)
    return kdist.train_and_evaluate(
        config, kdist.Dataset(TRAIN_X, TRAIN_Y, TEST_X, TEST_Y, "toy"), model_fn=model,
        log=lambda line: None, callbacks=callbacks)


def both(callbacks_fn, tmp_path, model=model_fn, **settings):
    """(kdist's result, fit's model and History), each run with `callbacks_fn(side)`;
    both models are built after `keras.utils.set_random_seed(SEED)` (kdist's run
    does it, in each replica process on torch), so they start from the same weights."""
    result = on_kdist(callbacks_fn("kdist"), tmp_path / "ckpt", model, **settings)
    if keras.backend.backend() == "jax":
        keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(SEED)
    reference, batches = model(), KdistOrder()
    history = reference.fit(batches, epochs=EPOCHS, shuffle=False, verbose=0,
                            validation_data=(TEST_X, TEST_Y), validation_batch_size=BATCH,
                            callbacks=[batches.follow, *callbacks_fn("fit")])
    return result, reference, history


def assert_same_run(result, reference, history):
    assert sorted(result.history) == sorted(history.history)
    for key, values in history.history.items():
        assert result.history[key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    for ours, theirs in zip(result.model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def averaging_model_fn():
    model = regularized_classifier()
    model.compile(optimizer=keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.9),
                  loss=model.loss, metrics=["accuracy"], steps_per_execution=CHUNK)
    return model


def test_swap_ema_weights_acts_as_in_fit_and_a_resume_goes_on_from_the_weights(tmp_path):
    # SwapEMAWeights(swap_on_epoch=True) holds the averages in the model from an
    # epoch's end to the next one's beginning. The checkpoint there keeps the
    # weights training goes on from: a run resumed from it, with a fresh callback,
    # ends as the straight run.
    def swapping(side):
        return [keras.callbacks.SwapEMAWeights(swap_on_epoch=True)]

    straight, reference, history = both(swapping, tmp_path, model=averaging_model_fn,
                                        checkpoint_every=1, keep=EPOCHS)
    assert_same_run(straight, reference, history)
    (tmp_path / "resumed").mkdir()
    shutil.copy(CheckpointManager(str(tmp_path / "ckpt")).paths()[0], tmp_path / "resumed")
    resumed = on_kdist(swapping("kdist"), tmp_path / "resumed", averaging_model_fn)
    assert resumed.epochs[0]["epoch"] == 1 and len(resumed.epochs) == EPOCHS
    for key, values in straight.history.items():
        assert resumed.history[key] == pytest.approx(values, rel=1e-6, abs=1e-7), key
    for ours, theirs in zip(resumed.model.get_weights(), straight.model.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_early_stopping_a_schedule_a_csv_log_and_your_own_callback_act_as_in_fit(tmp_path,
                                                                                   capfd):
    """EarlyStopping stops after epoch 2 of 4 and restores epoch 1's weights; the
    schedule sets each epoch's learning rate; the CSV logs and the own
    callback's calls, with their indices and log keys, are fit's. A list a
    LambdaCallback appends to (a closure's, a module's) and a dict a callback
    was given hold what they recorded, and EarlyStopping's message comes once (on torch, where each
    replica is a process, they stayed empty and it came once per process)."""
    made, losses, shared = {}, {"kdist": [], "fit": []}, {"kdist": {}, "fit": {}}

    def callbacks(side):
        recorded = losses[side]
        made[side] = [
            keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.5 * 0.6 ** epoch),
            keras.callbacks.EarlyStopping("loss", min_delta=1.0, patience=1,
                                          restore_best_weights=True, verbose=1),
            keras.callbacks.CSVLogger(str(tmp_path / f"{side}.csv")),
            keras.callbacks.LambdaCallback(
                on_epoch_end=lambda epoch, logs: recorded.append(logs["loss"])),
            Recorder(shared[side])]
        return made[side] + ([keras.callbacks.LambdaCallback(on_epoch_end=record_loss)]
                             if side == "kdist" else [])

    result, reference, history = both(callbacks, tmp_path)
    assert_same_run(result, reference, history)
    assert len(result.epochs) == 2 and result.stopped_by_callback
    assert losses["kdist"] == pytest.approx(losses["fit"], rel=1e-5) and len(losses["fit"]) == 2
    assert RECORDED == pytest.approx(losses["fit"], rel=1e-5)
    assert shared["kdist"] == {"epochs": 2} == shared["fit"]
    assert capfd.readouterr().out.count("Epoch 2: early stopping") == 2  # kdist's, fit's.
    ours, theirs = made["kdist"][-1], made["fit"][-1]
    last = KdistOrder().steps - 1  # fit gives the epoch's last chunk begin + 4 - 1: 15.
    assert ours.calls == [(call[0], min(call[1], last), *call[2:]) if call[0] == "batch_end"
                          else call for call in theirs.calls]
    assert ours.rates == pytest.approx([0.5, 0.3])
    with open(tmp_path / "kdist.csv") as f, open(tmp_path / "fit.csv") as g:
        mine, fits = list(csv.DictReader(f)), list(csv.DictReader(g))
    assert [list(row) for row in mine] == [list(row) for row in fits]
    assert [float(r["val_loss"]) for r in mine] == pytest.approx(
        [float(r["val_loss"]) for r in fits], rel=1e-5)
    # The newest checkpoint holds the weights as trained; the model in hand, the best ones,
    # and the newest checkpoint's optimizer, as fit's model ends (30 steps, rate 0.3).
    newest = model_fn()
    newest.load_weights(result.restored["checkpoint"])
    assert not np.allclose(newest.get_weights()[0], result.model.get_weights()[0])
    assert optimizer_state(result.model) == optimizer_state(reference) == {
        "iteration": 2 * KdistOrder().steps, "learning_rate": pytest.approx(0.3)}


class Reader(keras.callbacks.Callback):
    """A user's callback that reads the model's metrics and `model.history`, as
    plotting callbacks do, and changes the logs: a value scaled, text added, a
    value removed in odd epochs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def metrics(self):
        return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("batch_end", self.metrics()))

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(("epoch_end", self.metrics(), {
            k: list(v) for k, v in getattr(self.model.history, "history", {}).items()}))
        logs["val_loss"] *= 10
        logs["note"] = f"epoch {epoch}"
        if epoch % 2:
            del logs["val_accuracy"]


def test_a_callback_reads_the_metrics_and_history_and_changes_the_logs_as_in_fit(tmp_path):
    """The metrics read 0.0 in every call (kdist's steps keep their state apart),
    `model.history` was None, a changed log value left the history as it was, and
    text in the logs raised a bare ValueError at the epoch's end; a removed value
    stayed in the history."""
    made = {}

    def callbacks(side):
        made[side] = [Reader()]
        return made[side]

    result, reference, history = both(callbacks, tmp_path)
    assert [v for v in result.history["note"]] == [f"epoch {e}" for e in range(EPOCHS)]
    assert history.history.pop("note") == result.history.pop("note")
    assert_same_run(result, reference, history)
    assert result.history["val_loss"][0] > 5 * result.history["loss"][0]  # Scaled by 10.
    assert len(result.history["val_accuracy"]) == (EPOCHS + 1) // 2  # Even epochs' only.
    ours, theirs = made["kdist"][0].seen, made["fit"][0].seen
    assert [call[0] for call in ours] == [call[0] for call in theirs]
    for mine, fits in zip(ours, theirs, strict=True):
        assert mine[1] == pytest.approx(fits[1], rel=1e-5) and mine[1]["loss"] > 0, mine
        if mine[0] == "epoch_end":
            assert sorted(mine[2]) == sorted(fits[2]), mine
            for key, values in fits[2].items():
                assert (values if key == "note" else pytest.approx(values, rel=1e-5)
                        ) == mine[2][key], key


def optimizer_state(model):
    return {v.name: float(keras.ops.convert_to_numpy(v)) for v in model.optimizer.variables}


def test_reduce_lr_on_plateau_halves_the_learning_rate_as_in_fit_and_tensorboard_shows_it(
        tmp_path):
    """No epoch improves the loss by 1.0: from the second on, each halves the rate
    after logging it. `tensorboard=DIR` writes the run's curves, read back with
    TensorBoard's own reader: per epoch, as Keras' TensorBoard callback lays them
    out, and after every chunk at the global step."""
    result, reference, history = both(lambda side: [keras.callbacks.ReduceLROnPlateau(
        "loss", factor=0.5, patience=1, min_delta=1.0)] + keras_tensorboard(tmp_path / side),
        tmp_path, tensorboard=str(tmp_path / "tb"))
    assert_same_run(result, reference, history)
    if KERAS_TENSORBOARD:  # Keras' own callback writes the same curves as under fit.
        for split in ("train", "validation"):
            ours, theirs = (tensorboard_events(tmp_path / side / split)
                            for side in ("kdist", "fit"))
            assert sorted(ours) == sorted(theirs) and ours, split
            for tag, values in theirs.items():
                if isinstance(values, tuple):  # Texts: the model's summary, once.
                    assert len(ours[tag]) == len(values), (split, tag)
                else:
                    assert [s for s, _ in ours[tag]] == [s for s, _ in values], (split, tag)
                    assert [v for _, v in ours[tag]] == pytest.approx(
                        [v for _, v in values], rel=1e-5), (split, tag)
    assert result.history["learning_rate"] == pytest.approx([0.5, 0.5, 0.25, 0.125])

    train, validation = (tensorboard_events(tmp_path / "tb" / split)
                         for split in ("train", "validation"))
    for split, prefix, names in ((train, "", ("loss", "accuracy", "learning_rate")),
                                 (validation, "val_", ("loss", "accuracy"))):
        for name in names:
            steps, values = zip(*split[f"epoch_{name}"])
            assert steps == tuple(range(EPOCHS)), name
            assert values == pytest.approx(result.history[prefix + name], rel=1e-6), name
    steps = KdistOrder().steps  # Per epoch.
    chunk_ends = [e * steps + min(s + CHUNK, steps) for e in range(EPOCHS)
                  for s in range(0, steps, CHUNK)]
    for name in ("loss", "accuracy", "learning_rate", "samples_per_sec"):
        assert [step for step, _ in train[f"batch_{name}"]] == chunk_ends, name
    assert [v for s, v in train["batch_loss"] if s % steps == 0] == pytest.approx(
        result.history["loss"], rel=1e-6)  # An epoch's last chunk: the epoch's loss.
    assert [v for s, v in train["batch_learning_rate"] if s % steps == 0] == pytest.approx(
        result.history["learning_rate"])  # The epoch's rate: it is halved at its end.
    assert all(v > 0 for _, v in train["batch_samples_per_sec"])
    [config] = train["config"]
    assert "| tensorboard |" in config and "Replicas: 2" in config
    assert "| learning_rate | `0.5` |" in config  # The model's compiled rate.


def test_terminate_on_nan_where_fit_stops_kdist_raises_keeping_the_checkpoints(tmp_path):
    """One huge row at step 7 of epoch 1 makes the loss infinite. `fit` with
    TerminateOnNaN stops after that step's chunk; kdist (TerminateOnNaN given
    too) raises `TrainingError` naming the step before any callback sees the
    loss, writes no checkpoint of the broken weights, and keeps the one of
    step 4, which holds fit's weights after step 4."""
    rows = arrays.epoch_order(len(TRAIN_X), SEED, 0)
    train_x = TRAIN_X.copy()
    train_x[rows[6 * BATCH + 1]] = 1e38  # Step 7 (index 6), a row of replica 0.
    seen, at_step_4 = [], []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((batch, logs["loss"]))
            if batch == 3:
                at_step_4.extend(self.model.get_weights())

    config = kdist.TrainConfig(epochs=EPOCHS, seed=SEED, replicas=REPLICAS,
                               batch_size_per_replica=BATCH // REPLICAS, steps_per_execution=CHUNK,
                               checkpoint_dir=str(tmp_path), checkpoint_every_steps=4)
    with pytest.raises(kdist.TrainingError, match=r"non-finite loss at epoch 1, step 7;"):
        kdist.train_and_evaluate(config, kdist.Dataset(train_x, TRAIN_Y, TEST_X, TEST_Y, "toy"),
                                 model_fn=model_fn, log=lambda line: None,
                                 callbacks=[keras.callbacks.TerminateOnNaN()])
    if keras.backend.backend() == "jax":
        keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(SEED)
    reference = model_fn()
    reference.fit(train_x[rows], TRAIN_Y[rows], batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                  verbose=0, callbacks=[Watch(), keras.callbacks.TerminateOnNaN()])
    assert seen[-1][0] // CHUNK == 6 // CHUNK and not np.isfinite(seen[-1][1])
    assert all(np.isfinite(loss) for _, loss in seen[:-1])
    [checkpoint] = CheckpointManager(str(tmp_path)).paths()
    assert checkpoint.endswith("ckpt-00000004.weights.h5")
    written = model_fn()
    written.load_weights(checkpoint)
    for ours, theirs in zip(written.get_weights(), at_step_4, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


# Keras' TensorBoard callback writes with TensorFlow's summary API: it runs where
# TensorFlow is installed (the tensorflow session), on any Keras backend.
KERAS_TENSORBOARD = importlib.util.find_spec("tensorflow") is not None


def keras_tensorboard(folder):
    return [keras.callbacks.TensorBoard(str(folder))] if KERAS_TENSORBOARD else []


def tensorboard_events(folder):
    """{tag: [(step, value)...]} of the scalars, {tag: (text, ...)} of the texts, in
    `folder`."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    events = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    found = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
             for tag in events.Tags()["scalars"]}
    for tag in events.Tags()["tensors"]:  # Texts; scalars as TensorFlow's summaries write them.
        values = [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)]
        found[tag] = (tuple(value.item().decode() for _, value in values)
                      if values[0][1].dtype.kind in "OS"
                      else [(step, float(value)) for step, value in values])
    return found


class StopOnOneReplica(keras.callbacks.Callback):
    """Sets `stop_training` in epoch 2 from step 5 on, on the last replica only (a
    process of its own on torch)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        last = True
        if keras.backend.backend() == "torch":
            import torch.distributed

            last = torch.distributed.get_rank() == REPLICAS - 1
        if self.epoch == 1 and batch >= 5 and last:
            self.model.stop_training = True


def test_a_stop_from_one_replica_ends_every_replica_with_a_checkpoint_and_the_model(tmp_path):
    """Every replica stops after the chunk in which one set `stop_training`, with a
    checkpoint there, written once where a periodic checkpoint falls on that step;
    the model in hand predicts as that checkpoint does; and running again resumes
    into the stopped state: nothing more is trained."""
    steps = KdistOrder().steps
    stopped_at = steps + 6 if CHUNK == 1 else steps + 8  # After the chunk of step 5.
    config = kdist.TrainConfig(epochs=EPOCHS, seed=SEED, replicas=REPLICAS,
                               batch_size_per_replica=BATCH // REPLICAS,
                               steps_per_execution=CHUNK, checkpoint_dir=str(tmp_path),
                               checkpoint_every_steps=stopped_at)
    data = kdist.Dataset(TRAIN_X, TRAIN_Y, TEST_X, TEST_Y, "toy")
    lines = []
    result = kdist.train_and_evaluate(config, data, model_fn=model_fn, log=lines.append,
                                      callbacks=[StopOnOneReplica()])
    saved = [line for line in lines if line.startswith("Saved checkpoint")]
    assert len(saved) == 1 and saved[0].endswith(f"ckpt-{stopped_at:08d}.weights.h5")
    assert result.stopped_by_callback and len(result.epochs) == 1
    assert result.restored["checkpoint"].endswith(f"ckpt-{stopped_at:08d}.weights.h5")
    assert f"A callback stopped training (model.stop_training) at epoch 2, step " \
           f"{stopped_at - steps}" in lines
    newest = model_fn()
    newest.load_weights(result.restored["checkpoint"])
    np.testing.assert_array_equal(result.model.predict(TEST_X, verbose=0),
                                  newest.predict(TEST_X, verbose=0))
    again = kdist.train_and_evaluate(config, data, model_fn=model_fn, log=lines.append)
    assert "where a callback stopped training: nothing left to train" in "\n".join(lines)
    assert again.restored["checkpoint"] == result.restored["checkpoint"]
    assert again.epochs == result.epochs and again.stopped_by_callback


class FreezeFirstLayer(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            self.model.layers[1].trainable = False  # The hidden layer (0: the Input).


def test_a_callback_that_changes_which_weights_train_is_one_error(tmp_path):
    """fit on TensorFlow goes on training the old weights, on JAX raises, on torch
    trains the others: kdist ran each backend's way (epoch 3's loss 0.44 on
    TensorFlow and JAX, 0.60 on torch), silently."""
    with pytest.raises(kdist.UsageError, match=r"a callback's on_epoch_end changed which "
                                                r"weights train"):
        on_kdist([FreezeFirstLayer()], tmp_path / "freeze", checkpoint_every=1)
    # The checkpoint of the epoch before the change stays (on_epoch_end comes first).
    latest = kdist.latest_checkpoint(str(tmp_path / "freeze"))
    assert latest is not None and latest.endswith(f"ckpt-{15:08d}.weights.h5"), latest
