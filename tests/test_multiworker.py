"""Several worker processes on 127.0.0.1, on the session's backend (KERAS_BACKEND).

Each worker is a real `scripts/train.py` process, started by `scripts/launch.py`
or by hand; every process and every wait has a timeout.
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
from conftest import REPO
from helpers import children
from test_training import checkpoint_arrays

from kdist import checkpoints
from kdist.workers.processes import free_ports

TRAIN = os.path.join(REPO, "scripts", "train.py")
LAUNCH = os.path.join(REPO, "scripts", "launch.py")
OWN_SCRIPT = os.path.join(REPO, "examples", "cluster", "train.py")  # A user's script.
# SGD: a wrongly combined gradient shows in the weights (Adam would normalise it away).
# 1,200 generated examples (200 test): 3 steps of 16 and a short evaluation.
COMMON = ["--synthetic", "1200", "--steps-per-epoch", "3", "--checkpoint-every", "1", "--seed",
          "5", "--optimizer", "sgd", "--learning-rate", "0.1", "--quiet"]


def environment(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path / "tmp"))
    env.pop("XLA_FLAGS", None)  # One device per process unless --replicas says otherwise.
    os.makedirs(env["TMPDIR"], exist_ok=True)
    return env


def run(tmp_path, *args):
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            timeout=240, env=environment(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def final_weights(folder, step):
    return checkpoint_arrays(os.path.join(folder, f"ckpt-{step:08d}.weights.h5"))


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max(float(np.abs(np.asarray(a[k], np.float64) - b[k]).max()) for k in a)


def test_two_workers_train_and_resume_like_one_process(tmp_path):
    workers = str(tmp_path / "workers")
    metrics = tmp_path / "metrics.jsonl"
    args = [*COMMON, "--batch-size-per-replica", "8", "--checkpoint-dir", workers,
            "--metrics-file", str(metrics)]
    first = run(tmp_path, LAUNCH, "--workers", "2", "--timeout", "200", "--",
                *args, "--epochs", "1")
    second = run(tmp_path, LAUNCH, "--workers", "2", "--timeout", "200", "--",
                 *args, "--epochs", "2")
    assert "[worker 0] Workers: 2; " in first
    assert "[worker 0] Batch: 8 per replica, 16 global;" in first
    assert ", resumed from ckpt-00000003.weights.h5" in second
    assert "[worker 1] Batch:" not in first  # Only the chief reports.
    for log in (first, second):  # Only the chief reports.
        assert "[worker 0] Epoch " in log and "[worker 1] Epoch " not in log
    # Chief only; the resumed run rewrote the file from its checkpoint: each epoch once.
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("epoch", "restored") for r in records] == [1, 2, "restored"]
    assert sorted(os.listdir(workers)) == ["ckpt-00000003.weights.h5",
                                           "ckpt-00000006.weights.h5"]
    assert not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("kdist-worker-")]

    # The reference: one process with 2 replicas (N replicas equal one device: test_distribution).
    two_replicas, reference = str(tmp_path / "r2"), tmp_path / "r2.jsonl"
    run(tmp_path, TRAIN, *COMMON, "--epochs", "2", "--batch-size-per-replica", "8",
        "--replicas", "2", "--checkpoint-dir", two_replicas, "--metrics-file", str(reference))
    # The statistics summed over workers (one packed collective) report what one process does.
    expected = [json.loads(line) for line in reference.read_text().splitlines()]
    for record, one in zip(records, expected):
        statistics = sorted(k for k in one if k.startswith(("train_", "test_")))
        assert statistics and statistics == sorted(
            k for k in record if k.startswith(("train_", "test_")))
        for key in statistics:
            assert record[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key

    mine = final_weights(workers, 6)
    to_replicas = max_difference(mine, final_weights(two_replicas, 6))
    print(f"\nmax |2 workers - 1 process x 2 replicas| = {to_replicas:.3g}")
    assert to_replicas <= 1e-5
    # The check has teeth: the second epoch's 3 steps moved the weights 100x more.
    assert max_difference(mine, final_weights(workers, 3)) > 1e-3


class Lines:
    """A process's output lines, read by a thread so every wait can time out."""

    def __init__(self, stream):
        self.queue = queue.Queue()
        self.seen = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream):
        for line in stream:
            self.queue.put(line)
        self.queue.put(None)  # The end of the stream.

    def rest(self, timeout=30):
        """Every line seen, once the stream has ended."""
        while True:
            line = self.queue.get(timeout=timeout)
            if line is None:
                return self.seen
            self.seen.append(line)

    def wait_for(self, text, timeout=120):
        while True:
            line = self.queue.get(timeout=timeout)  # queue.Empty fails the test.
            assert line is not None, "".join(self.seen)
            self.seen.append(line)
            if text in line:
                return line


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def launch_long_run(tmp_path, act, grace=60, own_script=False):
    """Starts 2 workers on a long run, calls act(launcher, worker pids) once the chief
    trains; returns (launcher exit status, its stdout lines, its stderr, worker pids).
    The workers run kdist-train, or with `own_script` examples/cluster/train.py."""
    command = ([OWN_SCRIPT, "--synthetic", "60000"] if own_script else ["--synthetic", "--quiet"])
    proc = subprocess.Popen(
        [sys.executable, LAUNCH, "--workers", "2", "--timeout", "200", "--grace", str(grace),
         "--", *command, "--epochs", "100", "--batch-size-per-replica", "8",
         "--checkpoint-dir", str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(tmp_path))
    try:
        lines = Lines(proc.stdout)
        pids = [int(lines.wait_for(f"kdist-launch: worker {i} pid").split()[4]) for i in (0, 1)]
        lines.wait_for("[worker 0] Checkpoints: ")
        act(proc, pids)
        err = proc.stderr.read()  # Ends when the launcher exits.
        status = proc.wait(timeout=60)
        return status, lines.rest(), err, pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def stop_steps(out):
    """{worker index: the step at which it says it stopped}, from the launcher's output."""
    found = {}
    for line in out:
        match = re.match(r"\[worker (\d)\] interrupted: .*stopped at epoch 1, step (\d+);", line)
        if match:
            found[int(match[1])] = int(match[2])
    return found


def assert_stopped_together(tmp_path, out, pids):
    """Every worker stopped after the same step and the chief saved it."""
    assert not [pid for pid in pids if alive(pid)]
    steps = stop_steps(out)
    assert sorted(steps) == [0, 1] and steps[0] == steps[1], "".join(out)
    # Worker 1 names the chief's folder, not the folder of its own it wrote into.
    (other,) = [line for line in out if line.startswith("[worker 1] interrupted: ")]
    assert f"saved worker 0's checkpoint in {tmp_path / 'ckpt'};" in other, other
    saved = os.listdir(tmp_path / "ckpt")
    assert len(saved) == 1
    meta = checkpoints.read_metadata(str(tmp_path / "ckpt" / saved[0]))
    assert (meta["epoch"], meta["step_in_epoch"]) == (0, steps[0])


# The launcher's supervision (a worker killed, a signal to the launcher, the launcher
# killed) is the same on every backend: one session runs it (any_backend). What each
# backend does itself, agreeing on the step to stop at, is test_sigterm_to_one_worker.
@pytest.mark.any_backend
def test_a_killed_worker_stops_the_launcher_and_every_worker(tmp_path):
    status, _, err, pids = launch_long_run(tmp_path, lambda proc, pids: os.kill(pids[1], 9))
    assert status == 128 + signal.SIGKILL
    assert err.startswith(f"kdist-launch: error: worker 1 exited with status {128 + 9}")
    assert not [pid for pid in pids if alive(pid)]


# The launcher forwards SIGHUP as SIGTERM; a script of your own stops as kdist-train does.
@pytest.mark.any_backend
@pytest.mark.parametrize("signum, own_script", [(signal.SIGTERM, False), (signal.SIGHUP, True)],
                         ids=["SIGTERM-kdist-train", "SIGHUP-your-script"])
def test_a_signal_to_the_launcher_checkpoints_and_stops_every_worker(tmp_path, signum,
                                                                     own_script):
    status, out, err, pids = launch_long_run(
        tmp_path, lambda proc, pids: proc.send_signal(signum), own_script=own_script)
    assert status == 130 and "kdist-launch: interrupted; stopped every worker" in err
    assert_stopped_together(tmp_path, out, pids)


# The chief (0) signalled: one session; another worker (1): every backend's own agreement.
@pytest.mark.parametrize("index", [pytest.param(0, marks=pytest.mark.any_backend), 1])
def test_sigterm_to_one_worker_stops_every_worker_at_the_same_step(tmp_path, index):
    status, out, err, pids = launch_long_run(
        tmp_path, lambda proc, pids: os.kill(pids[index], signal.SIGTERM))
    assert status == 128 + signal.SIGTERM, err
    assert err.startswith("kdist-launch: stopped on a signal (worker ")
    assert_stopped_together(tmp_path, out, pids)
    other = [line for line in out if line.startswith(f"[worker {1 - index}] interrupted: ")]
    assert other and "another worker was asked to stop" in other[0]


@pytest.mark.any_backend
def test_killing_the_launcher_stops_its_workers_after_a_checkpoint(tmp_path):
    def kill_launcher(proc, pids):
        proc.kill()
        deadline = time.monotonic() + 120
        while [pid for pid in pids if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)

    _, _, _, pids = launch_long_run(tmp_path, kill_launcher)
    assert not [pid for pid in pids if alive(pid)]
    assert os.listdir(tmp_path / "ckpt")  # They stopped on SIGTERM, not on SIGKILL.


def joining(pid):
    """Whether `pid` waits for its peers: it has started the watchdog of its join."""
    return bool(children(pid, "parent, deadline"))


# A launcher stops every worker when one fails at start-up; the others may be waiting for
# it in the join, in native code that runs no Python handler until the join returns.
@pytest.mark.skipif(keras.backend.backend() == "tensorflow",
                    reason="TensorFlow's join takes SIGTERM over in native code; the worker "
                    "ends at --connect-timeout (test_a_worker_without_peers_gives_up...)")
@pytest.mark.parametrize("index", [0, 1])
def test_sigterm_ends_a_worker_waiting_for_its_peers_at_once(tmp_path, index):
    ports = free_ports(2)
    worker = subprocess.Popen(
        [sys.executable, TRAIN, "--synthetic", "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--peers", ",".join(f"127.0.0.1:{p}" for p in ports), "--worker-index", str(index),
         "--connect-timeout", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(tmp_path))
    try:
        deadline = time.monotonic() + 90
        while not joining(worker.pid) and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert joining(worker.pid), worker.communicate(timeout=30)[0] if worker.poll() else ""
        time.sleep(1)  # Well inside the join.
        signalled = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        output = worker.communicate(timeout=60)[0]
        assert worker.returncode == -signal.SIGTERM, output
        assert time.monotonic() - signalled < 10, output
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)


@pytest.mark.parametrize("index", [0, 1])
def test_a_worker_without_peers_gives_up_with_a_clear_error(tmp_path, index):
    ports = free_ports(2)
    result = subprocess.run(
        [sys.executable, TRAIN, "--synthetic", "--checkpoint-dir", str(tmp_path),
         "--peers", ",".join(f"127.0.0.1:{p}" for p in ports), "--worker-index", str(index),
         "--connect-timeout", "3"],
        capture_output=True, text=True, timeout=120, env=environment(tmp_path))
    assert result.returncode == -signal.SIGKILL  # By the watchdog: TF ignores SIGTERM there.
    line = result.stderr.splitlines()[-1]
    assert line.startswith(f"error: worker {index} of 2 could not reach its peers (127.0.0.1:")
    assert "within 3 s" in line and line.endswith("or raise --connect-timeout"), line
