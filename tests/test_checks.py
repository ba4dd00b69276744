"""Limits of a run's settings: bad values refused up front, oversized chunks capped."""

import numpy as np
import pytest
from test_training import config

from kdist import checkpoints
from kdist.loop import chunks, training
from kdist.loop.evaluation import evaluate_checkpoint
from kdist.runtime.startup import UsageError


@pytest.mark.parametrize("field, value, message", [
    ("seed", -1, "seed must be a whole number in 0..4294967295, got -1"),
    ("seed", 2**32, "seed must be a whole number in 0..4294967295, got 4294967296"),
    ("epochs", 0, "epochs must be a whole number greater than 0, got 0"),
    ("epochs", 2.0, "epochs must be a whole number greater than 0, got 2.0"),
    ("keep", 0, "keep must be a whole number greater than 0"),
    ("learning_rate", float("inf"), "learning_rate must be a finite number greater than 0"),
    ("steps_per_execution", 2.5, "steps_per_execution must be a whole number"),
    ("epochs", np.float32(2.0), r"epochs must be a whole number greater than 0, got "
                                r"np.float32\(2.0\)"),
    # Was Python's TypeError from os.path, naming no setting.
    ("checkpoint_dir", None, r"checkpoint_dir must be a path \(text or a pathlib.Path\), "
                             "got None"),
    ("metrics_file", "", "metrics_file must be a path"),
])
def test_train_config_refuses_values_out_of_range(tmp_path, field, value, message):
    with pytest.raises(UsageError, match=message):
        config(tmp_path, "ck", **{field: value})


@pytest.mark.any_backend
def test_train_config_takes_numpy_numbers_and_paths_as_pythons(tmp_path):
    # NumPy's whole numbers were refused: "must be a whole number greater than 0, got
    # np.int64(16)"; they reach the checkpoints' JSON as Python's.
    made = config(tmp_path, "ck", batch_size_per_replica=np.int64(16), epochs=np.int32(2),
                  learning_rate=np.float32(0.5), seed=np.uint32(7), checkpoint_dir=tmp_path)
    assert [(type(v), v) for v in (made.batch_size_per_replica, made.epochs,
                                   made.learning_rate, made.seed, made.checkpoint_dir)] == [
        (int, 16), (int, 2), (float, 0.5), (int, 7), (str, str(tmp_path))]


@pytest.mark.any_backend  # Refused before the model is built or the file read.
@pytest.mark.parametrize("arguments, message", [
    # With 0 steps per execution the evaluation had scored only the rows after the
    # last full batch, silently.
    (dict(steps_per_execution=0), "steps_per_execution must be a whole number greater than 0"),
    (dict(steps_per_execution=-1), "steps_per_execution must be a whole number greater than 0"),
    (dict(batch_size=0), "batch_size must be a whole number greater than 0, got 0"),
    (dict(batch_size=2.5), "batch_size must be a whole number greater than 0, got 2.5"),
    (dict(batch_size=True), "batch_size must be a whole number greater than 0, got True"),
    (dict(seed=-1), "seed must be a whole number in 0..4294967295, got -1"),
    (dict(path=None), "no checkpoint to evaluate: path is None .*latest_checkpoint"),
    (dict(model_fn=3), "model_fn must be a function that builds the model, got int"),
])
def test_evaluate_checkpoint_refuses_bad_arguments_before_any_work(tmp_path, small_dataset,
                                                                    arguments, message):
    def model_fn():
        raise AssertionError("the model was built before the arguments were checked")

    arguments = dict(dict(path=str(tmp_path / "missing.weights.h5"), model_fn=model_fn),
                     **arguments)
    with pytest.raises(UsageError, match=message):
        evaluate_checkpoint(dataset=small_dataset, **arguments)


def test_the_largest_seed_trains(tmp_path, small_dataset):
    cfg = config(tmp_path, "ck", epochs=1, steps_per_epoch=1, seed=2**32 - 1)
    result = training.train_and_evaluate(cfg, small_dataset, log=lambda line: None)
    assert len(result.epochs) == 1


@pytest.mark.any_backend  # The loop's chunking, the same for every engine.
def test_steps_per_execution_is_capped_at_the_epoch_and_the_eval_batches(
        tmp_path, small_dataset, monkeypatch):
    stacked = []
    original = chunks.stack_chunk
    monkeypatch.setattr(chunks, "stack_chunk",
                        lambda batches: stacked.append(len(batches)) or original(batches))
    lines = []
    cfg = config(tmp_path, "ck", epochs=1, steps_per_epoch=3, steps_per_execution=40)
    training.train_and_evaluate(cfg, small_dataset, log=lines.append)
    # 3 train steps, then 1,001 test examples in 31 batches of 32 (2 replicas x 16)
    # and a tail of 9, twice: the epoch's evaluation and the restored model's.
    assert stacked == [3, 31, 31]
    assert "; steps_per_execution=40 capped at 3, the steps of an epoch" in lines[0]


@pytest.mark.any_backend  # The loop's banner, the same for every engine.
@pytest.mark.parametrize("asked, note", [
    (100, "; steps_per_epoch=100 capped at 16, the full global batches of the data"),
    (16, None),  # Exactly what the data holds: nothing to say.
])
def test_steps_per_epoch_above_the_data_is_capped_with_a_note(tmp_path, small_dataset,
                                                              asked, note):
    lines = []
    cfg = config(tmp_path, "ck", epochs=1, steps_per_epoch=asked, steps_per_execution=16)
    training.train_and_evaluate(cfg, small_dataset, log=lines.append)
    # 512 training examples make 16 global batches of 32 (2 replicas x 16).
    saved = checkpoints.read_metadata(checkpoints.latest_checkpoint(cfg.checkpoint_dir))
    assert saved["step"] == 16
    batch_line = next(line for line in lines[0].splitlines() if line.startswith("Batch:"))
    assert "16 steps per epoch" in batch_line, batch_line
    assert (note in batch_line) if note else ("capped" not in batch_line), batch_line


@pytest.mark.any_backend
def test_evaluate_checkpoint_given_a_folder_names_latest_checkpoint(tmp_path, small_dataset):
    # Was "CheckpointError: checkpoint ...: IsADirectoryError: [Errno 21] Is a directory".
    with pytest.raises(UsageError, match=f"path {tmp_path} is a folder; pass a checkpoint file, "
                                         r"such as its newest: kdist.latest_checkpoint\("):
        evaluate_checkpoint(str(tmp_path), small_dataset)
