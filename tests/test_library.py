"""The public API as the README shows it, and the plot script."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO


def readme_examples():
    """The Python blocks of the README's library section, in order, as one script."""
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Use it as a library", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))


def test_readme_library_examples_run_and_learn(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_examples())
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    accuracy, auc = re.search(r"restored test accuracy: ([\d.]+)%, AUC ([\d.]+)",
                              result.stdout).groups()
    assert float(accuracy) > 85.0 and float(auc) > 0.9
    assert re.search(r"Epoch 4/4, Loss: [\d.]+, Accuracy: [\d.]+%, auc: [\d.]+, Test Loss",
                     result.stdout)
    assert "Replicas: 2 " in result.stdout
    assert sorted(os.listdir(tmp_path / "mlp_checkpoints")) == [
        "ckpt-00000096.weights.h5", "ckpt-00000192.weights.h5"]
    own = float(re.search(r"own loss: test accuracy ([\d.]+)%", result.stdout).group(1))
    assert own > 85.0


def test_plot_script_writes_a_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [dict(epoch=e, train_loss=1.0 / e, test_loss=1.2 / e, train_accuracy=0.8 + e / 100,
                    test_accuracy=0.78 + e / 100, train_auc=0.9, test_auc=0.85, seconds=1.0,
                    samples_per_sec=1000.0)
               for e in (1, 2, 3)]
    records.append(dict(restored=True, test_accuracy=0.81))
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "curves.png"
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plot.py"),
                             str(metrics), "-o", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    from kdist.cli.plot import metric_names, read_epochs

    assert metric_names(read_epochs(str(metrics))) == ["loss", "accuracy", "auc"]
    # A run without test data (kdist.Inputs(train=...)): train curves, no error.
    metrics.write_text("".join(json.dumps({k: v for k, v in r.items() if "test" not in k})
                               + "\n" for r in records[:3]))
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plot.py"),
                             str(metrics), "-o", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert metric_names(read_epochs(str(metrics))) == ["loss", "accuracy", "auc"]


def plot_script(*args, cwd, env=None):
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plot.py"), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("output, written", [("noext", "noext.png"), ("x.png", "x.png"),
                                             ("out.", "out.png")])
def test_plot_script_prints_the_path_it_writes(tmp_path, output, written):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(dict(epoch=e, train_loss=1.0 / e)) + "\n"
                               for e in (1, 2)))
    result = plot_script(str(metrics), "-o", output, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == written + "\n"
    assert (tmp_path / written).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == sorted(["metrics.jsonl", written])


@pytest.mark.parametrize("args, message", [
    (["nofile.jsonl"], "nofile.jsonl: no such file"),
    (["metrics.jsonl", "-o", "."], "--output .: is a folder; pass a file path in a folder "
                                   "you can write"),
    (["metrics.jsonl", "-o", "out"], "--output out: is a folder; pass a file path in a folder "
                                     "you can write"),
])
def test_plot_script_refuses_a_missing_file_or_a_folder_before_matplotlib_loads(
        tmp_path, args, message):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(dict(epoch=1, train_loss=1.0)) + "\n")
    (tmp_path / "out").mkdir()
    stub = tmp_path / "stub" / "matplotlib"  # Imported instead of matplotlib: it must not be.
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise SystemExit('matplotlib was imported')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    result = plot_script(*args, cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if "error" in line] == [
        f"plot.py: error: {message}"], result.stderr
    assert result.stdout == ""
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "out", "stub"]


# Matplotlib's "Number of columns must be a positive integer, not 0" and Python's
# TypeError traceback were the last two.
@pytest.mark.parametrize("text, problem", [
    ('{"restored": true}\n', "metrics.jsonl has no epoch records; pass the file written by "
                             "kdist-train --metrics-file"),
    ('{"epoch": 1, "loss": 0.5}\n', "metrics.jsonl has epoch records but no train_ or test_ "
                                    "values to draw"),
    ('{"epoch": 1, "train_loss": 0.5}\n5\n', "metrics.jsonl:2: not a JSON object"),
])
def test_plot_script_rejects_a_file_without_curves_in_one_line(tmp_path, text, problem):
    (tmp_path / "metrics.jsonl").write_text(text)
    result = plot_script("metrics.jsonl", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"plot.py: error: {problem}") and len(
        result.stderr.splitlines()) == 1, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_plot_script_draws_a_metric_some_epochs_lack_with_gaps(tmp_path):
    # A callback's metric from epoch 2 on, blank lines: a KeyError traceback, "not JSON".
    records = [dict(epoch=1, train_loss=0.5, train_auc=0.7), {},
               dict(epoch=2, train_loss=0.4, test_loss=None, train_lr=0.1)]
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) if r else "" for r in records) + "\n\n")
    result = plot_script("metrics.jsonl", "-o", "c.png", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "c.png\n", result.stderr
    from kdist.cli.plot import metric_names, read_epochs

    assert metric_names(read_epochs(str(tmp_path / "metrics.jsonl"))) == ["loss", "auc", "lr"]
