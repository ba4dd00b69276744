"""Checkpoints: portable, atomic, pruned, and never lost to a bad write."""

import dataclasses
import errno
import json
import os
import warnings

import h5py
import keras
import numpy as np
import pytest
from helpers import SEVERAL, edit_metadata

import kdist
from kdist import checkpoints, engines
from kdist.loop import building, training
from kdist.models.cnn import create_model


def trained_model(replicas=SEVERAL, seed=0):
    """A distributed model compiled with a built Adam optimizer."""
    engine = engines.create_engine(replicas)
    keras.utils.set_random_seed(seed)
    model, optimizer = building.build(engine, create_model, training.adam, 1e-3)
    return engine, model


def save(manager, model, step):
    return manager.save(model, step, metadata=dict(epoch=step, history=[], backend="x",
                                                   replicas=2, seed=0))


def test_restore_without_distribution_gives_identical_predictions(tmp_path, batch):
    engine, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path))
    manager.prepare()
    path = save(manager, model, 1)
    expected = keras.ops.convert_to_numpy(model(batch[0], training=False))

    plain = engines.create_engine(distributed=False)
    with plain.scope():
        fresh = create_model()
    checkpoints.restore(fresh, path)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(fresh(batch[0], training=False)), expected)


def test_checkpoint_loads_into_a_stock_keras_model(tmp_path, batch):
    engine, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path))
    manager.prepare()
    path = save(manager, model, 1)
    stock = keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    engines.create_engine(distributed=False)
    stock.load_weights(path)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(stock(batch[0])),
                               keras.ops.convert_to_numpy(model(batch[0])), atol=1e-6)


def test_keeps_the_newest_and_metadata_round_trips(tmp_path):
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path), keep=2)
    manager.prepare()
    for step in (10, 20, 30, 40):
        save(manager, model, step)
    names = [os.path.basename(p) for p in manager.paths()]
    assert names == ["ckpt-00000030.weights.h5", "ckpt-00000040.weights.h5"]
    path, meta = manager.latest()
    assert path.endswith("ckpt-00000040.weights.h5") and meta["step"] == 40


def saved_once(folder):
    """A model and a manager of `folder` holding its checkpoint 1: (model, manager, path)."""
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(folder))
    manager.prepare()
    return model, manager, save(manager, model, 1)


def two_checkpoints(tmp_path):
    """A manager of `tmp_path` holding checkpoints 1 and 2: (manager, path 1, path 2)."""
    model, manager, good = saved_once(tmp_path)
    return manager, good, save(manager, model, 2)


def test_truncated_latest_falls_back_to_previous(tmp_path):
    manager, good, bad = two_checkpoints(tmp_path)
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    with pytest.warns(UserWarning, match="ckpt-00000002"):
        path, _ = manager.latest()
    assert path == good


def test_failed_rename_leaves_previous_checkpoints_valid(tmp_path, monkeypatch):
    model, manager, good = saved_once(tmp_path)

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(checkpoints.CheckpointError,
                       match=f"^cannot write checkpoint in {tmp_path}: No space left on device$"):
        save(manager, model, 2)
    monkeypatch.undo()
    assert manager.paths() == [good]
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(good)]
    assert manager.latest()[0] == good


def test_leftover_temporary_files_are_removed_on_start(tmp_path):
    leftover = tmp_path / ".tmp-123-ckpt.weights.h5"
    leftover.write_bytes(b"half a checkpoint")
    checkpoints.CheckpointManager(str(tmp_path)).prepare()
    assert not leftover.exists()


def test_other_architecture_is_a_clear_error(tmp_path):
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path))
    manager.prepare()
    path = save(manager, model, 1)
    other = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
    with pytest.raises(checkpoints.CheckpointError, match="different model"):
        checkpoints.restore(other, path)


