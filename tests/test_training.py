"""The loop: resume equals an uninterrupted run, bad losses stop cleanly, runs repeat."""

import dataclasses
import os
import shutil
import threading

import h5py
import keras
import numpy as np
import pytest
from helpers import SEVERAL, edit_metadata

import kdist
from kdist import checkpoints
from kdist.inputs.base import Inputs
from kdist.loop import training
from kdist.models import losses

TIMING = ("seconds", "samples_per_sec")


def config(tmp_path, name, **overrides):
    settings = dict(epochs=4, batch_size_per_replica=32 // SEVERAL, replicas=SEVERAL,
                    steps_per_epoch=6,
                    checkpoint_every=1, checkpoint_dir=str(tmp_path / name), seed=5)
    settings.update(overrides)
    return training.TrainConfig(**settings)


def run(cfg, dataset):
    return training.train_and_evaluate(cfg, dataset, log=lambda line: None)


def checkpoint_arrays(path):
    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: arrays.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return arrays


def without_timing(history):
    return [{k: v for k, v in record.items() if k not in TIMING} for record in history]


def test_resumed_run_matches_uninterrupted_run(tmp_path, small_dataset):
    straight = run(config(tmp_path, "straight"), small_dataset)
    run(config(tmp_path, "resumed", epochs=2), small_dataset)
    resumed = run(config(tmp_path, "resumed"), small_dataset)

    a = checkpoint_arrays(checkpoints.CheckpointManager(str(tmp_path / "straight")).latest()[0])
    b = checkpoint_arrays(checkpoints.CheckpointManager(str(tmp_path / "resumed")).latest()[0])
    assert a.keys() == b.keys() and any(k.startswith("optimizer") for k in a)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= 1e-6, f"resumed weights differ by {worst}"
    assert without_timing(resumed.epochs) == without_timing(straight.epochs)


def test_a_format_1_checkpoint_resumes_at_its_epoch_end(tmp_path, small_dataset):
    """Format 1 (before checksums) records the position alone: no history, statistics,
    backend or replicas."""
    run(config(tmp_path, "old", epochs=1), small_dataset)
    path = checkpoints.CheckpointManager(str(tmp_path / "old")).latest()[0]
    edit_metadata(path, lambda meta: dict(
        format="kdist-checkpoint-1",
        **{key: meta[key] for key in ("step", "epoch", "step_in_epoch", "signature")}))
    lines = []
    result = training.train_and_evaluate(config(tmp_path, "old", epochs=2), small_dataset,
                                         log=lines.append)
    assert (f"Checkpoints: {tmp_path / 'old'}, resumed from ckpt-00000006.weights.h5 (end of "
            "epoch 1; written by an older kdist)\n") in "\n".join(lines)
    assert [record["epoch"] for record in result.epochs] == [2]


def test_restored_model_scores_the_last_epoch_accuracy(tmp_path, small_dataset):
    result = run(config(tmp_path, "run", epochs=3, checkpoint_every=2), small_dataset)
    assert [r["epoch"] for r in result.epochs] == [1, 2, 3]
    assert result.restored["checkpoint"].endswith("ckpt-00000018.weights.h5")
    assert result.restored["test_accuracy"] == result.epochs[-1]["test_accuracy"]
    assert result.epochs[-1]["train_loss"] < result.epochs[0]["train_loss"]


def test_same_seed_gives_the_same_numbers(tmp_path, small_dataset):
    first = run(config(tmp_path, "a", epochs=2), small_dataset)
    second = run(config(tmp_path, "b", epochs=2), small_dataset)
    assert without_timing(first.epochs) == without_timing(second.epochs)


def test_non_finite_loss_stops_and_keeps_checkpoints(tmp_path, small_dataset):
    run(config(tmp_path, "run", epochs=2), small_dataset)
    folder = tmp_path / "run"
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}

    def exploding_loss(labels, logits):  # Inf from the first step of the resumed epoch 3.
        return losses.sparse_categorical_crossentropy(labels, logits) / 0.0

    with pytest.raises(training.TrainingError, match="epoch 3, step 1"):
        training.train_and_evaluate(config(tmp_path, "run"), small_dataset,
                                    loss_fn=exploding_loss, log=lambda line: None)
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before


