"""Checkpoints: portable, atomic, pruned, and never lost to a bad write."""

import os

import keras
import numpy as np
import pytest

from kdist import checkpoints, engines, training
from kdist.model import create_model


def trained_model(replicas=2, seed=0):
    """A distributed model compiled with a built Adam optimizer."""
    engine = engines.create_engine(replicas)
    keras.utils.set_random_seed(seed)
    model, optimizer = training.build(engine, create_model, training.adam, 1e-3)
    return engine, model


def save(manager, model, step):
    return manager.save(model, step, metadata=dict(epoch=step, history=[], backend="x",
                                                   replicas=2, seed=0))


def test_restore_without_distribution_gives_identical_predictions(tmp_path, batch):
    engine, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path))
    manager.prepare()
    path = save(manager, model, 1)
    expected = np.asarray(model(batch[0], training=False))

    plain = engines.create_engine(distributed=False)
    with plain.scope():
        fresh = create_model()
    checkpoints.restore(fresh, path)
    np.testing.assert_array_equal(np.asarray(fresh(batch[0], training=False)), expected)


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
    np.testing.assert_allclose(np.asarray(stock(batch[0])),
                               np.asarray(model(batch[0])), atol=1e-6)


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


def test_truncated_latest_falls_back_to_previous(tmp_path):
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path))
    manager.prepare()
    good = save(manager, model, 1)
    bad = save(manager, model, 2)
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    with pytest.warns(UserWarning, match="ckpt-00000002"):
        path, _ = manager.latest()
    assert path == good


def test_failed_rename_leaves_previous_checkpoints_valid(tmp_path, monkeypatch):
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path))
    manager.prepare()
    good = save(manager, model, 1)

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="No space"):
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


def test_unwritable_folder_fails_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    manager = checkpoints.CheckpointManager(str(blocker / "ckpts"))
    with pytest.raises(checkpoints.CheckpointError, match="not writable"):
        manager.prepare()


def test_starting_over_replaces_the_old_run_only_when_it_saves(tmp_path):
    _, model = trained_model()
    manager = checkpoints.CheckpointManager(str(tmp_path), keep=3)
    manager.prepare()
    for step in (100, 200):
        save(manager, model, step)
    save(manager, model, 50)  # A new run (--no-resume) writes its first checkpoint.
    assert [os.path.basename(p) for p in manager.paths()] == ["ckpt-00000050.weights.h5"]
