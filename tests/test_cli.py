"""scripts/train.py and scripts/evaluate.py as a user runs them."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO
from helpers import SEVERAL
from test_training import checkpoint_arrays

import kdist
from kdist.cli import train as train_cli

TRAIN = os.path.join(REPO, "scripts", "train.py")
EVALUATE = os.path.join(REPO, "scripts", "evaluate.py")
# 2,400 generated examples (400 test): room for 75 steps of 32, and a short evaluation.
SMALL = ["--synthetic", "2400", "--batch-size-per-replica", "16", "--replicas", "2",
         "--seed", "3"]


def script(path, *args, env=None, **kwargs):
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, path, *args], capture_output=True, text=True,
                          timeout=300, env=env, **kwargs)


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--epochs", "--batch-size-per-replica", "--learning-rate", "--replicas",
                 "--checkpoint-dir", "--checkpoint-every", "--keep", "--no-resume",
                 "--data-dir", "--seed", "--steps-per-epoch", "--synthetic",
                 "--metrics-file", "--quiet", "--verbose", "--steps-per-execution",
                 "--optimizer", "--peers", "--workers", "--worker-index", "--connect-timeout"):
        assert flag in text
    assert "learning rate of --optimizer" in text
    # A script's own model (examples/): the flags are its to read, not the CNN's.
    with pytest.raises(SystemExit):
        train_cli.main(["--help"], model_fn=lambda args: None)
    text = " ".join(capsys.readouterr().out.split())
    assert "learning rate of --optimizer" not in text and "applies to any" not in text
    assert text.count("for the script's model, which reads it from args if at all") == 2


@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "--epochs: must be greater than 0"),
    (["--batch-size-per-replica", "-4"], "--batch-size-per-replica: must be greater than 0"),
    (["--learning-rate", "0"], "--learning-rate: must be greater than 0"),
    (["--replicas", "two"], "--replicas: expected a whole number"),
    (["--synthetic", "0"], "--synthetic: must be greater than 0"),
])
def test_bad_flags_exit_2_with_the_reason(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_more_synthetic_examples_than_memory_holds_exit_2_with_the_reason(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(["--synthetic", str(10 ** 13), "--checkpoint-dir", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    # As argparse reports a bad flag: the usage, then one line with the reason.
    assert err.splitlines()[-1].endswith(
        "error: --synthetic 10,000,000,000,000: more examples than this machine's memory "
        "holds (Unable to allocate 72.8 TiB for an array with shape (10000000000000,) and "
        "data type int64)"), err
    assert "Traceback" not in err and not (tmp_path / "ck").exists()


def test_unknown_backend_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("KERAS_BACKEND", "numpy")
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(["--synthetic"])
    assert exit_.value.code == 2
    assert "KERAS_BACKEND=numpy is not supported" in capsys.readouterr().err


def test_incomplete_data_dir_names_missing_files(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(["--data-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "c")])
    assert exit_.value.code == 2
    assert "lacks train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz" in \
        capsys.readouterr().err


def test_more_replicas_than_devices_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(["--synthetic", "--replicas", "64", "--checkpoint-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--replicas 64 but" in capsys.readouterr().err


def test_sigterm_mid_training_checkpoints_and_resume_matches(tmp_path):
    common = SMALL + ["--epochs", "2", "--steps-per-epoch", "40", "--checkpoint-every", "1"]
    straight = script(TRAIN, *common, "--checkpoint-dir", str(tmp_path / "a"),
                      "--metrics-file", str(tmp_path / "a.jsonl"))
    assert straight.returncode == 0, straight.stderr
    assert straight.stderr == ""  # Framework start-up noise stays hidden.
    assert "\r" not in straight.stdout and "\u2501" not in straight.stdout  # No bar in a pipe.
    lines = straight.stdout.splitlines()
    assert lines[0].startswith("kdist ") and lines[1].startswith("Replicas: 2 ")
    assert lines[2].startswith("Batch: 16 per replica, 32 global; 40 steps per epoch")
    assert lines[3].startswith("Data: synthetic") and lines[4].endswith("starting fresh")
    assert lines[3].endswith("(2,400 train, 400 test examples)")  # --synthetic 2400.
    assert [line.split(",")[0] for line in lines if line.startswith("Epoch")] == \
        ["Epoch 1/2", "Epoch 2/2"]
    assert re.fullmatch(r"Restored \S+ckpt-00000080.weights.h5 without distribution: "
                        r"Test Loss: [\d.]+, Test Accuracy: [\d.]+%", lines[-1])

    folder = str(tmp_path / "b")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, TRAIN, *common, "--checkpoint-dir", folder],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    banner = [proc.stdout.readline() for _ in range(5)]
    assert banner[-1].startswith("Checkpoints: ")
    proc.send_signal(signal.SIGTERM)  # Signals are a stop request by now: the first chunk ends it.
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.startswith("interrupted: SIGTERM: stopped ") and err.count("\n") == 1
    assert os.listdir(folder)

    resumed = script(TRAIN, *common, "--checkpoint-dir", folder)
    assert resumed.returncode == 0, resumed.stderr
    assert ", resumed from ckpt-" in resumed.stdout.splitlines()[4]
    final_a = os.path.join(tmp_path, "a", "ckpt-00000080.weights.h5")
    final_b = os.path.join(folder, "ckpt-00000080.weights.h5")
    a, b = checkpoint_arrays(final_a), checkpoint_arrays(final_b)
    assert max(float(abs(a[k] - b[k]).max()) for k in a) <= 1e-6
    epoch2 = [line for line in straight.stdout.splitlines() if line.startswith("Epoch 2/2")]
    assert epoch2[0].split(" (")[0] in resumed.stdout  # Same metrics, timing aside.

    restored = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[-1])
    evaluated = script(EVALUATE, "--synthetic", "2400", "--checkpoint-dir", str(tmp_path / "a"))
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"Test Accuracy: {100 * restored['test_accuracy']:.2f}%" in evaluated.stdout


def test_evaluate_without_checkpoint_is_a_clear_error(tmp_path):
    result = script(EVALUATE, "--synthetic", "--checkpoint-dir", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.startswith("evaluate.py: error: no checkpoint in ")


EVALUATE_BEFORE_FRAMEWORKS = """
import sys
from kdist.cli.evaluate import main
try:
    sys.exit(main(sys.argv[1:]))
