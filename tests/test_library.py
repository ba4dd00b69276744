"""The public API as the README shows it, and the plot script."""

import json
import os
import re
import subprocess
import sys

from conftest import REPO


def readme_example():
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Use it as a library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_library_example_runs_and_learns(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    accuracy = float(re.search(r"restored test accuracy: ([\d.]+)%", result.stdout).group(1))
    assert accuracy > 85.0
    assert "Replicas: 2 " in result.stdout
    assert sorted(os.listdir(tmp_path / "mlp_checkpoints")) == [
        "ckpt-00000096.weights.h5", "ckpt-00000192.weights.h5"]


def test_plot_script_writes_a_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [dict(epoch=e, train_loss=1.0 / e, test_loss=1.2 / e, train_accuracy=80 + e,
                    test_accuracy=78 + e, seconds=1.0, samples_per_sec=1000.0)
               for e in (1, 2, 3)]
    records.append(dict(restored=True, test_accuracy=81.0))
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "curves.png"
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plot.py"),
                             str(metrics), "-o", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_script_rejects_a_file_without_epochs(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"restored": True}) + "\n")
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plot.py"),
                             str(metrics)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "has no epoch records" in result.stderr
