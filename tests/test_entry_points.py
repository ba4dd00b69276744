"""The commands `pip install` puts on the PATH, and `python -m kdist`."""

import importlib.metadata
import os
import subprocess
import sys
import sysconfig

import pytest

# Nothing here depends on the backend (the installed commands): one session runs it.
pytestmark = pytest.mark.any_backend

COMMANDS = {
    "kdist-train": ("kdist.cli.train:main", "--checkpoint-dir"),
    "kdist-evaluate": ("kdist.cli.evaluate:main", "Restore the newest checkpoint"),
    "kdist-bench": ("kdist.bench.command:main", "--windows"),
    "kdist-launch": ("kdist.cli.launch:main", "--workers"),
    "kdist-plot": ("kdist.cli.plot:main", "metrics_file"),
}


def installed_commands():
    try:
        dist = importlib.metadata.distribution("kdist")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("kdist is not installed in this Python; run `pip install -e .`")
    return {e.name: e for e in dist.entry_points if e.group == "console_scripts"}


def test_pip_installs_every_command_pointing_at_its_function():
    commands = installed_commands()
    assert {name: e.value for name, e in commands.items()} == {
        name: target for name, (target, _) in COMMANDS.items()}, (
        "entry points differ from pyproject.toml; reinstall with `pip install -e .`")
    for entry in commands.values():
        assert callable(entry.load())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_installed_command_prints_its_help(command, tmp_path):
    path = os.path.join(sysconfig.get_path("scripts"), command)
    assert os.access(path, os.X_OK), f"{path} missing; run `pip install -e .`"
    # From another folder: the command does not depend on the working folder.
    result = subprocess.run([path, "--help"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {command} ") and COMMANDS[command][1] in result.stdout


def test_python_m_kdist_is_the_training_command(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kdist", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m kdist ")
    assert "--checkpoint-dir" in result.stdout