finally:  # Usage errors exit in `main`.
    print(sorted({"keras", "tensorflow", "jax", "torch"} & set(sys.modules)))
"""


@pytest.mark.any_backend
@pytest.mark.parametrize("args, status, line", [
    (["--synthetic", "--model", "nofile.py"], 2, "--model nofile.py: no such file"),
    (["--data-dir", "{tmp}/nodir"], 2, "--data-dir {tmp}/nodir is not a folder; point it at "
                                       "a folder with the four Fashion-MNIST .gz files"),
    (["--synthetic", "--checkpoint-dir", "{tmp}/afile"], 2,
     "--checkpoint-dir {tmp}/afile is a file, not a folder")])
def test_evaluate_refuses_wrong_paths_in_one_line_before_the_frameworks_load(
        tmp_path, args, status, line):
    """kdist-evaluate read its paths after loading the frameworks (6-24 s), and called
    a checkpoint folder that is a file one without checkpoints. (A folder without
    checkpoints is told after the model file has run: test_examples.py.)"""
    (tmp_path / "afile").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    if "--checkpoint-dir" not in args:
        args += ["--checkpoint-dir", str(tmp_path)]
    result = subprocess.run([sys.executable, "-c", EVALUATE_BEFORE_FRAMEWORKS, *args],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == status, result.stderr
    assert result.stderr.splitlines()[-1] == "kdist-evaluate: error: " + line.format(tmp=tmp_path)
    assert result.stdout == "[]\n"  # No framework loaded.


def other_model_checkpoint(folder):
    """A checkpoint of a model that is not the tutorial CNN, in `folder`; its path."""
    import keras

    from kdist import checkpoints

    other = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
    other.compile(optimizer="sgd", loss="mse")
    manager = checkpoints.CheckpointManager(str(folder))
    manager.prepare()
    return manager.save(other, 1, metadata=dict(epoch=1, history=[], backend="x", replicas=1,
                                                seed=0))


@pytest.mark.any_backend  # Which hint the command prints.
def test_evaluating_a_checkpoint_of_another_model_names_no_training_flag(tmp_path):
    path = other_model_checkpoint(tmp_path)
    result = script(EVALUATE, "--synthetic", "600", "--checkpoint-dir", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr == (f"evaluate.py: error: {path} was written for a different model: "
                             "its weight 0 has shape (784, 10), this model's "
                             "'fashion_cnn/conv2d/kernel' (3, 3, 1, 32); evaluate it with the "
                             "model it was trained with (--model)\n")
    flags = set(re.findall(r"--[a-z-]+", script(EVALUATE, "--help").stdout))
    assert set(re.findall(r"--[a-z-]+", result.stderr)) <= flags


@pytest.mark.any_backend  # Reporting, the same on every backend.
def test_progress_bar_shows_in_a_terminal_and_not_with_quiet(tmp_path):
    import pty

    def run_in_terminal(*extra):
        controller, terminal = pty.openpty()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, TRAIN, "--synthetic", "600", "--batch-size-per-replica", "16",
             "--epochs", "1", "--steps-per-epoch", "5", "--no-resume",
             "--checkpoint-dir", str(tmp_path), *extra],
            stdout=terminal, stderr=subprocess.PIPE, env=env)
        os.close(terminal)
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # The terminal closes when the process exits.
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=120) == 0
        os.close(controller)
        return b"".join(chunks).decode()

    shown = run_in_terminal()
    # The bar, in the epoch line's units and formats.
    assert "\u2501" in shown and re.search(
        r"\r5/5 \[\u2501+\] \d+s - Loss: \d\.\d{4}, Accuracy: \d+\.\d\d%, [\d,]+ samples/s",
        shown), shown
    quiet = run_in_terminal("--quiet")
    assert "\u2501" not in quiet and "Epoch 1/1" in quiet


def test_bench_runs_briefly_and_ends_with_its_json_lines():
    """One process measures each input kind (a repeated one once) and fit."""
    result = script(os.path.join(REPO, "scripts", "bench.py"), "--synthetic", "6000",
                    "--replicas", str(SEVERAL), "--batch-size-per-replica", "8", "--steps", "3",
                    "--windows", "2", "--input", "pydataset,numpy,pydataset")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert ", model cnn, " in lines[0] and lines[0].endswith("kdist input pydataset, numpy")
    assert lines[1].startswith("CPU ")  # The CPU's line.
    assert lines[2].split()[:4] == ["precision", "kdist", "samples/s", "fit"]
    # One row per --precision (float32 by default) and input kind.
    assert [line.split()[:2] for line in lines[3:5]] == [["float32", "pydataset"],
                                                         ["float32", "numpy"]]
    summaries = [json.loads(line) for line in lines[-2:]]
    assert [s["input"] for s in summaries] == ["pydataset", "numpy"]
    for summary in summaries:
        for key in ("backend", "replicas", "precision", "kdist_samples_per_sec",
                    "fit_samples_per_sec", "ratio", "first_epoch_seconds", "peak_rss_mb",
                    "cpu_model", "cpu_flags"):
            assert key in summary
        assert summary["replicas"] == SEVERAL and summary["kdist_samples_per_sec"] > 0
        assert (summary["model"], summary["workers"]) == ("cnn", 1)
        assert summary["cpu_cores"] == len(os.sched_getaffinity(0))
        assert summary["matmul_gflops_float32"] > 0 and summary["matmul_gflops_bfloat16"] > 0
        # kdist and fit take turns epoch by epoch: the ratio is the median of the steady
        # rounds' fit time / kdist time (the JSON rounds epochs to 1 ms), within its spread.
        pairs = list(zip(summary["fit_epoch_seconds"][1:], summary["epoch_seconds"][1:]))
        assert len(pairs) == 2 and summary["ratio_spread"][0] <= summary["ratio"] <= \
            summary["ratio_spread"][1]
        low = sum((f - 0.0005) / (k + 0.0005) for f, k in pairs) / 2  # The median of two.
        high = sum((f + 0.0005) / (k - 0.0005) for f, k in pairs) / 2
        assert low - 0.0005 <= summary["ratio"] <= high + 0.0005
        assert len(summary["load_average"]) == 3


def test_a_second_run_on_the_same_folder_is_refused(tmp_path):
    folder = str(tmp_path / "ckpt")
    # Long enough that the first run still trains when the second one starts.
    common = SMALL + ["--epochs", "1000", "--checkpoint-dir", folder]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = subprocess.Popen([sys.executable, TRAIN, *common], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        banner = [first.stdout.readline() for _ in range(5)]
        assert banner[-1].startswith("Checkpoints: "), banner
        second = script(TRAIN, *common)
        # The run's chief holds the lock: the command itself, or on torch its replica 0.
        holder = re.search(r"\(pid (\d+) on host ", second.stderr)
        with open(f"/proc/{holder.group(1)}/stat") as f:
            parent = int(f.read().split(") ")[1].split()[1])
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert second.returncode == 1
    assert second.stderr.startswith(f"train.py: error: checkpoint folder {folder} is in use "
                                    f"by another run (pid {holder.group(1)} on host ")
    assert first.pid in (int(holder.group(1)), parent)
    assert second.stderr.count("\n") == 1
    assert first.returncode == 128 + signal.SIGTERM
    assert "kdist.lock" not in os.listdir(folder)  # Released on the way out.


def test_full_disk_is_one_error_line_and_the_older_checkpoint_stays(small_tmpfs):
    folder = str(small_tmpfs / "ckpt")
    result = script(TRAIN, *SMALL, "--epochs", "2", "--steps-per-epoch", "2",
                    "--checkpoint-every", "1", "--checkpoint-dir", folder)
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"train.py: error: cannot write checkpoint in {folder}: " \
                            "No space left on device\n"
    assert os.listdir(folder) == ["ckpt-00000002.weights.h5"]


@pytest.mark.any_backend  # Which checkpoint is read; restoring one: test_checkpoints.py.
def test_a_damaged_newest_checkpoint_is_skipped_by_name(tmp_path):
    from test_checkpoints import damage_weights

    folder = str(tmp_path / "ckpt")
    common = SMALL + ["--steps-per-epoch", "3", "--checkpoint-every", "1",
                      "--checkpoint-dir", folder]
    assert script(TRAIN, *common, "--epochs", "2").returncode == 0
    damaged = os.path.join(folder, "ckpt-00000006.weights.h5")
    damage_weights(damaged)
    warning = (f"warning: skipping checkpoint {damaged}: its weights do not match its "
               "checksum (damaged file)\n")
    evaluated = script(EVALUATE, "--synthetic", "2400", "--checkpoint-dir", folder)
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.stderr == warning
    assert evaluated.stdout.startswith(os.path.join(folder, "ckpt-00000003.weights.h5: "))
    resumed = script(TRAIN, *common, "--epochs", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.startswith(warning)
    assert resumed.stdout.splitlines()[4].endswith(
        "resumed from ckpt-00000003.weights.h5 (end of epoch 1; written by "
        f"{os.environ['KERAS_BACKEND']} with 2 replica(s))")


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], "--seed: expected a whole number in 0..4294967295, got '-1'"),
    (["--seed", "4294967296"], "--seed: expected a whole number in 0..4294967295"),
    (["--learning-rate", "inf"], "--learning-rate: must be a finite number, got inf"),
    (["--connect-timeout", "nan"], "--connect-timeout: must be a finite number, got nan"),
    (["--learning-rate", "nan"], "--learning-rate: must be a finite number, got nan"),
    (["--epochs", "1e3"], "--epochs: expected a whole number, got '1e3'"),
    (["--checkpoint-every-steps", "0"], "--checkpoint-every-steps: must be greater than 0, got 0"),
    (["--checkpoint-every-minutes", "inf"],
     "--checkpoint-every-minutes: must be a finite number, got inf"),
    (["--worker-index", "-1", "--peers", "127.0.0.1:1,127.0.0.1:2"],
     "worker index -1 is not in 0..1"),
])
def test_out_of_range_flags_exit_2_with_one_line(tmp_path, args, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/kdist-train"])  # As the installed command.
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(args + ["--synthetic", "--epochs", "1", "--steps-per-epoch", "1",
                         "--checkpoint-dir", str(tmp_path / "ck")])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]  # argparse: usage, then the reason.
    assert last.startswith("kdist-train: error: ") and message in last
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("name, problem", [
    ("missing/m.jsonl", "which is not an existing folder"),
    ("folder", "is a folder"),
    ("out.csv", "must not end in .csv"),
])
def test_a_bad_metrics_file_exits_2_before_any_work(tmp_path, name, problem, capsys):
    (tmp_path / "folder").mkdir()
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(SMALL + ["--epochs", "1", "--steps-per-epoch", "2", "--metrics-file",
                          str(tmp_path / name), "--checkpoint-dir", str(tmp_path / "ck")])
    assert exit_.value.code == 2
    assert f"--metrics-file {tmp_path / name}: " in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()  # Stopped before the checkpoint folder was made.


def test_a_full_disk_under_the_metrics_file_is_one_line_after_the_checkpoint(
        tmp_path, monkeypatch, capsys):
    from kdist.loop import reporting

    # The run's rewrite at start would replace the link; the appends then hit the full disk.
    monkeypatch.setattr(reporting.MetricsWriter, "start", lambda self, history: None)
    os.symlink("/dev/full", tmp_path / "m.jsonl")
    # SEVERAL: on torch, replicas beyond one are processes, which the patch does not reach.
    small = ["--synthetic", "600", "--batch-size-per-replica", "16", "--replicas", str(SEVERAL)]
    code = train_cli.main(small + ["--epochs", "1", "--steps-per-epoch", "2", "--metrics-file",
                             str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert code == 1
    prog = train_cli.command_name("python -m kdist")  # As the command names itself here.
    assert err.startswith(f"{prog}: error: cannot write the metrics file {tmp_path / 'm.jsonl'} "
                          "(No space left on device)") and err.count("\n") == 1
    assert os.listdir(tmp_path / "ck") == ["ckpt-00000002.weights.h5"]


def test_bad_labels_in_a_data_dir_are_one_line(tmp_path):
    from test_data import make_dataset_dir, write_idx

    folder = make_dataset_dir(tmp_path / "fm", n_train=64, n_test=8)
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", np.array([1, 2, 12, 3, 4, 5, 6, 7]), 0x0801)
    result = script(TRAIN, "--data-dir", str(folder), "--batch-size-per-replica", "16",
                    "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ck"))
    assert result.returncode == 1
    assert result.stderr == (f"train.py: error: {folder}: test label 12 (example 2) is not a "
                             "class of the model, which has 10 (0..9); 1 labels are out of range\n")


def test_keras_json_chooses_the_backend_when_keras_backend_is_unset(tmp_path):
    backend = os.environ["KERAS_BACKEND"]
    (tmp_path / "keras.json").write_text(json.dumps({"backend": backend}))
    env = dict(os.environ, KERAS_HOME=str(tmp_path))
    del env["KERAS_BACKEND"]
    env.pop("XLA_FLAGS", None)  # The tests' 4 devices: --replicas 2 must ask for its own.
    result = script(TRAIN, *SMALL, "--epochs", "1", "--steps-per-epoch", "2",
                    "--checkpoint-dir", str(tmp_path / "ck"), env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f" on {backend} " in lines[0] and lines[1].startswith("Replicas: 2 ")


def _loaded(pid, names):
    """Whether process `pid` has mapped a shared library whose path holds one of `names`."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(name in line for line in f for name in names)
    except FileNotFoundError:  # It has exited.
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/PID/maps")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_starting_exits_with_one_line(tmp_path, sig):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, TRAIN, *SMALL, "--epochs", "1",
                             "--checkpoint-dir", str(tmp_path / "ck")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # Wait until it loads NumPy's or a framework's native code: Python's own
    # start-up is over, and the frameworks are loading (seconds), or later.
    deadline = time.monotonic() + 60
    while not _loaded(proc.pid, ("_multiarray_umath", "tensorflow", "jaxlib")):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert err.startswith(f"interrupted: {sig.name}: stopped ") and err.count("\n") == 1, err


