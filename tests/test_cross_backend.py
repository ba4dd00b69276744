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


def restore(backend, tmp_path, *folders):
    """{folder: what `backend` restores from its newest checkpoint} (predict_helper.py),
    every folder in one process."""
    outs = [tmp_path / f"{backend}-{i}.npz" for i in range(len(folders))]
    run(backend, HELPER, *[str(a) for pair in zip(folders, outs) for a in pair])
    return {folder: np.load(out) for folder, out in zip(folders, outs)}


def test_each_backends_checkpoint_restores_with_identical_predictions_on_the_others(tmp_path):
    folders = {writer: str(tmp_path / writer) for writer in BACKENDS}
    # With all three frameworks installed, also in torch's replica processes,
    # the frameworks' start-up notices stay hidden.
    logs = {writer: run(writer, TRAIN, *COMMON, "--epochs", "1", "--replicas", "2",
                        "--checkpoint-dir", folder, quiet=True)
            for writer, folder in folders.items()}
    restored = {reader: restore(reader, tmp_path, *folders.values()) for reader in BACKENDS}
    for writer, folder in folders.items():
        mine = restored[writer][folder]
        restored_line = logs[writer].splitlines()[-1]  # The writer's own restored accuracy...
        for other in BACKENDS:
            if other == writer:
                continue
            theirs = restored[other][folder]
            assert str(theirs["backend"]) == other
            assert np.abs(mine["logits"] - theirs["logits"]).max() <= 1e-5, (writer, other)
            assert int(theirs["iterations"]) == STEPS
            # Iteration count, learning rate and Adam moments, exactly as the writer holds them.
            np.testing.assert_array_equal(theirs["optimizer_state"], mine["optimizer_state"])
            # ...equals the one the evaluate command prints on the other.
            assert restored_line.split(": ")[-1] in str(theirs["evaluated"]), (writer, other)


# One run handed on epoch by epoch, each run resuming the one before: every pair of
# neighbours is a hand-over to another backend, and the seven cover every backend to
# every other one. The replica count changes with most: 1 -> 2 on JAX and torch
# (processes), 2 -> 1 on TensorFlow and JAX.
CHAIN = [("torch", "1"), ("jax", "2"), ("tensorflow", "1"), ("torch", "2"),
         ("tensorflow", "2"), ("jax", "1"), ("torch", "1")]


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
    after = restore(CHAIN[-1][0], tmp_path, folder)[folder]
    assert int(after["iterations"]) == len(CHAIN) * STEPS  # Every hand-over kept the count.


def test_each_example_step_trains_alike_on_every_backend_and_restores_on_the_others(tmp_path):
    """The steps of examples/, written once: one replica on each backend ends within 1e-4
    of the others (2 replicas equal one on each backend: test_examples.py), and the
    TensorFlow run's checkpoints evaluate alike everywhere."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from example_steps import assert_same

    runs = {}
    for backend in BACKENDS:
        lines = run(backend, EXAMPLE_STEPS, "train", str(tmp_path / backend), "1").splitlines()
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
