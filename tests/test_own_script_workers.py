"""Your own script on several workers: examples/cluster/train.py, unchanged, as 2
processes on 127.0.0.1 under each launcher's environment, ends with the weights of
1 process with 2 replicas (to 1e-5; plain SGD, so a wrong scale shows).

The environments are those the clusters set: the backend's own (TF_CONFIG,
KERAS_DISTRIBUTION_*, torchrun itself), a SLURM job step's (as
examples/cluster/slurm.sbatch gets from srun) and the variables of
examples/cluster/job.yaml (a Kubernetes indexed Job; kdist-launch sets the same).
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import keras
import pytest
from conftest import REPO
from helpers import two_processes
from test_multiworker import environment, final_weights, max_difference

import kdist
from kdist.workers.processes import free_ports

SCRIPT = os.path.join(REPO, "examples", "cluster", "train.py")
MANIFEST = os.path.join(REPO, "examples", "cluster", "job.yaml")
ARGS = ["--synthetic", "1200", "--epochs", "1", "--steps-per-epoch", "3",
        "--batch-size-per-replica", "8", "--learning-rate", "0.1"]
BACKEND = keras.backend.backend()


def two_free_ports():
    """A free port p on 127.0.0.1 with p + 1 free too (a SLURM node's tasks count up)."""
    for port in free_ports(20):
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no two consecutive free ports")


def native(index, port):
    """The backend's own variables (torch: torchrun sets them, see `commands`)."""
    peers = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    if BACKEND == "tensorflow":
        return {"TF_CONFIG": json.dumps({"cluster": {"worker": peers},
                                         "task": {"type": "worker", "index": index}})}
    return {"KERAS_DISTRIBUTION_JOB_ADDRESSES": peers[0],
            "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": str(index)}


def slurm(index, port):
    """What srun sets in each task of a 2-task step on one node (slurm.sbatch's MASTER_PORT)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_PROCID": str(index), "SLURM_LOCALID": str(index),
            "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2",
            "MASTER_PORT": str(port)}


def kubernetes(index, port):
    """The manifest's variables, with this machine's addresses for the pods' names."""
    with open(MANIFEST) as f:
        names = re.findall(r"- name: (KDIST_\w+)", f.read())
    assert names == ["KDIST_PEERS", "KDIST_WORKER_INDEX"]
    return {"KDIST_PEERS": f"127.0.0.1:{port},127.0.0.1:{port + 1}",
            "KDIST_WORKER_INDEX": str(index)}


def commands(how, folder, port):
    """[(command, extra environment)] of the 2 workers."""
    args = [SCRIPT, *ARGS, "--checkpoint-dir", folder]
    if how == "native" and BACKEND == "torch":  # torchrun starts both.
        return [([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                  "--master-addr", "127.0.0.1", "--master-port", str(port), *args], {})]
    variables = {"native": native, "slurm": slurm, "kubernetes": kubernetes}[how]
    return [([sys.executable, *args], variables(index, port)) for index in (0, 1)]


def run_all(tmp_path, started):
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=dict(environment(tmp_path), **extra))
                 for command, extra in started]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=240)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    assert [p.returncode for p in processes] == [0] * len(processes), "\n".join(outputs)
    return "\n".join(outputs)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: the same script, one process with 2 replicas."""
    tmp_path = tmp_path_factory.mktemp("one-process")
    folder = str(tmp_path / "ckpt")
    run_all(tmp_path, [([sys.executable, SCRIPT, *ARGS, "--replicas", "2",
                         "--checkpoint-dir", folder], {})])
    return final_weights(folder, 3), folder


# Every launcher's variables become one `ClusterSpec` (test_cluster.py), and every spec
# joins an engine the same way: the other launchers run in the any-backend session only.
@pytest.mark.parametrize("how", ["native", *(pytest.param(how, marks=pytest.mark.any_backend)
                                             for how in ("slurm", "kubernetes"))])
def test_your_script_as_two_workers_equals_one_process_with_two_replicas(
        tmp_path, one_process, how):
    folder = str(tmp_path / "ckpt")
    out = run_all(tmp_path, commands(how, folder, two_free_ports()))
    assert "Workers: 2; this chief" in out and "Worker 0 of 2: test accuracy" in out
    assert os.listdir(folder) == ["ckpt-00000003.weights.h5"]  # The chief's alone.
    difference = max_difference(final_weights(folder, 3), one_process[0])
    print(f"\nmax |2 workers ({how}) - 1 process x 2 replicas| = {difference:.3g}")
    assert difference <= 1e-5


def test_workers_that_would_resume_from_other_steps_all_stop_with_one_line(
        tmp_path, one_process):
    """Checkpoint folders that are not one folder: worker 0 sees the reference run's
    checkpoint (step 3), worker 1 none. Each would train from its own step (TensorFlow
    and torch: weights 0.03-0.04 from the straight run; JAX: a hang); both stop before
    training, with the same line."""
    folders = [tmp_path / "seen", tmp_path / "empty"]
    shutil.copytree(one_process[1], folders[0])
    port = two_free_ports()
    processes = [subprocess.Popen(
        [sys.executable, SCRIPT, *ARGS, "--checkpoint-dir", str(folder)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(environment(tmp_path), **kubernetes(index, port)))
        for index, folder in enumerate(folders)]
    errors = [p.communicate(timeout=240)[1] for p in processes]
    assert [p.returncode for p in processes] == [1, 1], errors
    for error in errors:
        assert error.strip().splitlines()[-1].startswith(
            "error: the workers start with different resume steps (worker 0: 3, worker 1: "
            "none) (each worker resumes from the newest checkpoint it sees: give every "
            "worker one checkpoint folder, on a file system they share)"), error
    assert os.listdir(folders[0]) == ["ckpt-00000003.weights.h5"]  # Left as it was.


ACTIVATION_SCRIPT = """
import os, sys
import kdist
kdist.prepare_environment()
import keras
import numpy as np
kdist.connect()
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
def model():
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation=os.environ["ACT"]),
                          keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return m