@pytest.mark.parametrize("bad, message", [
    (3, "Checkpoints written before stay valid; training diverged: try a lower learning rate"),
    # The first step's said so too, where no learning rate is the cause.
    (1, "It is not finite at the starting weights: check the model, its loss and the data")])
def test_a_non_finite_loss_inside_a_chunk_is_named_at_its_step(tmp_path, small_dataset, bad,
                                                                message):
    """4 steps to a compiled chunk; only step `bad`'s loss overflows (sample weights of
    1e38, finite input): the error names that step, and no epoch line or checkpoint
    follows."""
    x, y = small_dataset.train_x, small_dataset.train_y

    def batches():
        for i in range(6):
            weights = np.full(32, 1e38 if i == bad - 1 else 1.0, np.float32)
            yield x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32], weights

    lines = []
    with pytest.raises(training.TrainingError,
                       match=f"non-finite loss at epoch 1, step {bad}; stopping. {message}"):
        training.train_and_evaluate(
            config(tmp_path, "run", epochs=1, steps_per_execution=4),
            Inputs(batches, (small_dataset.test_x, small_dataset.test_y)), log=lines.append)
    assert not [line for line in lines if "Loss" in line], lines
    assert [n for n in os.listdir(tmp_path / "run") if n.endswith(".h5")] == []


def test_metrics_file_has_one_line_per_epoch_and_the_restored_result(tmp_path, small_dataset):
    import json

    path = tmp_path / "metrics.jsonl"
    result = run(config(tmp_path, "run", epochs=2, metrics_file=str(path)), small_dataset)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("epoch") for line in lines[:2]] == [1, 2]
    assert set(lines[0]) == {"epoch", "train_loss", "train_accuracy", "test_loss",
                             "test_accuracy", "seconds", "samples_per_sec", "skipped_steps"}
    assert lines[0]["skipped_steps"] == 0
    assert lines[2]["restored"] is True
    assert lines[2]["test_accuracy"] == result.epochs[-1]["test_accuracy"]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == ("epoch,samples_per_sec,seconds,skipped_steps,test_accuracy,test_loss,"
                       "train_accuracy,train_loss")  # keras.callbacks.CSVLogger's layout.
    assert [row.split(",")[0] for row in rows[1:]] == ["0", "1"]
    assert float(rows[2].split(",")[4]) == lines[1]["test_accuracy"]


def test_lock_is_held_while_training_and_released_on_every_exit(tmp_path, small_dataset):
    lock = tmp_path / "run" / "kdist.lock"
    holder = checkpoints.CheckpointManager(str(tmp_path / "run"))
    holder.prepare(lock=True)
    with pytest.raises(checkpoints.CheckpointError, match="in use by another run"):
        run(config(tmp_path, "run", epochs=1), small_dataset)
    assert lock.exists()  # The refused run leaves the holder's lock alone.
    holder.release()

    run(config(tmp_path, "run", epochs=1), small_dataset)
    assert not lock.exists()

    def exploding_loss(labels, logits):
        return losses.sparse_categorical_crossentropy(labels, logits) / 0.0

    with pytest.raises(training.TrainingError):
        training.train_and_evaluate(config(tmp_path, "run", epochs=2), small_dataset,
                                    loss_fn=exploding_loss, log=lambda line: None)
    assert not lock.exists()
    with pytest.raises(training.Interrupted):
        training.train_and_evaluate(config(tmp_path, "run", epochs=3), small_dataset,
                                    log=lambda line: None, stop=StopAfter(1))
    assert not lock.exists()


class StopAfter:
    """A stop request that turns true after `chunks` compiled calls (steps, with 1 per call)."""

    signal_name = "SIGTERM"

    def __init__(self, chunks):
        self.checks = 0
        self.chunks = chunks

    def __bool__(self):
        self.checks += 1
        return self.checks >= self.chunks


