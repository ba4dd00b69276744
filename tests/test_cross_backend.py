"""Checkpoints cross backends and replica counts: TF, JAX, torch; N <-> 1 replicas.

Runs in the nox session with both backends (`tests(backend='both')`); each
side is a real `scripts/train.py` process on its own backend.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

pytestmark = pytest.mark.cross_backend

TRAIN = os.path.join(REPO, "scripts", "train.py")
HELPER = os.path.join(REPO, "tests", "predict_helper.py")
EXAMPLE_STEPS = os.path.join(REPO, "tests", "example_steps.py")
STEPS = 20
# 1,200 generated examples (200 test): 20 steps of up to 32 and a short evaluation.
COMMON = ["--synthetic", "1200", "--batch-size-per-replica", "16", "--steps-per-epoch",
          str(STEPS), "--checkpoint-every", "1", "--seed", "4", "--quiet"]
BACKENDS = ("tensorflow", "jax", "torch")


def run(backend, *args, quiet=False):
    """The stdout of `args` run on `backend`; `quiet`: its stderr must be empty."""
    env = dict(os.environ, KERAS_BACKEND=backend)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert not quiet or result.stderr == "", result.stderr
    return result.stdout


def predict(backend, checkpoint, out):
    run(backend, HELPER, checkpoint, str(out))
    return np.load(out)


def latest(folder):
    names = sorted(n for n in os.listdir(folder) if n.startswith("ckpt-"))
    return os.path.join(folder, names[-1])


@pytest.mark.parametrize("writer", BACKENDS)
def test_checkpoint_restores_with_identical_predictions_on_the_other_backends(tmp_path, writer):
    folder = str(tmp_path / "ckpt")
    # With all three frameworks installed, also in torch's replica processes,
    # the frameworks' start-up notices stay hidden.
    log = run(writer, TRAIN, *COMMON, "--epochs", "1", "--replicas", "2",
              "--checkpoint-dir", folder, quiet=True)
    mine = predict(writer, latest(folder), tmp_path / "mine.npz")
    restored_line = log.splitlines()[-1]  # The writer's own restored accuracy...
    for other in BACKENDS:
        if other == writer:
            continue
        theirs = predict(other, latest(folder), tmp_path / f"{other}.npz")
        assert str(theirs["backend"]) == other
        assert np.abs(mine["logits"] - theirs["logits"]).max() <= 1e-5, other
        assert int(theirs["iterations"]) == STEPS
        # Iteration count, learning rate and Adam moments, exactly as the writer holds them.
        np.testing.assert_array_equal(theirs["optimizer_state"], mine["optimizer_state"])
        evaluated = run(other, os.path.join(REPO, "scripts", "evaluate.py"),
                        "--synthetic", "1200", "--checkpoint-dir", folder)
        assert restored_line.split(": ")[-1] in evaluated, other  # ...equals the other's.


# One run handed on epoch by epoch, each run resuming the one before: every pair of
# neighbours is a hand-over. The nine cover every backend to every other one and a new
# replica count on each backend: 1 -> 2 on torch (processes) and JAX, 2 -> 1 on TensorFlow.
CHAIN = [("torch", "1"), ("torch", "2"), ("jax", "1"), ("jax", "2"), ("tensorflow", "2"),
         ("tensorflow", "1"), ("torch", "2"), ("tensorflow", "1"), ("jax", "1"),
         ("torch", "1")]


def test_training_resumes_on_another_backend_or_replica_count(tmp_path):
    folder = str(tmp_path / "ckpt")
    for epochs, (backend, replicas) in enumerate(CHAIN, start=1):
        log = run(backend, TRAIN, *COMMON, "--epochs", str(epochs), "--replicas", replicas,
                  "--checkpoint-dir", folder)
        if epochs > 1:
            note = next(line for line in log.splitlines() if line.startswith("Checkpoints: "))
            before, count = CHAIN[epochs - 2]
            assert ", resumed from ckpt-" in note, note
            assert f"written by {before} with {count} replica(s)" in note, note
    after = predict(CHAIN[-1][0], latest(folder), tmp_path / "after.npz")
    assert int(after["iterations"]) == len(CHAIN) * STEPS  # Every hand-over kept the count.


def test_each_example_step_trains_alike_on_every_backend_and_restores_on_the_others(tmp_path):
    """The steps of examples/, written once: 2 replicas on each backend end within 1e-4
    of each other, and the TensorFlow run's checkpoints evaluate alike everywhere."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from example_steps import assert_same

    runs = {}
    for backend in BACKENDS:
        lines = run(backend, EXAMPLE_STEPS, "train", str(tmp_path / backend), "2").splitlines()
        runs[backend] = {r["example"]: r for r in map(json.loads, lines[-5:])}
    written = runs["tensorflow"]
    for other in ("jax", "torch"):
        for example in written:
            assert_same(written[example]["path"], runs[other][example]["path"], 1e-4)
        pairs = [arg for example in written for arg in (example, written[example]["path"])]
        lines = run(other, EXAMPLE_STEPS, "evaluate", *pairs).splitlines()[-len(written):]
        for restored in map(json.loads, lines):  # One process restores every example.
            example = restored["example"]
            for key, value in restored.items():
                if key.startswith("test_"):
                    assert value == pytest.approx(written[example][key], rel=1e-4,
                                                  abs=1e-5), (example, other, key)