config = kdist.TrainConfig(epochs=1, batch_size_per_replica=8, checkpoint_dir=sys.argv[1])
try:
    kdist.train_and_evaluate(config, kdist.Dataset(x, x[:, :1], x, x[:, :1], "toy"), model)
except kdist.KdistError as error:
    sys.exit(f"error: {error}")
"""


def test_workers_that_build_another_model_all_stop_with_one_line(tmp_path):
    """Worker 1's hidden layer is tanh, worker 0's relu: every backend trained on,
    without a word, a model that neither process builds (weights 0.08-0.14 from
    either; likewise another loss weight or precision). Both now stop before
    training, with the same line."""
    script, port = tmp_path / "act.py", two_free_ports()
    script.write_text(ACTIVATION_SCRIPT)
    processes = [subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt")], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env=dict(environment(tmp_path), ACT=activation, **kubernetes(index, port)))
        for index, activation in enumerate(("relu", "tanh"))]
    errors = [p.communicate(timeout=240)[1] for p in processes]
    assert [p.returncode for p in processes] == [1, 1], errors
    for error in errors:
        assert re.fullmatch(
            r"error: the workers start with different models \(checksums of their layers, "
            r"compiled loss and optimizers\) \(worker 0: \d+, worker 1: \d+\); start every "
            r"worker with the same script, flags and data", error.strip().splitlines()[-1]), error
    assert not os.listdir(tmp_path / "ckpt")


@pytest.mark.skipif(BACKEND != "torch", reason="torch's workers are one replica each")
def test_torch_workers_asked_for_replicas_each_are_refused(tmp_path):
    """2 workers, each with --replicas 2, trained 2 replicas in all (a global batch
    of 16 where JAX's 2 workers of 2 take 32), without a word."""
    port = two_free_ports()
    processes = [subprocess.Popen(
        [sys.executable, SCRIPT, *ARGS, "--replicas", "2", "--checkpoint-dir",
         str(tmp_path / "ckpt")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(environment(tmp_path), **kubernetes(index, port))) for index in (0, 1)]
    errors = [p.communicate(timeout=240)[1] for p in processes]
    assert [p.returncode != 0 for p in processes] == [True, True], errors
    for error in errors:
        assert error.strip().splitlines()[-1] == (
            "error: replicas=2: on torch each worker process is one replica; leave replicas "
            "out when starting the workers yourself (a machine then holds as many replicas "
            "as the launcher starts processes there)"), error


def test_connect_alone_does_nothing_and_says_so():
    alone = kdist.connect()
    assert (alone.num_workers, alone.worker_index, alone.is_chief) == (1, 0, True)


def test_a_kdist_error_in_your_script_is_one_line(tmp_path):
    """The example ends on kdist's errors (here: a checkpoint folder that is a file)
    as kdist's commands do: one line on stderr, exit status 1, no traceback."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    result = subprocess.run([sys.executable, SCRIPT, *ARGS, "--checkpoint-dir", str(taken)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert lines == [result.stderr.strip().splitlines()[-1]], result.stderr
    assert lines[0].startswith(f"error: checkpoint folder {taken}: {taken} is a file, not a "
                               "folder")  # Was "is not writable (File exists)".
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(BACKEND == "torch", reason="torch's process group may start at any time")
@pytest.mark.parametrize("processes_here", ["1", "2"])
def test_connect_after_the_framework_ran_is_one_clear_error(monkeypatch, processes_here):
    # This process ran TensorFlow or JAX already (conftest.py): too late to join. With
    # 2 processes on the machine (kdist-launch's), TensorFlow would size its thread
    # pools first, and said so in a traceback.
    monkeypatch.setenv("KDIST_LOCAL_PROCESSES", processes_here)
    with pytest.raises(kdist.UsageError, match="call kdist.connect\\(\\) first thing"):
        kdist.connect(peers=",".join(f"127.0.0.1:{p}" for p in free_ports(2)),
                      worker_index=0, timeout=30)


SIGTERM_AFTER_JOINING = """
import os, signal, sys, time
import kdist
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
kdist.connect(peers=sys.argv[1], worker_index=int(sys.argv[2]))
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(1)
print("SIGTERM reached the script's handler:", bool(got))
"""


def test_sigterm_reaches_the_script_after_joining():
    """TensorFlow's and JAX's preemption notifiers replace the SIGTERM handler in
    native code as the workers join; a stop asked in that moment was lost."""
    peers = ",".join(f"127.0.0.1:{port}" for port in free_ports(2))
    for output in two_processes(SIGTERM_AFTER_JOINING, peers):
        assert output.splitlines()[-1] == "SIGTERM reached the script's handler: True", output


def test_a_worker_that_dies_mid_run_ends_the_others_in_one_line(tmp_path):
    """Under a cluster's own launcher nobody stops the other workers: each one's next
    collective fails, and it ends as kdist's commands end, in one line (the
    framework's own error was a traceback)."""
    port, folder = two_free_ports(), str(tmp_path / "ckpt")
    args = [*ARGS[:2], "--epochs", "3", *ARGS[6:], "--checkpoint-dir", folder]
    errors = [open(tmp_path / f"stderr-{index}", "w+") for index in (0, 1)]
    chief, other = (subprocess.Popen(
        [sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=errors[index],
        text=True, env=dict(environment(tmp_path), **kubernetes(index, port)))
        for index in (0, 1))
    try:
        for line in chief.stdout:
            if line.startswith("Epoch 1/3"):
                other.kill()
                break
        chief.communicate(timeout=60)  # JAX: within its exit bound, not its 100 s heartbeat.
    finally:
        for process in (chief, other):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    errors[0].seek(0)
    error = errors[0].read()
    assert chief.returncode == 1, error
    lines = [line for line in error.splitlines() if line.startswith("error: ")]
    assert lines == [error.strip().splitlines()[-1]] and "Traceback" not in error, error
    assert lines[0].startswith("error: lost the other workers mid-run ("), error
    assert lines[0].endswith("another worker stopped or its machine went away (see its "
                             "output); the same command on every worker resumes from the "
                             f"newest checkpoint in {folder}"), error


LEAVING_SCRIPT = """
import os, sys
import kdist
kdist.prepare_environment()
import keras
import numpy as np
kdist.connect()
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
def model():
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return m
def train(folder, rows=64):
    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=8, checkpoint_dir=folder)
    # Callbacks on the chief alone, as Horovod's scripts give them.
    callbacks = [keras.callbacks.LambdaCallback()] if kdist.is_chief() else []
    data = kdist.Dataset(x, x[:rows, :1], x, x[:, :1], "toy")
    try:
        kdist.train_and_evaluate(config, data, model, callbacks=callbacks)
    except kdist.KdistError as error:
        sys.exit(f"error: {error}")
print("chief:", kdist.is_chief(), flush=True)
leaves = kdist.connect().worker_index == 1
if sys.argv[2] == "before" and leaves:
    sys.exit(0)
if sys.argv[2] == "second run":
    train(sys.argv[1] + "-first")
train(sys.argv[1], rows=63 if leaves else 64)  # Worker 1's labels: a row short.
"""


@pytest.mark.parametrize("when", ["before", "second run"])
def test_a_worker_that_leaves_before_a_run_ends_the_others_in_one_line(tmp_path, when):
    """Worker 1 leaves after joining, before its first run (`sys.exit(0)`), or its
    second run fails in its checks (a `DataError`), after a first run in which only
    the chief held callbacks. On JAX, worker 0 waited in the model's first
    collective and worker 1 at JAX's shutdown barrier: both aborted with C++ stack
    traces after 323 s (the second run: past 180 s). Worker 0 now ends within
    seconds, in one line. Each worker knows whether it is the chief."""
    script, port = tmp_path / "leave.py", two_free_ports()
    script.write_text(LEAVING_SCRIPT)
    processes = [subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt"), when], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=dict(environment(tmp_path), **kubernetes(
            index, port))) for index in (0, 1)]
    try:
        outputs, errors = zip(*(p.communicate(timeout=120) for p in processes))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    assert processes[0].returncode == 1, errors[0]
    lines = [line for line in errors[0].splitlines() if line.startswith("error: ")]
    assert lines == [errors[0].strip().splitlines()[-1]] and "Traceback" not in errors[0]
    assert lines[0].startswith("error: lost the other workers mid-run ("), errors[0]
    assert [re.findall(r"^chief: \w+$", output, re.M) for output in outputs] == [
        ["chief: True"], ["chief: False"]]
    if when == "second run":
        assert errors[1].strip().splitlines()[-1].startswith("error: toy: "), errors[1]