class Asked:
    """A caller's own stop object, true at once, with no signal."""

    def __bool__(self):
        return True


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_stop_object_of_the_caller_is_named_as_what_stopped_the_run(
        tmp_path, small_dataset, replicas):
    # torch's 2 replica processes: "SIGTERM: stopped while the replica processes were
    # joining, before the first step", where one process trains its first chunk and saves.
    with pytest.raises(training.Interrupted, match="^asked to stop: stopped after epoch 1; "
                                                   "run again with the same settings") \
            as stopped:
        training.train_and_evaluate(config(tmp_path, "run", epochs=1, replicas=replicas),
                                    small_dataset, log=lambda line: None, stop=Asked())
    assert stopped.value.signal_name is None and stopped.value.exit_status == 143
    assert checkpoints.latest_checkpoint(str(tmp_path / "run"))


def test_an_event_as_the_stop_object_stops_the_run_once_it_is_set(tmp_path, small_dataset):
    # A threading.Event, always true as a bool, stopped every run at its first chunk.
    event = threading.Event()
    result = training.train_and_evaluate(config(tmp_path, "unset", epochs=1), small_dataset,
                                         log=lambda line: None, stop=event)
    assert len(result.epochs) == 1 and not result.stopped_by_callback
    event.set()
    with pytest.raises(training.Interrupted, match="^asked to stop: stopped after epoch 1"):
        training.train_and_evaluate(config(tmp_path, "set", epochs=2), small_dataset,
                                    log=lambda line: None, stop=event)


class HalveABiasAtEpochBegin(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        bias = self.model.trainable_variables[-1]
        bias.assign(bias * 0.5 + 0.25)


def test_a_mid_epoch_resume_keeps_what_callbacks_set_at_the_epochs_start(
        tmp_path, small_dataset):
    # The checkpoint holds the rate the scheduler set and the bias the other callback
    # changed at epoch 2's start; calling on_epoch_begin again on the resume must not
    # change them a second time (the bias did: weights 0.0055-0.016 apart).
    def train(name, stop=None):
        halving = keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5)
        return training.train_and_evaluate(
            config(tmp_path, name, epochs=2, steps_per_execution=1), small_dataset,
            log=lambda line: None, stop=stop, callbacks=[halving, HalveABiasAtEpochBegin()])

    straight = train("straight")
    with pytest.raises(training.Interrupted, match="epoch 2, step"):
        train("resumed", stop=StopAfter(9))
    resumed = train("resumed")
    assert resumed.history["learning_rate"] == straight.history["learning_rate"]
    worst = max(float(np.abs(a - b).max()) for a, b in
                zip(resumed.model.get_weights(), straight.model.get_weights()))
    assert worst <= 1e-6, f"the resumed run ends {worst} from the straight one"


def test_an_interrupted_run_leaves_its_tensorboard_curves_on_disk(tmp_path, small_dataset):
    # The event files were closed only at the process's exit: when `Interrupted`
    # reached the caller, the interrupted epoch's batch curves were not on disk.
    from test_callbacks import tensorboard_events

    cfg = config(tmp_path, "run", epochs=2, steps_per_execution=1,
                 tensorboard=str(tmp_path / "tb"))
    with pytest.raises(training.Interrupted, match="epoch 2, step") as stopped:
        training.train_and_evaluate(cfg, small_dataset, log=lambda line: None,
                                    stop=StopAfter(9))
    step = int(str(stopped.value).split("epoch 2, step ")[1].split(";")[0])
    train = tensorboard_events(tmp_path / "tb" / "train")
    assert [s for s, _ in train["batch_loss"]] == list(range(1, 6 + step + 1))
    assert [s for s, _ in train["epoch_loss"]] == [0]


class HalveAtEpochEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        rate = self.model.optimizer.learning_rate
        logs["learning_rate"] = float(keras.ops.convert_to_numpy(rate))  # The epoch's.
        rate.assign(rate * 0.5)


