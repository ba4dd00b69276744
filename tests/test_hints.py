"""Hints fit their caller: a command's line names its flags, a library call its keywords."""

import dataclasses
import inspect
import json
import re
import sys

import keras
import pytest
from test_cli import other_model_checkpoint

import kdist
from kdist import hints
from kdist.cli import evaluate as evaluate_cli
from kdist.cli import launch as launch_cli
from kdist.cli import train as train_cli

FLAG = re.compile(r"(?<![\w/.=-])--[a-z][a-z0-9-]*(?![\w-])")
MAINS = {"train": train_cli.main, "evaluate": evaluate_cli.main, "launch": launch_cli.main}


def help_flags(main, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    return set(FLAG.findall(capsys.readouterr().out))


def prepare_folder(tmp_path, prepare):
    """What an error path needs in `tmp_path` before the call."""
    if prepare == "file":
        (tmp_path / "file").write_text("not a folder")
    elif prepare == "empty":
        (tmp_path / "empty").mkdir()
    elif prepare == "other model":
        other_model_checkpoint(tmp_path / "ck")
    elif prepare == "model file":
        (tmp_path / "mine.py").write_text("def model():\n    pass\n")
    elif prepare == "locked":  # Held by a run of another host: never stale.
        (tmp_path / "ck").mkdir()
        (tmp_path / "ck" / "kdist.lock").write_text(
            json.dumps(dict(pid=1, host="another-host", started=0)))


@pytest.mark.any_backend  # The messages are the same on every backend.
@pytest.mark.parametrize("command, args, prepare, named", [
    ("train", ["--data-dir", "{tmp}/none"], None, "--data-dir"),
    ("train", ["--checkpoint-dir", "{tmp}/file"], "file", "--checkpoint-dir"),
    ("train", ["--checkpoint-dir", "{tmp}/ck"], "other model", "--no-resume"),
    ("train", ["--checkpoint-dir", "{tmp}/ck"], "locked", "--break-lock"),
    ("train", ["--metrics-file", "{tmp}/none/m.jsonl"], None, "--metrics-file"),
    ("train", ["--model", "{tmp}/mine.py", "--learning-rate", "0.1"], "model file",
     "--learning-rate"),
    ("train", ["--model", "{tmp}/mine.py", "--optimizer", "sgd"], "model file", "--optimizer"),
    ("train", ["--model", "{tmp}/none.py"], None, "--model"),
    ("evaluate", ["--checkpoint-dir", "{tmp}/ck", "--data-dir", "{tmp}/none"], "other model",
     "--data-dir"),
    ("evaluate", ["--checkpoint-dir", "{tmp}/empty"], "empty", "--checkpoint-dir"),
    ("evaluate", ["--checkpoint-dir", "{tmp}/ck"], "other model", None),
    ("evaluate", ["--model", "{tmp}/none.py"], None, "--model"),
    ("launch", ["--workers", "0"], None, "--workers"),
    ("launch", ["--workers", "2", "--", "--synthetic", "240", "--peers", "h:1"], None,
     "--peers"),
    ("launch", ["--workers", "1", "--timeout", "0.5", "--", sys.executable, "-c",
                "import time; time.sleep(60)"], None, "--timeout"),
])
def test_every_hint_names_only_flags_of_its_command(tmp_path, capsys, command, args, prepare,
                                                   named):
    """Each error path's one line names flags that the printing command has, or that
    its caller typed (kdist-launch passes the flags after `--` to kdist-train)."""
    main = MAINS[command]
    prepare_folder(tmp_path, prepare)
    argv = [] if command == "launch" else ["--checkpoint-dir", str(tmp_path / "ckpt")] + (
        [] if "--data-dir" in args else ["--synthetic", "240"]) + (
        ["--epochs", "1", "--steps-per-epoch", "2"] if command == "train" else [])
    argv += [a.format(tmp=tmp_path) for a in args]
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code in (1, 2) and "error: " in line, line
    assert set(FLAG.findall(line)) <= help_flags(main, capsys) | set(argv), line
    assert named is None or named in FLAG.findall(line), line


def tiny_dataset():
    return kdist.synthetic_fashion_mnist(240, seed=1)


def call(function, tmp_path, **config):
    """`kdist.train_and_evaluate` with a small run's settings and `config`, or
    another public function; returns the kdist error and the lines logged."""
    lines = []
    settings = dict(epochs=1, steps_per_epoch=2, batch_size_per_replica=16,
                    checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(kdist.KdistError) as error:
        if function == "train":
            kdist.train_and_evaluate(kdist.TrainConfig(**{**settings, **config}),
                                     tiny_dataset(), log=lines.append)
        elif function == "evaluate":
            kdist.evaluate_checkpoint(other_model_checkpoint(tmp_path / "ck"), tiny_dataset())
        elif function == "load":
            kdist.load_fashion_mnist(data_dir=str(tmp_path / "none"))
        elif function == "connect":
            kdist.connect(peers="no-port")
    return str(error.value), lines


def keywords_of(function):
    """The keywords a script sets when calling `function` (train: the TrainConfig fields)."""
    target = {"train": kdist.TrainConfig, "evaluate": kdist.evaluate_checkpoint,
              "load": kdist.load_fashion_mnist, "connect": kdist.connect}[function]
    if dataclasses.is_dataclass(target):
        return {f.name for f in dataclasses.fields(target)}
    return set(inspect.signature(target).parameters)


@pytest.mark.any_backend
@pytest.mark.parametrize("function, config, prepare, named", [
    ("train", dict(checkpoint_dir="{tmp}/file"), "file", "checkpoint_dir"),
    ("train", dict(checkpoint_dir="{tmp}/ck"), "other model", "resume=False"),
    ("train", dict(checkpoint_dir="{tmp}/ck"), "locked", "break_lock=True"),
    ("train", dict(metrics_file="{tmp}/none/m.jsonl"), None, "metrics_file"),
    ("train", dict(batch_size_per_replica=4096), None, "batch_size_per_replica"),
    ("train", dict(learning_rate=1e30), None, "learning_rate"),
    ("evaluate", {}, None, None),
    ("load", {}, None, "data_dir"),
    ("connect", {}, None, "peers"),
])
def test_a_library_call_names_keywords_not_flags(tmp_path, function, config, prepare, named):
    """The same error paths called from a script: no flag, and the setting by its keyword."""
    prepare_folder(tmp_path, prepare)
    config = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v
              for k, v in config.items()}
    message, lines = call(function, tmp_path, **config)
    assert not FLAG.findall(message), message
    assert not any(FLAG.findall(line) for line in lines), lines
    if named is not None:
        assert named in message, message
        assert named.split("=")[0] in keywords_of(function)
    assert not hints.on_command_line()


@pytest.mark.any_backend
def test_a_library_run_logs_keywords_not_flags(tmp_path):
    lines = []
    settings = dict(epochs=1, steps_per_epoch=2, steps_per_execution=8,
                    batch_size_per_replica=16, checkpoint_dir=str(tmp_path))
    for resume in (True, False):
        kdist.train_and_evaluate(kdist.TrainConfig(**settings, resume=resume), tiny_dataset(),
                                 log=lines.append)
    text = "\n".join(lines)
    assert "steps_per_execution=8 capped at 2" in text and "(resume=False)" in text, text
    assert not FLAG.findall(text), text


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch's replica processes")
def test_replica_processes_name_settings_as_their_caller(tmp_path, capsys):
    """On torch the error comes from the replica processes, in the caller's terms."""
    other_model_checkpoint(tmp_path / "ck")
    code = train_cli.main(["--synthetic", "240", "--replicas", "2", "--epochs", "1",
                           "--checkpoint-dir", str(tmp_path / "ck")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and line.endswith("use another --checkpoint-dir, or --no-resume to "
                                       "start over"), line
    with pytest.raises(kdist.KdistError) as error:
        kdist.train_and_evaluate(kdist.TrainConfig(replicas=2, epochs=1,
                                                   checkpoint_dir=str(tmp_path / "ck")),
                                 tiny_dataset())
    assert str(error.value).endswith("use another checkpoint_dir, or resume=False to start "
                                     "over"), error.value


def test_flags_become_keywords_with_their_numbers():
    assert hints.in_library_terms(
        "--replicas 4 but 2 GPUs; pass --replicas 2 or fewer, or --no-resume; lower "
        "--batch-size-per-replica, use another --checkpoint-dir, XLA_FLAGS=--xla_cpu, "
        "/tmp/a--b") == (
        "replicas=4 but 2 GPUs; pass replicas=2 or fewer, or resume=False; lower "
        "batch_size_per_replica, use another checkpoint_dir, XLA_FLAGS=--xla_cpu, /tmp/a--b")
    assert hints.keyword("--break-lock") == "break_lock=True"
    with hints.command_line():
        assert hints.name("--connect-timeout") == "--connect-timeout"
    assert hints.name("--connect-timeout") == "kdist.connect's timeout"