def test_another_optimizer_is_a_clear_error_before_loading(tmp_path):
    """Keras skips an optimizer state of another size with a warning: resuming
    Adam's checkpoint with SGD would train on with a fresh optimizer."""
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path))
    manager.prepare()
    path = save(manager, model, 1)
    engine = engines.create_engine(SEVERAL)
    sgd, _ = building.build(engine, create_model, keras.optimizers.SGD, 0.1)
    before = [keras.ops.convert_to_numpy(v) for v in sgd.weights]
    with pytest.raises(checkpoints.CheckpointError, match=(
            f"^{path} was written for a different model: its optimizer 'optimizer' was "
            "Adam, and this model's is SGD: the state of one is not the other's")):
        checkpoints.restore(sgd, path, hint="start over")
    with h5py.File(path, "a") as f:  # As written before the classes were recorded.
        del f.attrs["kdist_optimizer_classes"]
    with pytest.raises(checkpoints.CheckpointError, match=(
            f"^{path} was written for a different model: it holds 18 state variables of "
            r"optimizer 'optimizer', and this model's SGD has 2 \(a learning-rate schedule "
            r"in place of a constant rate or the reverse, use_ema turned on or off, another "
            r"optimizer, or other weights\); start over$")):
        checkpoints.restore(sgd, path, hint="start over")
    for value, variable in zip(before, sgd.weights):  # Nothing loaded.
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: the optimizer's state is skipped.
        checkpoints.restore(sgd, path, optimizers=False)  # To evaluate: the weights load.
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(sgd.weights[0]),
                                  keras.ops.convert_to_numpy(model.weights[0]))


def test_a_resume_with_another_optimizer_or_rate_is_refused_or_named(tmp_path):
    """SGD with momentum and Lion hold one slot per weight: Lion had taken SGD's
    momentum and its learning rate (30 times Lion's) as its own, silently."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = kdist.Dataset(x, x, x, x, "toy")
    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=SEVERAL,
                                  checkpoint_dir=str(tmp_path))

    def model_fn(optimizer):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        model.compile(optimizer=optimizer, loss="mse")
        return model

    kdist.train_and_evaluate(config, data, log=lambda line: None,
                             model_fn=lambda: model_fn(keras.optimizers.SGD(0.1, momentum=0.9)))
    with pytest.raises(checkpoints.CheckpointError, match=(
            r"ckpt-\d+.weights.h5 was written for a different model: its optimizer "
            r"'optimizer' was SGD, and this model's is Lion")):
        kdist.train_and_evaluate(dataclasses.replace(config, epochs=2), data,
                                 log=lambda line: None,
                                 model_fn=lambda: model_fn(keras.optimizers.Lion(0.003)))

    # The same optimizer compiled with another rate: the checkpoint's rate (what a
    # callback set) goes on, as BackupAndRestore restores it in fit, and the banner says so.
    lines = []
    result = kdist.train_and_evaluate(
        dataclasses.replace(config, epochs=2), data, log=lines.append,
        model_fn=lambda: model_fn(keras.optimizers.SGD(0.01, momentum=0.9)))
    assert "; learning rate 0.1 from the checkpoint, not the 0.01 compiled" in lines[0]
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(result.model.optimizer.learning_rate), 0.1)


def test_an_optimizer_held_under_a_private_name_too_resumes(tmp_path):
    """Keras writes an optimizer's state under the first of its names in the
    order its saving walks them, private names last (`optimizer`, then
    `_alias`): kdist looked for `_alias`, which holds nothing, and refused every
    resume of the unchanged script ("holds 0 state variables")."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = kdist.Dataset(x, x, x, x, "toy")
    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=1,
                                  checkpoint_dir=str(tmp_path))

    def model_fn(schedule=False):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        rate = keras.optimizers.schedules.ExponentialDecay(0.1, 4, 0.5) if schedule else 0.1
        model.compile(optimizer=keras.optimizers.SGD(rate, momentum=0.9), loss="mse")
        model._alias = model.optimizer
        return model

    kdist.train_and_evaluate(config, data, model_fn=model_fn, log=lambda line: None)
    result = kdist.train_and_evaluate(dataclasses.replace(config, epochs=2), data,
                                      model_fn=model_fn, log=lambda line: None)
    assert int(result.model.optimizer.iterations) == 8
    with pytest.raises(checkpoints.CheckpointError, match=(
            "holds 4 state variables of optimizer 'optimizer', and this model's SGD has 3 "
            r"\(a learning-rate schedule in place of a constant rate or the reverse")):
        kdist.train_and_evaluate(dataclasses.replace(config, epochs=3), data,
                                 model_fn=lambda: model_fn(schedule=True), log=lambda line: None)


