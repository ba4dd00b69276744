"""Two workers on 127.0.0.1 reading tf.data or a PyDataset train like one process.

Each worker feeds its half of every global batch (tf.data: every worker reads
the pipeline and keeps its slice; PyDataset: each reads only the batches
that hold its rows); with SGD the weights equal one process's with the same
global batch. tf.data needs TensorFlow (absent from the JAX test environment).
"""

import importlib.util
import os
import subprocess
import sys

import input_worker
import pytest
from conftest import REPO
from test_inputs import final_weights, max_difference
from test_multiworker import environment

from kdist.workers.processes import free_ports

# Nothing here depends on the backend (each worker's share of the input; the workers' join
# is tested per backend in test_multiworker.py): one session runs it.
pytestmark = pytest.mark.any_backend

WORKER = os.path.join(REPO, "tests", "input_worker.py")


def two_workers(tmp_path, kind, folder):
    """Runs the 2 workers to their end; returns the chief's output."""
    peers = ",".join(f"127.0.0.1:{port}" for port in free_ports(2))
    procs = [subprocess.Popen([sys.executable, WORKER, kind, folder, "8", peers, str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=environment(tmp_path))
             for i in (0, 1)]
    try:
        outs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out
    return outs[0]


@pytest.mark.parametrize("kind", ["tf.data", "PyDataset"])
def test_two_workers_train_like_one_process(tmp_path, kind):
    if kind == "tf.data" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tf.data needs TensorFlow, not installed here")
    out = two_workers(tmp_path, kind, str(tmp_path / "workers"))
    assert "Workers: 2; " in out and "Batch: 8 per replica, 16 global;" in out
    one = input_worker.train(kind, str(tmp_path / "one"), 16, replicas=1, log=lambda line: None)

    mine, theirs = final_weights(tmp_path, "workers"), final_weights(tmp_path, "one")
    worst = max_difference(mine, theirs)
    print(f"\n{kind}: max |2 workers - 1 process| = {worst:.3g}")
    assert worst <= 1e-5
    input_worker.train(kind, str(tmp_path / "half"), 8, replicas=1, log=lambda line: None)
    assert max_difference(mine, final_weights(tmp_path, "half")) > 1e-3  # The check has teeth.
    restored = one.restored
    assert f"Test Accuracy: {100 * restored['test_accuracy']:.2f}%" in out.splitlines()[-1]
