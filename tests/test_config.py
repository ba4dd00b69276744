"""One source for settings and errors: flags from TrainConfig, one error base, one exit table."""

import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys

import keras
import pytest
from conftest import REPO

import kdist
from kdist import checkpoints, config, engines, errors
from kdist.bench import choices
from kdist.bench import command as bench_cli
from kdist.checkpoints import ckptfile, runlock
from kdist.cli import evaluate as evaluate_cli
from kdist.cli import flags
from kdist.cli import train as train_cli
from kdist.errors import DataError, UsageError
from kdist.loop import evaluation, reporting, training
from kdist.runtime import startup

# Nothing here depends on the backend (settings, flags and exit statuses): one session runs it.
pytestmark = pytest.mark.any_backend


def test_every_train_config_field_is_a_flag_with_the_same_default():
    args = train_cli.train_parser().parse_args([])
    for field in dataclasses.fields(kdist.TrainConfig):
        if field.name == "progress":  # Derived from --quiet and the terminal.
            assert field not in config.flag_fields()
            continue
        assert getattr(args, field.name) == field.default, field.name
    assert flags.config_from_args(args, progress=False) == kdist.TrainConfig()


def test_every_flag_field_has_help_and_shows_in_the_help(capsys):
    with pytest.raises(SystemExit):
        train_cli.main(["--help"])
    text = capsys.readouterr().out
    for field in config.flag_fields():
        assert field.metadata["help"] and config.flag_name(field) in text


def test_flags_parse_into_the_config():
    args = train_cli.train_parser().parse_args(
        ["--epochs", "3", "--no-resume", "--break-lock", "--seed", "0", "--learning-rate", "0.5"])
    cfg = flags.config_from_args(args, progress=True)
    assert (cfg.epochs, cfg.resume, cfg.break_lock, cfg.learning_rate, cfg.progress) == \
        (3, False, True, 0.5, True)


def test_optimizer_choices_and_other_defaults_come_from_one_place():
    # --optimizer's default is None (given with --model, it is an error) and means adam.
    action = next(a for a in train_cli.train_parser()._actions if a.dest == "optimizer")
    assert tuple(action.choices) == tuple(kdist.OPTIMIZERS) and action.default is None
    assert config.DEFAULT_OPTIMIZER == "adam" and "(default: adam)" in action.help
    assert training.OPTIMIZERS is kdist.OPTIMIZERS and training.adam is kdist.OPTIMIZERS["adam"]
    batch, spe = kdist.TrainConfig.batch_size_per_replica, kdist.TrainConfig.steps_per_execution
    # evaluate_checkpoint's batch: the run's, from the checkpoint; else the config's default.
    parameters = inspect.signature(evaluation.evaluate_checkpoint).parameters
    assert (parameters["batch_size"].default, parameters["steps_per_execution"].default) == (
        None, spe)
    assert evaluation._global_batch_of(os.devnull) == batch
    from kdist.bench import measure

    assert measure.run.__defaults__[1:] == (batch, None, choices.WINDOWS, spe, print)


def test_one_backend_registry_and_message(monkeypatch):
    assert engines.BACKENDS is startup.BACKENDS
    monkeypatch.setenv("KERAS_BACKEND", "numpy")
    with pytest.raises(errors.UsageError,
                       match="^KERAS_BACKEND=numpy is not supported; set it to one of: "
                             "tensorflow, jax, torch$"):
        startup.check_backend("numpy")


