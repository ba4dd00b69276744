"""kdist-bench's choices and records: --model, kdist alone (--no-fit, several
workers), and `kdist.bench.workers`'s runs and arithmetic."""

import argparse
import os
import sys

import numpy as np
import pytest
from conftest import REPO

from kdist.bench import choices, measure
from kdist.bench import command as bench_cli
from kdist.bench import workers as workerbench
from kdist.workers.processes import free_ports

MINE = dict(samples_per_sec=1000.4, first_epoch_seconds=2.345, eval_seconds=0.5,
            peak_rss_mb=900.2, epoch_seconds=[2.345, 1.0004, 0.9996], input_ratio=1.0)


def test_the_models_are_the_flags_choices():
    parser = argparse.ArgumentParser()
    bench_cli._add_bench_choices(parser)
    action = next(a for a in parser._actions if a.dest == "model")
    assert tuple(measure.MODELS) + ("dcgan",) == tuple(action.choices) == choices.MODELS
    assert action.default == "cnn"


def test_cnn_weights_has_the_cnns_gradients_each_a_whole_tensor():
    """Its gradient all-reduce moves the CNN's tensors (same shapes, same order), each
    whole: a weight's element (i, j) of its bilinear form moves image b's logits by
    pixel i times pixel j, so no two elements' gradients need be alike."""
    from keras.ops import convert_to_numpy

    from kdist.bench import weights_only
    from kdist.models.cnn import create_model

    model = weights_only.create_weights_only()
    images = np.random.default_rng(0).random((4, 28, 28, 1), np.float32)
    pixels = images.reshape(4, -1)
    scale = (np.arange(10) + 1) / 10
    before = convert_to_numpy(model(images))
    assert [tuple(w.shape) for w in model.trainable_weights] == [
        tuple(w.shape) for w in create_model().trainable_weights]
    for variable, index in [(model.trainable_weights[0], (0, 0, 0, 5)),
                            (model.trainable_weights[4], (1000, 20)),
                            (model.trainable_weights[-1], (9,))]:
        value = convert_to_numpy(variable).copy()
        value[index] += 1.0
        variable.assign(value)
        after = convert_to_numpy(model(images))
        row, column = divmod(int(np.ravel_multi_index(index, value.shape)), 784)
        moved = 1e-3 * pixels[:, row] * pixels[:, column]
        np.testing.assert_allclose(after - before, moved[:, None] * scale, rtol=2e-2,
                                   atol=1e-6)
        before = after


def test_resnet20_gets_its_own_data_and_the_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(measure, "run", lambda dataset, *args, **kwargs: calls.append(
        (dataset, args, kwargs)))
    assert bench_cli.main(["--model", "resnet20", "--no-fit", "--no-peak", "--steps", "2"]) == 0
    [(dataset, args, kwargs)] = calls
    assert dataset.train_x.shape[1:] == (32, 32, 3) and dataset.test_x.shape[1:] == (32, 32, 3)
    assert args[2] == 2  # --steps
    assert (kwargs["model"], kwargs["fit"], kwargs["measure_peak"]) == ("resnet20", False, False)


def test_without_fit_its_figures_are_none_and_the_table_shows_dashes():
    figures = measure._figures(MINE, None)
    assert figures["kdist_samples_per_sec"] == 1000 and figures["first_epoch_seconds"] == 2.35
    assert figures["fit_samples_per_sec"] is figures["ratio"] is figures["fit_eval_seconds"] \
        is figures["fit_epoch_seconds"] is None
    assert figures["epoch_seconds"] == [2.345, 1.0, 1.0]  # Every epoch's, in milliseconds.
    theirs = dict(MINE, samples_per_sec=500.0)
    paired = dict(MINE, fit_ratio=2.0012, fit_ratio_spread=[1.9, 2.1004])  # Epoch by epoch.
    figures = measure._figures(paired, theirs)
    assert figures["ratio"] == 2.001 and figures["ratio_spread"] == [1.9, 2.1]
    table = measure.format_table([("float32", MINE, None), ("mixed_bfloat16", paired, theirs)])
    alone, both = table.splitlines()[1:]
    assert alone.split() == ["float32", "1,000", "-", "-", "2.35", "-", "0.50", "-", "900"]
    assert both.split()[1:4] == ["1,000", "500", "2.00x"]


def test_core_groups_are_disjoint_and_equal_or_none():
    assert workerbench.core_groups({3, 1, 2, 0, 4}, 2) == [[0, 1], [2, 3]]
    assert workerbench.core_groups({5}, 2) is None