def test_a_resume_keeps_the_rate_a_callback_set_unless_another_rate_is_given(
        tmp_path, small_dataset):
    # The checkpoint holds the rate the callback halved; the run's own rate (the
    # optimizer kdist builds) replaces it only where the resumed run gives another.
    def train(name, epochs, rate=0.1):
        lines = []
        result = training.train_and_evaluate(
            config(tmp_path, name, epochs=epochs, learning_rate=rate), small_dataset,
            log=lines.append, callbacks=[HalveAtEpochEnd()], optimizer_fn=training.sgd)
        return result, lines

    straight, _ = train("straight", 3)
    train("resumed", 1)
    resumed, lines = train("resumed", 3)
    assert not any("learning rate" in line for line in lines)
    assert resumed.history["learning_rate"] == straight.history["learning_rate"] == \
        pytest.approx([0.1, 0.05, 0.025])
    worst = max(float(np.abs(a - b).max()) for a, b in
                zip(resumed.model.get_weights(), straight.model.get_weights()))
    assert worst <= 1e-6, f"the resumed run ends {worst} from the straight one"
    _, lines = train("resumed", 2)  # Fewer epochs than the checkpoint's: it says so.
    assert any("(end of epoch 3, and epochs is 2: nothing left to train;" in line
               for line in lines), lines
    changed, lines = train("resumed", 4, rate=0.02)
    assert any("; learning rate 0.02 from now on" in line for line in lines), lines
    assert changed.history["learning_rate"][3] == pytest.approx(0.02)


def test_a_keras_backup_and_restore_is_refused_before_any_work(tmp_path, small_dataset):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(kdist.UsageError, match="BackupAndRestore loads its own backup"):
        training.train_and_evaluate(config(tmp_path, "run"), small_dataset,
                                    log=lambda line: None, callbacks=[backup])
    assert not (tmp_path / "run").exists() and not (tmp_path / "backup").exists()
    with pytest.raises(kdist.UsageError, match="must be keras.callbacks.Callback objects; "
                                               "got str: 'loss'"):
        training.train_and_evaluate(config(tmp_path, "run"), small_dataset,
                                    log=lambda line: None, callbacks=["loss"])
    assert not (tmp_path / "run").exists()


def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
        tmp_path, small_dataset, monkeypatch):
    # A checkpoint folder under a file was refused after the engine was made (on torch
    # with several replicas, after the replica processes had started, 9 s here).
    def started(*args, **kwargs):
        raise AssertionError("the run started work")

    monkeypatch.setattr(training.engines, "create_engine", started)
    monkeypatch.setattr(training.replicas, "run", started)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for overrides, error, match in [
            (dict(checkpoint_dir=str(blocker / "ck")), checkpoints.CheckpointError,
             f"{blocker} is a file, not a folder"),
            (dict(metrics_file=str(blocker / "m.jsonl")), kdist.UsageError,
             "which is not an existing folder"),
            (dict(tensorboard=str(blocker / "tb")), kdist.UsageError,
             f"{blocker} is a file, not a folder")]:
        with pytest.raises(error, match=match):
            run(config(tmp_path, "run", **overrides), small_dataset)
    assert not (tmp_path / "run").exists()


def test_a_model_where_model_fn_goes_is_refused_before_any_work(tmp_path, small_dataset):
    # Keras' "missing a required argument: 'inputs'", from the replica processes on torch.
    model = keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
    with pytest.raises(kdist.UsageError, match=f"model_fn is the model '{model.name}' itself; "
                                               "pass the function that builds it"):
        training.train_and_evaluate(config(tmp_path, "run"), small_dataset, model_fn=model,
                                    log=lambda line: None)
    assert not (tmp_path / "run").exists()