def two_layers(first_trains):
    """Two Dense layers of the same shape, one of them frozen; SGD with momentum
    (one slot per trained weight: the same count whichever layer trains)."""
    first = keras.layers.Dense(4, trainable=first_trains)
    second = keras.layers.Dense(4, trainable=not first_trains)
    model = keras.Sequential([keras.Input((4,)), first, second])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def test_a_resume_whose_model_trains_other_weights_is_a_clear_error(tmp_path):
    """The momentum of the first layer's weights would land on the second's, silently
    (Keras loads the slots by position)."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = kdist.Dataset(x, x, x, x, "toy")
    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=SEVERAL,
                                  checkpoint_dir=str(tmp_path))
    kdist.train_and_evaluate(config, data, model_fn=lambda: two_layers(True),
                             log=lambda line: None)
    resumed = dataclasses.replace(config, epochs=2)
    kdist.train_and_evaluate(resumed, data, model_fn=lambda: two_layers(True),
                             log=lambda line: None)  # The same layer trains: it resumes.
    with pytest.raises(checkpoints.CheckpointError, match=(
            r"ckpt-\d+.weights.h5 was written for a different model: its optimizer "
            r"'optimizer' updated other weights than this model's does \(a layer's trainable "
            r"setting changed\?\)")):
        kdist.train_and_evaluate(dataclasses.replace(config, epochs=3), data,
                                 model_fn=lambda: two_layers(False), log=lambda line: None)
    newest = checkpoints.CheckpointManager(str(tmp_path)).paths()[-1]
    with h5py.File(newest, "a") as f:  # Edited by hand: its record is no longer JSON.
        f.attrs["kdist_optimized"] = "{'optimizer': [0, 1]"
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"ckpt-\d+.weights.h5 .*its record 'kdist_optimized' is not JSON"):
        kdist.train_and_evaluate(dataclasses.replace(config, epochs=3), data,
                                 model_fn=lambda: two_layers(True), log=lambda line: None)


def test_unwritable_folder_fails_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    manager = checkpoints.CheckpointManager(str(blocker / "ckpts"))
    with pytest.raises(checkpoints.CheckpointError,  # Was "is not writable (Not a directory)".
                       match=f"ckpts: {blocker} is a file, not a folder; pass --checkpoint-dir"):
        manager.prepare()


def test_starting_over_replaces_the_old_run_only_when_it_saves(tmp_path):
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path), keep=3)
    manager.prepare()
    for step in (100, 200):
        save(manager, model, step)
    save(manager, model, 50)  # A new run (--no-resume) writes its first checkpoint.
    assert [os.path.basename(p) for p in manager.paths()] == ["ckpt-00000050.weights.h5"]


def test_a_checkpoint_whose_step_names_an_older_one_takes_the_next_free_name(tmp_path):
    # After a resume with another global batch, epoch 4 at 9 steps an epoch is step
    # 36, the name epoch 2 had at 18: both stay, as --keep says.
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path), keep=3)
    manager.prepare()
    for epoch, step in ((1, 18), (2, 36), (3, 54), (4, 36)):
        manager.save(model, step, metadata=dict(epoch=epoch, history=[], seed=0))
    assert [(os.path.basename(p), checkpoints.read_metadata(p)["epoch"])
            for p in manager.paths()] == [("ckpt-00000036.weights.h5", 2),
                                          ("ckpt-00000054.weights.h5", 3),
                                          ("ckpt-00000055.weights.h5", 4)]


def test_failed_flush_is_one_clear_error_and_removes_the_temporary_file(tmp_path, monkeypatch):
    model, manager, good = saved_once(tmp_path)

    def full(fd):  # Where a full disk or a failing NFS server reports a lost write.
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(checkpoints.CheckpointError,
                       match=f"^cannot write checkpoint in {tmp_path}: No space left on device$"):
        save(manager, model, 2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(good)]
    assert manager.latest()[0] == good


def test_full_disk_is_one_clear_error_and_keeps_the_older_checkpoint(small_tmpfs):
    model, manager, good = saved_once(small_tmpfs / "ckpt")
    with pytest.raises(checkpoints.CheckpointError,
                       match=f"^cannot write checkpoint in {small_tmpfs}/ckpt: "
                             "No space left on device$"):
        save(manager, model, 2)
    assert os.listdir(small_tmpfs / "ckpt") == [os.path.basename(good)]
    assert manager.latest()[0] == good


def damage_weights(path, name="layers/dense/vars/0"):
    """Overwrites 16 bytes of dataset `name` in place with other finite values."""
    with h5py.File(path, "r") as f:
        offset = f[name].id.get_offset()
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.full(4, 0.5, np.float32).tobytes())
    assert os.path.getsize(path) == size


def test_damaged_weights_fail_the_checksum_and_fall_back(tmp_path):
    model, manager, good = saved_once(tmp_path)
    bad = save(manager, model, 2)
    damage_weights(bad)
    assert checkpoints.read_metadata(bad)["step"] == 2  # Its metadata still reads.
    with pytest.warns(checkpoints.CheckpointWarning, match="ckpt-00000002.*checksum"):
        path, meta = manager.latest()
    assert path == good and meta["step"] == 1
    with pytest.warns(checkpoints.CheckpointWarning, match="ckpt-00000002"):
        assert checkpoints.latest_checkpoint(str(tmp_path)) == good
    with pytest.raises(checkpoints.CheckpointError, match="ckpt-00000002.*checksum"):
        checkpoints.restore(model, bad)


def test_non_finite_weights_are_never_written(tmp_path):
    model, manager, good = saved_once(tmp_path)
    kernel = model.layers[-1].kernel
    kernel.assign(np.full(kernel.shape, np.nan, np.float32))
    with pytest.raises(checkpoints.CheckpointError,
                       match="refusing to write checkpoint .*ckpt-00000002.*non-finite values "
                             "in layers/dense_1/vars/0"):
        save(manager, model, 2)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(good)]


def test_non_finite_bfloat16_weights_are_never_written(tmp_path):
    """Keras stores bfloat16 as opaque 2-byte values: an infinity in them had been
    written and restored unseen."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, dtype="bfloat16")])
    model.compile(optimizer="sgd", loss="mse")
    manager = checkpoints.CheckpointManager(str(tmp_path))
    manager.prepare()
    save(manager, model, 1)  # Finite: written.
    kernel = model.layers[-1].kernel
    kernel.assign(np.array([[np.inf, 1.0], [0.5, -2.0], [1.0, 3.0]], np.float32))
    with pytest.raises(checkpoints.CheckpointError,
                       match="refusing to write checkpoint .*ckpt-00000002.*non-finite values "
                             "in layers/dense/vars/0"):
        save(manager, model, 2)


