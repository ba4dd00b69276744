"""Building a compiled model and its step on an engine, as the loop does, for tests."""

import json
import subprocess
import sys

import h5py
import keras
import numpy as np

from kdist.loop import building, training
from kdist.models.cnn import create_model

# Replicas for a test whose subject is not the replica count: torch holds one replica
# per process (its multi-replica cases are in tests/test_torch.py).
SEVERAL = 1 if keras.backend.backend() == "torch" else 2

# Two rows of the tutorial's data shapes: enough to build the compiled loss and metrics.
SAMPLE = (np.zeros((2, 28, 28, 1), np.float32), np.zeros(2, np.int32), None)


def prepare(engine, global_batch, model_fn=create_model, optimizer_fn=training.sgd,
            learning_rate=0.5, sample=SAMPLE, train=True, **kwargs):
    """(model, step), compiled by `engine`; plain SGD by default (see test_distribution)."""
    if not train:
        optimizer_fn = learning_rate = None
    model, step = building.prepare_model(engine, global_batch, sample, model_fn, optimizer_fn,
                                         learning_rate, train=train, **kwargs)
    engine.compile_steps(step)
    return model, step


def two_processes(code, *args):
    """Runs `python -c code *args INDEX` for INDEX 0 and 1 at once; asserts both exit
    0 and returns their outputs (stdout and stderr together)."""
    processes = [subprocess.Popen([sys.executable, "-c", code, *args, str(index)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for index in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output
    return outputs


def children(pid, mark):
    """The processes that `pid`'s main thread started whose command line holds `mark`."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        pids = [int(p) for p in f.read().split()]
    found = []
    for child in pids:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if mark.encode() in f.read():
                    found.append(child)
        except FileNotFoundError:
            pass
    return found


def edit_metadata(path, change):
    """Replaces checkpoint `path`'s kdist state by `change(state)`, as a hand edit or an
    older kdist would leave it (the checksum covers the weights alone); returns the
    state it had."""
    with h5py.File(path, "r+") as f:
        meta = json.loads(f.attrs["kdist"])
        f.attrs["kdist"] = json.dumps(change(dict(meta)))
    return meta