def _bench_line(rate, **more):
    return dict(model="cnn", backend="jax", precision="float32", workers=2, global_batch=16,
                cpu_model="x", cpu_cores=2, kdist_samples_per_sec=rate, **more)


def test_the_communication_share_compares_workers_with_the_same_work_alone():
    line = _bench_line
    [row] = workerbench.summarize([([line(1200)], [line(600)], [[line(500)], [line(300)]])],
                                  True)
    assert row["workers_vs_one_process"] == 0.5
    # Alone, the two processes train 800 samples/s; together 600: a quarter of the time
    # is communication.
    assert row["communication_share"] == 0.25
    assert row["alone_samples_per_sec"] == [[500, 300]] and row["pinned"] is True


def test_workers_against_one_process_is_the_median_of_each_rounds_own_ratio():
    line = _bench_line
    # The machine runs at half speed in round 2: each round's own ratio is 0.8, 0.8, 0.5.
    rounds = [([line(1000)], [line(800)], [[line(500)], [line(500)]]),
              ([line(500)], [line(400)], [[line(250)], [line(250)]]),
              ([line(1000)], [line(500)], [[line(500)], [line(500)]])]
    [row] = workerbench.summarize(rounds, False)
    assert row["workers_vs_one_process"] == 0.8  # A ratio of medians would give 0.5.
    assert row["workers_vs_one_process_spread"] == [0.5, 0.8]
    assert row["communication_share"] == 0.2 and row["rounds"] == 3
    assert row["one_process_samples_per_sec"] == [1000, 500, 1000]
    assert "0.80x [0.50-0.80]" in workerbench._line(row)


def test_rounds_take_the_arrangements_in_turn_and_pin_only_when_asked(monkeypatch):
    calls, pinning = [], False

    def run_benches(commands, timeout, sharing=False):
        calls.append(commands)
        assert sharing == (len(commands) == 2 and not pinning)
        return [[_bench_line(100)] for _ in commands]

    monkeypatch.setattr(workerbench, "run_benches", run_benches)
    monkeypatch.setattr(workerbench.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    runs, pinned = workerbench.measure(2, ["--synthetic"], 60, rounds=2)
    arrangement = ["one" if len(c) == 1 else "workers" if "--peers" in c[0] else "alone"
                   for c in calls]
    assert arrangement == ["one", "workers", "alone", "alone", "workers", "one"]
    assert len(runs) == 2 and not pinned
    assert all(c[3] == "" for commands in calls for c in commands)  # Not pinned.
    calls.clear()
    pinning = True
    runs, pinned = workerbench.measure(2, ["--synthetic"], 60, pin=True)
    assert pinned and [c[3] for c in calls[1]] == ["0,1", "2,3"]


def test_flags_the_runs_set_themselves_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        workerbench.main(["--", "--synthetic", "--replicas", "2"])
    assert exit_info.value.code == 2 and "set --replicas" in capsys.readouterr().err


def test_two_bench_workers_train_together_and_only_the_chief_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    pins = workerbench.core_groups(os.sched_getaffinity(0), 2) or [None, None]
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    # 6,000 examples, 64 per replica: the evaluations of the 1,000 test examples take few steps.
    common = ["--synthetic", "6000", "--batch-size-per-replica", "64", "--steps", "2",
              "--windows", "1", "--steps-per-execution", "2", "--no-peak"]
    commands = [workerbench._command(pins[i], common, "--replicas", "1", "--peers", peers,
                                     "--worker-index", str(i)) for i in range(2)]
    assert commands[0][:2] == [sys.executable, "-c"]
    chief, other = workerbench.run_benches(commands, timeout=240)
    assert other == []
    [line] = chief
    assert (line["workers"], line["replicas"], line["global_batch"]) == (2, 2, 128)
    assert line["fit_samples_per_sec"] is None and line["kdist_samples_per_sec"] > 0
    if pins[0] is not None:
        assert line["cpu_cores"] == len(pins[0])
    assert np.isfinite(line["eval_seconds"])


def test_input_kinds_compare_round_by_round_so_drift_cancels():
    # The machine slows down 2x after two rounds, and tf.data hits it a round early.
    seconds = {"numpy": [9.0, 1.0, 1.0, 2.0, 2.0, 2.0],
               "tfdata": [5.0, 1.1, 2.2, 2.2, 2.2, 2.2],
               "grain": [5.0, 0.5, 0.5, 1.0, 1.0, 1.0]}
    ratios = measure.paired_ratios(seconds)
    assert ratios["numpy"] == 1.0 and ratios["grain"] == pytest.approx(2.0)
    assert ratios["tfdata"] == pytest.approx(2.0 / 2.2)  # The median of its 5 rounds' ratios.