@pytest.mark.parametrize("kind", ["numpy", "tfdata", "pydataset", "grain"])
def test_bench_feeds_each_input_kind_every_example(kind):
    needs = {"tfdata": "tensorflow", "grain": "grain"}.get(kind)
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"--input {kind} needs {needs}, not installed here")
    from kdist.bench import input_kinds

    dataset = kdist.synthetic_fashion_mnist(num_train=100, num_test=50)
    train = input_kinds.input_source(kind, dataset.split("train"), 32, "train")
    rows = {row.tobytes(): i for i, row in enumerate(dataset.train_x)}
    seen = [rows[row.tobytes()] for b in train.train(32, seed=0, epoch=0) for row in b[0]]
    assert len(seen) == len(set(seen)) == 96  # Distinct training examples.
    rows = {row.tobytes(): i for i, row in enumerate(dataset.test_x)}
    test = input_kinds.input_source(kind, dataset.split("test"), 32, "test").evaluate(32)
    assert sorted(rows[row.tobytes()] for b, _ in test for row in b[0]) == list(range(50))


@pytest.mark.any_backend  # Checked before any framework loads.
def test_a_bad_output_folder_or_no_tensorboard_package_exits_2_before_any_work(
        tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")

    def train(folder):
        with pytest.raises(SystemExit) as exit_:
            train_cli.main(["--synthetic", "600", "--tensorboard", folder,
                            "--checkpoint-dir", str(tmp_path / "ck")])
        assert exit_.value.code == 2
        assert not (tmp_path / "ck").exists()  # Stopped before the checkpoint folder was made.
        return capsys.readouterr().err.splitlines()[-1]

    assert train(str(tmp_path / "file" / "tb")).endswith(f"{tmp_path / 'file'} is a file, "
                                                           "not a folder")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert train(str(tmp_path / "tb")).endswith(
        "--tensorboard needs the tensorboard package: pip install 'kdist[tensorboard]'")
    with pytest.raises(SystemExit) as exit_:  # Was exit 1 after the frameworks loaded,
        # "checkpoint folder ... is not writable (File exists)".
        train_cli.main(["--synthetic", "600", "--checkpoint-dir", str(tmp_path / "file")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"--checkpoint-dir {tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a folder")

