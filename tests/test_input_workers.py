"""Two workers on 127.0.0.1 reading tf.data, a PyDataset or a function told its shard
train like one process.

Each worker feeds its half of every global batch (tf.data: every worker reads
the pipeline and keeps its slice; PyDataset: each reads only the batches
that hold its rows; a function with a `shard` parameter: each reads its own
share); with SGD the weights equal one process's with the same global batch.
tf.data needs TensorFlow (absent from the JAX test environment).
"""

import importlib.util
import os
import re
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
    """Runs the 2 workers to their end; returns their outputs."""
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
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(outs)
    return outs


@pytest.mark.parametrize("kind", ["tf.data", "PyDataset"])
def test_two_workers_train_like_one_process(tmp_path, kind):
    if kind == "tf.data" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tf.data needs TensorFlow, not installed here")
    out = two_workers(tmp_path, kind, str(tmp_path / "workers"))[0]
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


def examples_read(output):
    return int(re.search(r"examples read: (\d+)", output)[1])


def test_a_function_told_its_shard_is_read_in_halves_and_trains_like_one_process(tmp_path):
    outs = two_workers(tmp_path, "own shares", str(tmp_path / "workers"))
    one = tmp_path / "one"
    input_worker.READ[0] = 0
    input_worker.train("own shares", str(one), 16, replicas=1, log=lambda line: None)
    whole = input_worker.READ[0]  # 2 epochs of 400 examples, and the sample's batch.
    reads = [examples_read(out) for out in outs]
    print(f"\nexamples read: one process {whole}, each of 2 workers {reads}")
    assert all(read <= 0.55 * whole for read in reads), (whole, reads)
    worst = max_difference(final_weights(tmp_path, "workers"), final_weights(tmp_path, "one"))
    assert worst <= 1e-5


def test_workers_whose_shares_differ_in_length_end_each_epoch_together(tmp_path):
    """Worker 1's share holds 2 global batches fewer: every epoch ends, on both, at
    its last step (23 of 25), and the run ends normally."""
    two_workers(tmp_path, "uneven shares", str(tmp_path / "workers"))
    assert sorted(os.listdir(tmp_path / "workers")) == ["ckpt-00000023.weights.h5",
                                                        "ckpt-00000046.weights.h5"]