def test_callbacks_none_or_one_callback_are_taken_as_fit_takes_them(tmp_path, small_dataset):
    # None was a TypeError ('NoneType' object is not iterable).
    seen = []
    one = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(epoch))
    for name, callbacks in (("none", None), ("one", one)):
        training.train_and_evaluate(config(tmp_path, name, epochs=1, steps_per_epoch=1),
                                    small_dataset, log=lambda line: None, callbacks=callbacks)
    assert seen == [0]


def test_class_weight_kdist_cannot_apply_is_one_usage_error_before_any_work(
        tmp_path, small_dataset):
    # Was Python's TypeError (an unexpected keyword); a traceback for labels per pixel.
    data = small_dataset
    cases = [
        (data, [1.0, 2.0], "give a dict"),
        (dataclasses.replace(data, train_sample_weight=np.ones(len(data.train_y))), {1: 2.0},
         "not both"),
        (dataclasses.replace(data, train_y=(data.train_y, data.train_y)), {1: 2.0},
         "one label array"),
        (dataclasses.replace(data, train_y=np.zeros((len(data.train_y), 4, 4), np.int32)),
         {1: 2.0}, r"shaped \(512, 4, 4\)"),
        (Inputs((data.train_x, data.train_y)), {1: 2.0}, "for kdist.Inputs"),
    ]
    for dataset, class_weight, match in cases:
        with pytest.raises(kdist.UsageError, match=match):
            training.train_and_evaluate(config(tmp_path, "refused"), dataset,
                                        log=lambda line: None, class_weight=class_weight)
    assert not (tmp_path / "refused").exists()


def test_resume_with_fewer_steps_per_epoch_keeps_order_and_reports_the_epoch(
        tmp_path, small_dataset):
    run(config(tmp_path, "run", epochs=1, keep=3), small_dataset)
    lines = []  # The stop lands on a periodic checkpoint's step: one write names it.
    with pytest.raises(training.Interrupted, match=(
            r"epoch 2, step 4; saved \S+ckpt-00000010.weights.h5; run again with the same "
            "settings")):
        training.train_and_evaluate(
            config(tmp_path, "run", epochs=3, keep=3, steps_per_execution=1,
                   checkpoint_every_steps=5), small_dataset, log=lines.append,
            stop=StopAfter(4))
    assert [line for line in lines if line.startswith("Saved checkpoint")] == [
        f"Saved checkpoint {tmp_path / 'run' / 'ckpt-00000010.weights.h5'}"]
    lines = []
    result = training.train_and_evaluate(
        config(tmp_path, "run", epochs=3, keep=3, steps_per_epoch=3), small_dataset,
        log=lines.append)
    epoch2 = [line for line in lines if line.startswith("Epoch 2/3")][0]
    assert epoch2.endswith("(trained before the resume)"), epoch2
    assert result.epochs[1]["samples_per_sec"] is None
    assert result.epochs[2]["samples_per_sec"] > 0
    names = [os.path.basename(p) for p in
             checkpoints.CheckpointManager(str(tmp_path / "run")).paths()]
    # 6 steps per epoch, then 3: epoch 1 ends at step 6, the interruption at 10,
    # epochs 2 and 3 at 6 and 9; epoch 2's name is epoch 1's, which it does not
    # replace: it takes the next free one, 11 (epoch 1's goes when epoch 3 saves).
    assert names == ["ckpt-00000010.weights.h5", "ckpt-00000011.weights.h5",
                     "ckpt-00000009.weights.h5"]
    assert result.restored["checkpoint"].endswith("ckpt-00000009.weights.h5")