def test_a_backend_that_is_not_installed_is_one_line_before_keras_loads(monkeypatch, tmp_path):
    # The README's kdist-evaluate line, KERAS_BACKEND unset, in a venv of kdist[jax]
    # alone: Keras' default, tensorflow, failed to import in a 70-line traceback.
    monkeypatch.setenv("KERAS_BACKEND", keras.backend.backend())  # Installed: accepted.
    assert startup.check_backend(startup.selected_backend()) == keras.backend.backend()
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "tensorflow" else found(name, *rest))
    with pytest.raises(errors.UsageError, match=(
            r"^KERAS_BACKEND is unset, so Keras loads its default, tensorflow, which is not "
            r"installed: install 'kdist\[tensorflow\]', or set KERAS_BACKEND to the backend")):
        startup.check_backend(startup.selected_backend())
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    with pytest.raises(errors.UsageError, match="^KERAS_BACKEND=tensorflow, which is not "):
        startup.check_backend(startup.selected_backend())


ERRORS = [errors.UsageError, errors.DataError, errors.CheckpointError,
          errors.InvalidCheckpoint, errors.LockHeld, errors.MetricsError,
          errors.TrainingError, errors.WorkerLost, errors.Interrupted]


def test_every_kdist_error_is_a_kdist_error_and_keeps_its_names():
    for cls in ERRORS + [errors.NonFiniteWeights]:
        assert issubclass(cls, kdist.KdistError) and getattr(kdist, cls.__name__, cls) is cls
    assert issubclass(errors.UsageError, ValueError)  # `except ValueError` still catches it.
    same = [(startup.UsageError, UsageError, engines.UsageError, kdist.UsageError),
            (DataError, kdist.DataError), (checkpoints.CheckpointError, kdist.CheckpointError),
            (ckptfile.InvalidCheckpoint, kdist.InvalidCheckpoint),
            (ckptfile.NonFiniteWeights, errors.NonFiniteWeights),
            (runlock.LockHeld, kdist.LockHeld), (reporting.MetricsError, kdist.MetricsError),
            (training.TrainingError, kdist.TrainingError),
            (training.WorkerLost, kdist.WorkerLost), (training.Interrupted,
                                                             kdist.Interrupted)]
    for names in same:
        assert len(set(names)) == 1, names


@pytest.mark.parametrize("command, body", [(train_cli, "_train"), (evaluate_cli, "_evaluate"),
                                           (bench_cli, "_bench")])
@pytest.mark.parametrize("error, status, line", [
    (errors.UsageError("bad setting"), 2, ": error: bad setting"),
    (errors.Interrupted("SIGINT: stopped", "SIGINT"), 130, "interrupted: SIGINT: stopped"),
    (errors.Interrupted("another worker stopped"), 143, "interrupted: another worker stopped"),
    (errors.DataError("bad data"), 1, ": error: bad data"),
    (errors.CheckpointError("bad checkpoint"), 1, ": error: bad checkpoint"),
    (errors.LockHeld("held"), 1, ": error: held"),
    (errors.MetricsError("disk full"), 1, ": error: disk full"),
    (errors.TrainingError("nan"), 1, ": error: nan"),
    (errors.WorkerLost("lost the other workers"), 1, ": error: lost the other workers"),
])
def test_each_main_maps_each_error_to_its_exit_status(command, body, error, status, line,
                                                      monkeypatch, capsys):
    def fail(args):
        raise error

    monkeypatch.setattr(command, body, fail)
    try:
        code = command.main(["--synthetic"])
    except SystemExit as exit_:
        code = exit_.code
    assert code == status
    err = capsys.readouterr().err.splitlines()
    if line.startswith("interrupted"):
        assert err == [line]
    else:  # "PROG: error: ...", after the usage for a usage error.
        assert err[-1].endswith(line) and err[-1] != line[2:] and (status == 2 or len(err) == 1)


def test_the_config_errors_and_cli_modules_load_no_framework():
    code = ("import sys, kdist, kdist.cli.train, kdist.cli.evaluate, kdist.cli.launch, "
            "kdist.bench.command, kdist.config, kdist.errors; kdist.TrainConfig(); "
            "kdist.KdistError; kdist.cli.train.train_parser(); "
            "print(sorted(m for m in ('keras', 'tensorflow', 'jax', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env=dict(os.environ), check=True).stdout
    assert out.strip() == "[]"