def write_format_1(model, path, step):
    """A checkpoint as kdist wrote them before checksums (format 1)."""
    model.save_weights(path)
    meta = dict(format="kdist-checkpoint-1", step=step, epoch=step, step_in_epoch=0,
                signature=checkpoints.model_signature(model))
    with h5py.File(path, "a") as f:
        f.attrs["kdist"] = json.dumps(meta)


def test_a_record_edited_to_another_type_skips_its_file_and_names_the_record(tmp_path):
    manager, good, edited = two_checkpoints(tmp_path)
    edit_metadata(edited, lambda meta: dict(meta, epoch="two"))
    with pytest.warns(checkpoints.CheckpointWarning,
                      match=r"skipping .*ckpt-00000002.*its metadata record 'epoch' is 'two'"):
        assert manager.latest()[0] == good


def test_format_1_checkpoints_load_unless_their_values_are_not_finite(tmp_path, batch):
    _, model = trained_model()
    old = str(tmp_path / "ckpt-00000001.weights.h5")
    write_format_1(model, old, 1)
    assert checkpoints.CheckpointManager(str(tmp_path)).latest()[0] == old
    fresh = trained_model(seed=1)[1]
    checkpoints.restore(fresh, old)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(fresh(batch[0])),
                                  keras.ops.convert_to_numpy(model(batch[0])))

    kernel = model.layers[-1].kernel
    kernel.assign(np.full(kernel.shape, np.inf, np.float32))
    write_format_1(model, str(tmp_path / "ckpt-00000002.weights.h5"), 2)
    with pytest.warns(checkpoints.CheckpointWarning, match="ckpt-00000002.*non-finite"):
        assert checkpoints.latest_checkpoint(str(tmp_path)) == old


def test_files_kdist_did_not_write_are_never_removed(tmp_path):
    _, model = trained_model()
    foreign = tmp_path / "ckpt-00000001.weights.h5"
    model.save_weights(str(foreign))  # A Keras weights file, without kdist's metadata.
    content = foreign.read_bytes()
    manager = checkpoints.CheckpointManager(str(tmp_path), keep=1)
    manager.prepare()
    with pytest.warns(checkpoints.CheckpointWarning,
                      match="leaving .*ckpt-00000001.weights.h5 in place: kdist cannot tell "
                            "it wrote it \\(it has no kdist metadata\\)"):
        save(manager, model, 2)
        save(manager, model, 3)
    assert foreign.read_bytes() == content
    assert [os.path.basename(p) for p in manager.paths()] == ["ckpt-00000003.weights.h5"]