def test_checkpoints_by_steps_and_minutes_land_mid_epoch_and_resume_bitwise(tmp_path):
    """--checkpoint-every-steps 5 saves after each chunk (4 steps) that reaches a multiple
    of 5, mid-epoch too; a run resumed from the mid-epoch one, saving by minutes (every
    chunk, here), ends bitwise where the straight run ends, keeping the newest 3; so does
    one resumed from the same checkpoint as an older kdist wrote it."""
    from test_fit_parity import classification_data, regularized_classifier

    import kdist

    x, y = classification_data(480 + 30, seed=4)  # 15 global batches of 32, and 30 rows.
    data = kdist.Dataset(x[:480], y[:480], x[480:], y[480:], "toy")
    settings = dict(epochs=2, batch_size_per_replica=16, replicas=2, steps_per_execution=4,
                    seed=3, checkpoint_every=2)
    straight = training.TrainConfig(**settings, checkpoint_every_steps=5, keep=20,
                                    checkpoint_dir=str(tmp_path / "straight"))
    lines = []
    training.train_and_evaluate(straight, data, model_fn=regularized_classifier,
                                log=lines.append)
    steps = [int(p.split("-")[-1].split(".")[0]) for p in sorted(os.listdir(tmp_path / "straight"))]
    assert steps == [8, 12, 15, 23, 27, 30]  # Chunks end at 4, 8, 12, 15, 19, 23, 27, 30.
    assert sum(line.startswith("Saved checkpoint") for line in lines) == 6

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    os.link(tmp_path / "straight" / "ckpt-00000012.weights.h5",
            resumed / "ckpt-00000012.weights.h5")
    training.train_and_evaluate(
        training.TrainConfig(**settings, checkpoint_every_minutes=1e-9,
                             checkpoint_dir=str(resumed)),
        data, model_fn=regularized_classifier, log=lines.append)
    assert sorted(os.listdir(resumed)) == [f"ckpt-{s:08d}.weights.h5" for s in (23, 27, 30)]
    a = checkpoint_arrays(tmp_path / "straight" / "ckpt-00000030.weights.h5")
    b = checkpoint_arrays(resumed / "ckpt-00000030.weights.h5")
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key]), key

    # As an older kdist wrote it: no worker or example counts (checked where recorded).
    older = tmp_path / "older"
    older.mkdir()
    shutil.copy(tmp_path / "straight" / "ckpt-00000012.weights.h5", older)
    meta = edit_metadata(older / "ckpt-00000012.weights.h5", lambda meta: {
        key: value for key, value in meta.items() if key not in ("workers", "train_examples")})
    assert meta["workers"] >= 1 and meta["train_examples"] == 480
    training.train_and_evaluate(
        training.TrainConfig(**settings, checkpoint_dir=str(older)),
        data, model_fn=regularized_classifier, log=lines.append)
    c = checkpoint_arrays(older / "ckpt-00000030.weights.h5")
    for key in a:
        assert np.array_equal(a[key], c[key]), key


def test_a_resume_with_another_global_batch_counts_in_its_own_batches(tmp_path):
    """A checkpoint counts global batches of its seed's order (or of each worker's
    own share): in the middle of an epoch another global batch, seed or count of
    workers reading their own shares is refused (it would train some examples
    twice, and skip some); at an epoch's
    end it resumes, and a stream of unknown length is measured again, not cut at the
    checkpoint's step count (which would train half the epoch)."""
    from test_fit_parity import classification_data, regularized_classifier

    import kdist
    from kdist.errors import UsageError

    x, y = classification_data(480 + 32, seed=4)

    def batches(epoch):  # Unknown length: 15 global batches of 32, 30 of 16.
        for start in range(0, 480, 40):
            yield x[start:start + 40], y[start:start + 40]

    def test_batches():
        yield x[480:], y[480:]

    data = kdist.Inputs(train=batches, test=test_batches)
    first = training.TrainConfig(epochs=1, batch_size_per_replica=32, replicas=1,
                                 steps_per_execution=4, checkpoint_every_steps=8,
                                 checkpoint_dir=str(tmp_path))
    training.train_and_evaluate(first, data, model_fn=regularized_classifier, log=print)
    end, middle = tmp_path / "ckpt-00000015.weights.h5", tmp_path / "ckpt-00000008.weights.h5"
    assert end.exists() and middle.exists()

    smaller = dataclasses.replace(first, epochs=2, batch_size_per_replica=16)
    os.rename(end, tmp_path / "end")  # The newest is now the mid-epoch one.
    with pytest.raises(UsageError, match=(
            r"ckpt-00000008.weights.h5 stops in the middle of epoch 1, after 8 global "
            r"batches of 32; this run's global batch is 16 \(batch_size_per_replica x "
            r"replicas\): resume with a global batch of 32 to finish the epoch, or "
            r"resume=False$")):
        training.train_and_evaluate(smaller, data, model_fn=regularized_classifier)
    with pytest.raises(UsageError, match=(  # Another order of the epoch's examples.
            r"stops in the middle of epoch 1, in the example order of seed 0; this run's is "
            r"1: resume with seed=0 to finish the epoch, or resume=False$")):
        training.train_and_evaluate(dataclasses.replace(first, seed=1), data,
                                    model_fn=regularized_classifier)
    edit_metadata(middle, lambda meta: dict(meta, workers=2))  # As if 2 workers wrote it.

    def shares(epoch, shard):  # Each worker's own share: 2 workers read other examples.
        yield from batches(epoch)

    with pytest.raises(UsageError, match=(
            r"epoch 1, where each of 2 processes read its own share of the training data; "
            r"this run has 1 such: resume with 2 \(workers; on torch, replicas\)")):
        training.train_and_evaluate(first, kdist.Inputs(train=shares, test=test_batches),
                                    model_fn=regularized_classifier)
    os.rename(tmp_path / "end", end)
    result = training.train_and_evaluate(smaller, data, model_fn=regularized_classifier)
    assert [e["epoch"] for e in result.epochs] == [1, 2]
    assert os.path.basename(result.restored["checkpoint"]) == "ckpt-00000060.weights.h5"


