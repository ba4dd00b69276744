"""Metrics files: checked before training, each epoch once after a crash, clear write errors."""

import csv
import io
import json
import os
import re

import pytest
from test_training import config, run

from kdist import checkpoints, records
from kdist.loop import reporting
from kdist.runtime.startup import UsageError

# Nothing here depends on the backend (the metrics files and epoch lines): one session runs it.
pytestmark = pytest.mark.any_backend


def json_lines(path):
    return [json.loads(line) for line in open(path)]


def csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_resume_rewrites_the_metrics_files_from_the_checkpoint(tmp_path, small_dataset):
    metrics = tmp_path / "m.jsonl"
    cfg = config(tmp_path, "ck", epochs=3, checkpoint_every=2, metrics_file=str(metrics))
    first = run(cfg, small_dataset)
    # As if killed after epoch 3 was reported but before its checkpoint landed.
    manager = checkpoints.CheckpointManager(cfg.checkpoint_dir)
    os.remove(manager.paths()[-1])
    assert manager.latest()[1]["epoch"] == 2

    resumed = run(cfg, small_dataset)
    lines = json_lines(metrics)
    assert [line.get("epoch") for line in lines] == [1, 2, 3, None]
    assert lines[:2] == first.epochs[:2]  # Rewritten from the checkpoint's history.
    assert lines[2] == resumed.epochs[2] and lines[3]["restored"] is True
    rows = csv_rows(tmp_path / "m.csv")
    assert rows[0] == ["epoch", "samples_per_sec", "seconds", "skipped_steps", "test_accuracy",
                       "test_loss", "train_accuracy", "train_loss"]  # CSVLogger's layout.
    assert [row[0] for row in rows[1:]] == ["0", "1", "2"]


def test_a_fresh_run_starts_the_metrics_files_empty(tmp_path, small_dataset):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"epoch": 7}\n')
    (tmp_path / "m.csv").write_text("old,run\n")
    run(config(tmp_path, "ck", epochs=1, metrics_file=str(metrics)), small_dataset)
    run(config(tmp_path, "ck", epochs=1, metrics_file=str(metrics), resume=False),
        small_dataset)
    assert [line.get("epoch") for line in json_lines(metrics)] == [1, None]
    assert [row[0] for row in csv_rows(tmp_path / "m.csv")] == ["epoch", "0"]


@pytest.mark.parametrize("name, problem", [
    ("missing/m.jsonl", "which is not an existing folder"),
    ("folder", "is a folder"),
    ("m.csv", "must not end in .csv"),
    ("m.CSV", "must not end in .csv"),
])
def test_a_bad_metrics_path_stops_the_library_before_training(tmp_path, small_dataset,
                                                              name, problem):
    (tmp_path / "folder").mkdir()
    cfg = config(tmp_path, "ck", metrics_file=str(tmp_path / name))
    with pytest.raises(UsageError, match=problem):
        run(cfg, small_dataset)
    assert not checkpoints.CheckpointManager(cfg.checkpoint_dir).paths()


def test_the_csv_sibling_must_be_writable_too(tmp_path, small_dataset):
    (tmp_path / "m.csv").mkdir()
    with pytest.raises(UsageError, match="m.csv: is a folder"):
        run(config(tmp_path, "ck", metrics_file=str(tmp_path / "m.jsonl")), small_dataset)


def test_epoch_lines_show_every_metric_by_its_keras_name():
    record = records.EpochRecord(3, {"loss": 0.5, "accuracy": 0.8125, "auc": 0.91234},
                                 {"loss": 0.625, "accuracy": 0.75, "auc": 0.875}, 2.0, 512.0)
    assert reporting.format_epoch(record, 10) == (
        "Epoch 3/10, Loss: 0.5000, Accuracy: 81.25%, auc: 0.9123, Test Loss: 0.6250, "
        "Test Accuracy: 75.00%, Test auc: 0.8750 (2.0 s, 512 samples/s)")
    assert records.EpochRecord.from_dict(record.as_dict()) == record
    untested = records.EpochRecord(1, {"loss": 0.5}, {}, 2.0, 512.0)  # A step with no test step.
    assert reporting.format_epoch(untested, 2) == "Epoch 1/2, Loss: 0.5000 (2.0 s, 512 samples/s)"


def test_a_full_disk_is_one_metrics_error():
    if not os.path.exists("/dev/full"):
        pytest.fail("needs /dev/full (Linux) to fill a disk")
    writer = reporting.MetricsWriter("/dev/full")
    record = records.EpochRecord(1, {"loss": 1.0}, {"loss": 1.0}, 1.0, 1.0)
    with pytest.raises(reporting.MetricsError,
                       match="cannot write the metrics file /dev/full .No space left"):
        writer.epoch(record)


def test_the_progress_bar_reads_like_the_epoch_line():
    out = io.StringIO()
    bar = reporting.ProgressBar(10, first_step=2, stream=out)
    results = {"loss": 0.50771, "accuracy": 0.8184}
    bar.update(6, results, 8932.4)
    bar.update(10, results | {"loss": 0.5}, 12580.0)
    bar.close()
    first, last = out.getvalue().split("\r")[1:]
    assert re.fullmatch(r"6/10 \[\u2501{12} {8}\] \d+s, ETA \d+s - Loss: 0.5077, "
                        r"Accuracy: 81.84%, 8,932 samples/s", first), first
    assert re.fullmatch(r"10/10 \[\u2501{20}\] \d+s - Loss: 0.5000, Accuracy: 81.84%, "
                        r"12,580 samples/s *\n", last), last
    assert len(last) == len(first) + 1  # Blanks over the longer line, then the newline.
    bar.close()  # Once only.
    assert out.getvalue().count("\n") == 1


def test_the_banner_counts_one_epoch_in_the_singular():
    assert reporting._count(1, "epoch") == "1 epoch"
    assert reporting._count(10, "epoch") == "10 epochs"


@pytest.mark.any_backend  # The banner's words, the same for every engine.
def test_the_banner_says_a_stream_of_unknown_length_trains_at_most_the_steps_asked():
    assert reporting._steps_per_epoch(16, None) == "16 steps per epoch"
    assert reporting._steps_per_epoch(None, 5) == "at most 5 steps per epoch"
    assert reporting._steps_per_epoch(None, None) == "as many steps per epoch as the data holds"


def test_a_value_below_a_thousandth_is_written_as_keras_progress_bar_writes_it():
    """A loss of 3.2e-06 read "Loss: 0.0000" (Keras' Progbar: 3.2000e-06)."""
    line = reporting.format_results({"loss": 3.2e-6, "mae": 0.5, "accuracy": 0.5, "auc": 0.0})
    assert line == "Loss: 3.2000e-06, mae: 0.5000, Accuracy: 50.00%, auc: 0.0000"
    assert reporting.format_results({"test_loss": -2e-4}, "test_") == "Test Loss: -2.0000e-04"