def test_a_foreign_file_holding_the_needed_name_is_set_aside(tmp_path):
    _, model = trained_model()
    (tmp_path / "ckpt-00000002.weights.h5").write_bytes(b"someone's notes")
    manager = checkpoints.CheckpointManager(str(tmp_path))
    manager.prepare()
    with pytest.warns(checkpoints.CheckpointWarning, match="moved .*ckpt-00000002"):
        path = save(manager, model, 2)
    assert (tmp_path / "ckpt-00000002.weights.h5.set-aside-1").read_bytes() == \
        b"someone's notes"
    assert manager.latest()[0] == path


def test_only_kdist_temporary_files_are_removed_on_start(tmp_path):
    for name in (".tmp-notes.txt", ".tmp-123-ckpt.weights.h5", ".tmp-9-probe"):
        (tmp_path / name).write_text("x")
    checkpoints.CheckpointManager(str(tmp_path)).prepare()
    assert os.listdir(tmp_path) == [".tmp-notes.txt"]


def save_at(manager, model, step, epoch, step_in_epoch=0):
    return manager.save(model, step, metadata=dict(
        epoch=epoch, step_in_epoch=step_in_epoch, history=[], backend="x", replicas=2,
        seed=0))


def test_order_and_pruning_follow_training_progress_not_the_step_number(tmp_path):
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path), keep=3)
    manager.prepare()
    save_at(manager, model, 6, epoch=1)
    save_at(manager, model, 12, epoch=2)  # 6 steps per epoch...
    save_at(manager, model, 9, epoch=3)  # ...then 3: a lower global step, yet newer.
    names = [os.path.basename(p) for p in manager.paths()]
    assert names == ["ckpt-00000006.weights.h5", "ckpt-00000012.weights.h5",
                     "ckpt-00000009.weights.h5"]
    assert manager.latest()[1]["epoch"] == 3
    save_at(manager, model, 10, epoch=3, step_in_epoch=1)
    names = [os.path.basename(p) for p in manager.paths()]
    assert names == ["ckpt-00000012.weights.h5", "ckpt-00000009.weights.h5",
                     "ckpt-00000010.weights.h5"]