def test_a_mid_epoch_resume_with_other_training_examples_is_refused(tmp_path):
    """Arrays are shuffled by their count: with another count a mid-epoch position
    names other examples."""
    from test_fit_parity import classification_data, regularized_classifier

    import kdist
    from kdist.errors import UsageError

    x, y = classification_data(512, seed=5)
    settings = dict(epochs=1, batch_size_per_replica=32, replicas=1, steps_per_execution=4,
                    checkpoint_dir=str(tmp_path))
    training.train_and_evaluate(
        training.TrainConfig(**settings, checkpoint_every_steps=8),
        kdist.Dataset(x[:480], y[:480], x[480:], y[480:], "toy"),
        model_fn=regularized_classifier)
    os.remove(tmp_path / "ckpt-00000015.weights.h5")  # The newest: 8 batches into epoch 1.
    with pytest.raises(UsageError, match=(
            r"ckpt-00000008.weights.h5 stops in the middle of epoch 1, in an order of 480 "
            r"training examples; this run has 448: resume with that training data to "
            r"finish the epoch, or resume=False$")):
        training.train_and_evaluate(
            training.TrainConfig(**settings), kdist.Dataset(x[:448], y[:448], x[480:],
                                                            y[480:], "toy"),
            model_fn=regularized_classifier)


def test_a_run_gives_back_tensorflows_random_stream(tmp_path, small_dataset):
    # Giving the caller's TensorFlow seed back restarted the stream its eager ops
    # draw their seeds from: the next tf.random draw repeated the first after the seed.
    tf = pytest.importorskip("tensorflow")

    def draws():
        return [float(tf.random.uniform(())) for _ in range(2)]

    tf.random.set_seed(1234)
    first = draws()
    expected = draws()
    tf.random.set_seed(1234)
    draws()
    run(config(tmp_path, "run", epochs=1, steps_per_epoch=1), small_dataset)
    assert draws() == expected != first


def test_a_run_gives_back_the_callers_random_state_and_distribution(tmp_path, small_dataset):
    """A run seeds the global random state with its seed (and on JAX sets its own
    distribution); a script drawing its next trial from NumPy finds it as `fit` leaves it,
    after a good run and after a failed one."""
    import random

    def draws():
        return np.random.uniform(), random.random(), keras.distribution.distribution()

    np.random.seed(123)
    random.seed(123)
    expected = draws()
    np.random.seed(123)
    random.seed(123)
    run(config(tmp_path, "good", epochs=1, steps_per_epoch=1), small_dataset)
    assert draws() == expected

    def failing_model():
        raise ValueError("a model that cannot be built")

    np.random.seed(123)
    random.seed(123)
    with pytest.raises(ValueError, match="cannot be built"):
        training.train_and_evaluate(config(tmp_path, "failed", epochs=1), small_dataset,
                                    model_fn=failing_model, log=lambda line: None)
    assert draws() == expected


def test_every_model_a_run_builds_draws_alike_and_evaluating_keeps_the_callers_draws(
        tmp_path):
    """A `model_fn` may draw state that is no variable, so no checkpoint holds it (a
    layer adapted on a random sample; here a fixed random projection). The restored
    evaluation's model drew another than the trained one (its figure was not the last
    epoch's)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(160, 4)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32)
    drawn = []

    class Projection(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.matrix = np.random.normal(size=(4, 8)).astype(np.float32)
            drawn.append(self.matrix)

        def call(self, inputs):
            return keras.ops.matmul(inputs, self.matrix)

    def projected():
        inputs = keras.Input((4,))
        hidden = keras.layers.Activation("relu")(Projection()(inputs))
        model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    data = kdist.Dataset(x[:128], y[:128], x[128:], y[128:])
    cfg = config(tmp_path, "run", epochs=1, steps_per_epoch=None)
    result = training.train_and_evaluate(cfg, data, model_fn=projected, log=lambda line: None)
    assert result.restored["test_loss"] == pytest.approx(result.history["val_loss"][-1],
                                                         rel=1e-6)
    np.random.seed(9)
    expected = np.random.uniform()
    np.random.seed(9)
    again = kdist.evaluate_checkpoint(result.restored["checkpoint"], data, projected,
                                      seed=cfg.seed)
    assert np.random.uniform() == expected  # The caller's draws, as before the call.
    assert again["test_loss"] == pytest.approx(result.restored["test_loss"], rel=1e-6)
    assert len(drawn) >= 3 and all(np.array_equal(m, drawn[0]) for m in drawn)


def test_a_layer_keras_cannot_compile_is_named_on_jax_and_trains_elsewhere(tmp_path):
    # On JAX: a 114-line traceback from RandomCrop's slicing with traced offsets.
    def cropping():
        inputs = keras.Input((10, 10, 1))
        cropped = keras.layers.RandomCrop(8, 8, seed=3)(inputs)
        pooled = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(4, 3)(cropped))
        model = keras.Model(inputs, keras.layers.Dense(2)(pooled))
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x = np.random.default_rng(0).normal(size=(64, 10, 10, 1)).astype(np.float32)
    data = kdist.Dataset(x, (x.mean(axis=(1, 2, 3)) > 0).astype(np.int32), x[:16],
                         np.zeros(16, np.int32))
    cfg = config(tmp_path, "run", epochs=1, steps_per_epoch=None)
    if keras.backend.backend() != "jax":
        result = training.train_and_evaluate(cfg, data, model_fn=cropping, log=lambda line: None)
        assert np.isfinite(result.history["loss"][0])
        return
    with pytest.raises(kdist.UsageError, match=r"could not be compiled by jax.jit \(IndexError: "
                       r".*\(supports_jit=False\): RandomCrop 'random_crop'\. kdist compiles"):
        training.train_and_evaluate(cfg, data, model_fn=cropping, log=lambda line: None)


def test_a_compute_loss_that_returns_the_loss_alone_is_one_usage_error(tmp_path,
                                                                       small_dataset):
    # Was each backend's "iteration over a 0-d array / tensor" from kdist's own code.
    with pytest.raises(kdist.UsageError, match=r"compute_loss returned one tensor; return "
                                               r"\(per-example losses, y_pred\)"):
        training.train_and_evaluate(
            config(tmp_path, "run"), small_dataset, log=lambda line: None,
            compute_loss=lambda model, x, y, training: keras.ops.mean(model(x)))