def test_an_unlistable_folder_is_a_clear_error(tmp_path, monkeypatch):
    def denied(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(os, "listdir", denied)
    with pytest.raises(checkpoints.CheckpointError,
                       match=f"cannot read checkpoint folder {tmp_path}: Permission denied"):
        checkpoints.latest_checkpoint(str(tmp_path))


KILLED_DURING_WRITE = """
import os, sys, time
import keras
from kdist.checkpoints import CheckpointManager, background
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(2048), keras.layers.Dense(4)])
model.compile(optimizer="adam", loss="mse")
model.optimizer.build(model.trainable_variables)
manager = CheckpointManager(sys.argv[1])
manager.prepare()
manager.save(model, 1, dict(epoch=1, history=[], backend="x", replicas=1, seed=0))
os.fsync = lambda fd: time.sleep(600)  # A slow disk: the write hangs before its rename.
model.layers[0].kernel.assign(model.layers[0].kernel + 1.0)
writer = background.BackgroundWriter(manager)
writer.save(model, 2, dict(epoch=2, history=[], backend="x", replicas=1, seed=0))
print("training on", flush=True)
time.sleep(600)
"""


def test_a_kill_during_a_background_write_leaves_the_older_checkpoint_valid(tmp_path):
    """The process is killed while its background thread writes checkpoint 2 (the
    bytes are in the temporary file, the rename is not done): checkpoint 1 stays
    the newest valid one, and the next run's start removes the temporary file."""
    import signal
    import subprocess
    import sys
    import time

    folder = tmp_path / "ckpt"
    child = subprocess.Popen([sys.executable, "-c", KILLED_DURING_WRITE, str(folder)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "training on\n"
        deadline = time.monotonic() + 60
        while not any(n.startswith(".tmp-") for n in os.listdir(folder)):
            assert time.monotonic() < deadline, "the background write never started"
            time.sleep(0.05)
        time.sleep(0.5)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert sorted(os.listdir(folder))[0].startswith(".tmp-")
    manager = checkpoints.CheckpointManager(str(folder))
    path, meta = manager.latest()
    assert os.path.basename(path) == "ckpt-00000001.weights.h5" and meta["epoch"] == 1
    manager.prepare()
    assert sorted(os.listdir(folder)) == ["ckpt-00000001.weights.h5"]


class Chdir(keras.callbacks.Callback):
    """Moves the process to `folder` after the first epoch."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            os.chdir(self.folder)


def test_a_relative_folder_stays_the_same_after_a_chdir_mid_run(tmp_path, monkeypatch):
    """A run given `ck` writes, prunes and restores `ck` of the folder it started
    in, whatever os.chdir a callback makes: it wrote into, and pruned, the new
    folder's `ck`, another run's checkpoints."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = kdist.Dataset(x, x, x, x, "toy")
    other = tmp_path / "elsewhere" / "ck"
    other.mkdir(parents=True)
    theirs = {}
    for step in (36, 48, 60):  # Another run's checkpoints, past this run's steps.
        name = f"ckpt-{step:08d}.weights.h5"
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        checkpoints.CheckpointManager(str(other)).save(
            model, step, dict(epoch=step // 4, history=[], backend="x", replicas=1, seed=0))
        theirs[name] = (other / name).read_bytes()
    monkeypatch.chdir(tmp_path)
    config = training.TrainConfig(epochs=3, batch_size_per_replica=16, replicas=1,
                                  checkpoint_dir="ck", keep=2, metrics_file="m.jsonl")

    def model_fn():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    result = kdist.train_and_evaluate(config, data, model_fn=model_fn, log=lambda line: None,
                                      callbacks=[Chdir(tmp_path / "elsewhere")])
    assert sorted(n for n in os.listdir(other)) == sorted(theirs)
    assert all((other / name).read_bytes() == held for name, held in theirs.items())
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-00000008.weights.h5",
                                                  "ckpt-00000012.weights.h5"]
    assert result.restored["checkpoint"] == str(tmp_path / "ck" / "ckpt-00000012.weights.h5")
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 4  # 3 epochs, restored.
    assert not (tmp_path / "elsewhere" / "m.jsonl").exists()


def test_a_lock_that_cannot_be_removed_leaves_the_runs_own_error(tmp_path, monkeypatch):
    """The folder turns read-only mid-run: the checkpoint's write fails, and so does
    the removal of the run's lock. The run ends in the write's CheckpointError,
    the lock's removal a warning; the removal's PermissionError replaced it."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = kdist.Dataset(x, x, x, x, "toy")
    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=1,
                                  checkpoint_dir=str(tmp_path))

    def model_fn():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    class ReadOnly(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            monkeypatch.setattr(os, "replace", read_only)
            monkeypatch.setattr(os, "remove", read_only)

    with pytest.warns(checkpoints.CheckpointWarning,
                      match=f"could not remove {tmp_path}/kdist.lock: Operation not permitted"), \
            pytest.raises(checkpoints.CheckpointError,
                          match=f"^cannot write checkpoint in {tmp_path}: Operation not permitted"):
        kdist.train_and_evaluate(config, data, model_fn=model_fn, log=lambda line: None,
                                 callbacks=[ReadOnly()])
    monkeypatch.undo()
    assert (tmp_path / "kdist.lock").exists()


class Wrapped(keras.Model):
    """A Dense(4) of 4 inputs inside a model of its own: a plain one's weight shapes."""

    def __init__(self):
        super().__init__()
        self.net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])

    def call(self, x):
        return self.net(x)


def test_a_checkpoint_of_other_layers_of_the_same_shapes_is_one_error(tmp_path):
    """kdist-evaluate of an own step's checkpoint with the tutorial CNN: a 38-line
    Keras traceback (`A total of 4 objects could not be loaded`)."""
    wrapped = Wrapped()
    wrapped(np.zeros((1, 4), np.float32))
    manager = checkpoints.CheckpointManager(str(tmp_path))
    path = save(manager, wrapped, 1)
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    with pytest.raises(checkpoints.CheckpointError,
                       match=f"^{path} was written for a different model: Keras cannot load "
                             "it \\(A total of 1 objects could not be loaded.* expected 2 "
                             "variables, but received 0"):
        checkpoints.restore(plain, path, optimizers=False)
