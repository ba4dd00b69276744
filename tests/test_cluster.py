"""ClusterSpec from flags, KDIST_*, TF_CONFIG, KERAS_DISTRIBUTION_*, torchrun's and SLURM's
variables; the launcher's flags and commands."""

import json
import os
import sys

import pytest

from kdist.cli import launch
from kdist.cli import train as train_cli
from kdist.runtime.startup import UsageError
from kdist.workers import cluster, processes, slurm
from kdist.workers.processes import TRAIN, Worker, free_ports, worker_command

# Nothing here depends on the backend (which workers take part: flags and environment
# variables): one session runs it.
pytestmark = pytest.mark.any_backend


def spec(backend="tensorflow", environ=None, **flags):
    return cluster.from_flags_and_env(environ=environ or {}, backend=backend, **flags)


def test_no_settings_is_one_chief_worker():
    one = spec()
    assert (one.num_workers, one.worker_index, one.is_chief) == (1, 0, True)


def test_flags_name_every_worker():
    s = spec(peers="127.0.0.1:1000,127.0.0.1:1001", worker_index=1)
    assert (s.num_workers, s.worker_index, s.is_chief) == (2, 1, False)
    assert json.loads(s.tf_config()) == {
        "cluster": {"worker": ["127.0.0.1:1000", "127.0.0.1:1001"]},
        "task": {"type": "worker", "index": 1}}


def test_flags_win_over_the_environment():
    environ = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2", "c:3"]},
                                        "task": {"type": "worker", "index": 2}})}
    assert spec(environ=environ, peers="h:1,h:2", worker_index=0).num_workers == 2


def test_tf_config_with_a_chief_counts_it_as_worker_0():
    environ = {"TF_CONFIG": json.dumps({"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"]},
                                        "task": {"type": "worker", "index": 1}})}
    s = spec(environ=environ)
    assert (s.num_workers, s.worker_index, s.addresses[0]) == (3, 2, "c:1")


def test_jax_variables_need_only_the_coordinator():
    environ = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234",
               "KERAS_DISTRIBUTION_NUM_PROCESSES": "4", "KERAS_DISTRIBUTION_PROCESS_ID": "3"}
    s = spec("jax", environ)
    assert (s.num_workers, s.worker_index, s.coordinator) == (4, 3, "10.0.0.1:1234")
    assert spec("tensorflow", environ).num_workers == 1  # TF reads TF_CONFIG only.


@pytest.mark.parametrize("backend, environ, flags, message", [
    ("jax", {}, dict(peers="h:1,h:2", worker_index=2), "worker index 2 is not in 0..1"),
    ("jax", {}, dict(peers="h:1,h:2"), "which worker is this?"),
    ("jax", {}, dict(peers="h:1,h:2,h:3", workers=2), "2 workers but 3 addresses"),
    ("jax", {}, dict(peers="h:port", worker_index=0), "'h:port' is not host:port"),
    ("jax", {}, dict(workers=2, worker_index=0), "need the coordinator's host:port"),
    ("tensorflow", {}, dict(peers="h:1", workers=2, worker_index=0),
     "TensorFlow needs every worker's host:port"),
    ("tensorflow", {"TF_CONFIG": "{"}, {}, "TF_CONFIG is not valid"),
    ("tensorflow", {"TF_CONFIG": json.dumps({"cluster": {"ps": ["h:1"], "worker": ["h:2"]},
                                             "task": {"type": "ps", "index": 0}})}, {},
     "kdist runs only 'chief' and 'worker' tasks"),
    ("jax", {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "h:1",
             "KERAS_DISTRIBUTION_NUM_PROCESSES": "two"}, {}, "is not a whole number"),
])
def test_inconsistent_settings_are_usage_errors(backend, environ, flags, message):
    with pytest.raises(UsageError, match=message):
        spec(backend, environ, **flags)


def test_bad_peers_flag_exits_2_with_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/kdist-train"])  # As the installed command.
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(["--synthetic", "--peers", "127.0.0.1:1,127.0.0.1:2", "--worker-index", "5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "worker index 5 is not in 0..1" in err
    assert err.splitlines()[-1].startswith("kdist-train: error: ")


def test_help_documents_the_worker_flags_and_variables(capsys):
    with pytest.raises(SystemExit):
        train_cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for word in ("--peers", "--workers", "--worker-index", "--connect-timeout", "--optimizer",
                 "TF_CONFIG", "KERAS_DISTRIBUTION_JOB_ADDRESSES", "kdist-launch",
                 "KDIST_PEERS", "SLURM"):
        assert word in text


def test_launcher_refuses_cluster_flags_of_its_own(capsys):
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--workers", "2", "--", "--peers", "h:1,h:2"])
    assert exit_.value.code == 2
    assert "the launcher tells each worker its peers and index itself" in capsys.readouterr().err


def no_workers(monkeypatch):
    """Makes `kdist-launch` fail the test if it starts a worker."""
    def start(num_workers, args):
        raise AssertionError(f"started {num_workers} workers of {args}")

    monkeypatch.setattr(launch, "start", start)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/kdist-launch"])  # As the installed command.


@pytest.mark.parametrize("flags, message", [
    (["--timeout", "0"], "argument --timeout: must be greater than 0, got 0"),
    (["--timeout", "-1"], "argument --timeout: must be greater than 0, got -1"),
    (["--timeout", "nan"], "argument --timeout: must be a finite number, got nan"),
    (["--timeout", "inf"], "argument --timeout: must be a finite number, got inf"),
    (["--grace", "-5"], "argument --grace: must be 0 or more, got -5"),
    (["--grace", "nan"], "argument --grace: must be a finite number, got nan"),
    (["--grace", "inf"], "argument --grace: must be a finite number, got inf"),
])
def test_launcher_refuses_bad_bounds_before_any_worker_starts(capsys, monkeypatch, flags,
                                                               message):
    no_workers(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--workers", "1", *flags, "--", "--synthetic"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "error" in line] == [
        f"kdist-launch: error: {message}"], captured.err
    assert captured.out == ""


@pytest.mark.parametrize("command, problem", [
    (["nosuchcmd"], "nosuchcmd: command not found"),
    (["./nosuchcmd"], "./nosuchcmd: command not found"),
    ([sys.executable + ".d"], f"{sys.executable}.d: command not found"),
    (["./nothere.py"], "./nothere.py: no such file"),  # Both workers started and failed.
    ([sys.executable, "nothere.py"], "nothere.py: no such file"),
    (["python", "-u", "nothere.py"], "nothere.py: no such file")])
def test_launcher_refuses_a_command_not_found_before_any_worker_starts(capsys, monkeypatch,
                                                                       command, problem):
    no_workers(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--workers", "2", "--", *command, "--epochs", "1"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "error" in line] == [
        f"kdist-launch: error: {problem}"], captured.err
    assert captured.out == ""


@pytest.mark.parametrize("flags, problem", [
    (["--epochs", "0"], "argument --epochs: must be greater than 0, got 0"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag")])
def test_launcher_refuses_kdists_own_flags_once_before_any_worker_starts(capsys, monkeypatch,
                                                                          flags, problem):
    # Each worker printed its usage and error, then the launcher repeated them: 41 lines.
    no_workers(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--workers", "2", "--", "--synthetic", *flags])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "error" in line] == [
        f"kdist-launch ... --: error: {problem}"], captured.err
    assert captured.err.count("usage:") == 1 and captured.out == ""


def test_launcher_refuses_a_file_that_is_no_program(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/kdist-launch"])
    for mode in (0o644, 0o755):  # Not executable; executable without a #! line.
        program = tmp_path / f"program-{mode:o}"
        program.write_text("epochs = 1\n")
        program.chmod(mode)
        with pytest.raises(SystemExit) as exit_:
            launch.main(["--workers", "2", "--", str(program)])
        assert exit_.value.code == 2
        captured = capsys.readouterr()
        assert captured.err.splitlines()[-1].startswith(f"kdist-launch: error: {program}: ")
        assert "Traceback" not in captured.err and "pid" not in captured.out


def test_a_worker_that_cannot_start_stops_those_started(monkeypatch):
    started = []

    def worker(index, command, env):
        if index == 1:
            raise OSError(8, "Exec format error")
        started.append(Worker(index, command, env))
        return started[-1]

    monkeypatch.setattr(processes, "Worker", worker)
    with pytest.raises(OSError, match="Exec format error"):
        processes.start(2, [sys.executable, "-c", "import time; time.sleep(60)"])
    assert started and started[0].proc.poll() is not None


def test_free_ports_are_distinct():
    ports = free_ports(3)
    assert len(set(ports)) == 3


def test_kdist_variables_are_the_flags_and_come_before_the_backends_own():
    environ = {"KDIST_PEERS": "127.0.0.1:7,127.0.0.1:8", "KDIST_WORKER_INDEX": "1",
               "TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2", "c:3"]},
                                        "task": {"type": "worker", "index": 2}})}
    s = spec(environ=environ)
    assert (s.num_workers, s.worker_index, s.addresses) == (2, 1, ("127.0.0.1:7", "127.0.0.1:8"))
    assert spec(environ=environ, peers="h:1,h:2,h:3", worker_index=0).num_workers == 3
    with pytest.raises(UsageError, match="KDIST_PEERS/KDIST_WORKERS/KDIST_WORKER_INDEX: which"):
        spec(environ={"KDIST_PEERS": "h:1,h:2"})


SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
              "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]",
              "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_a_slurm_step_is_one_worker_per_task_on_every_backend(backend):
    s = spec(backend, dict(SLURM_STEP, MASTER_PORT="29500"))
    assert (s.num_workers, s.worker_index, s.source) == (4, 3, "SLURM (srun)")
    assert s.addresses == ("gpu07:29500", "gpu07:29501", "gpu08:29500", "gpu08:29501")
    # Without MASTER_PORT the port comes from the job id, so two jobs on a node differ.
    assert spec(backend, SLURM_STEP).coordinator == f"gpu07:{15000 + 4242}"


def test_the_backends_own_variables_come_before_slurms():
    environ = dict(SLURM_STEP, RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="9")
    assert spec("torch", environ).num_workers == 2  # `srun torchrun ...`: torchrun's.
    assert spec("jax", environ).num_workers == 4


def test_a_slurm_batch_script_outside_srun_is_one_worker():
    environ = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert spec("jax", dict(environ, SLURM_NTASKS="4")).num_workers == 1


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,7],gpu1", ["node01", "node02", "node03", "node7", "gpu1"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("localhost", ["localhost"]),
])
def test_slurm_host_lists_expand_as_scontrol_does(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


@pytest.mark.parametrize("environ, message", [
    (dict(SLURM_STEP, SLURM_STEP_NODELIST="gpu[07-x]"), "cannot read the range"),
    (dict(SLURM_STEP, SLURM_STEP_TASKS_PER_NODE="2,x"), "is not like '2\\(x3\\),1'"),
    (dict(SLURM_STEP, SLURM_STEP_TASKS_PER_NODE="3(x2)"), "4 tasks but"),
])
def test_unreadable_slurm_variables_are_usage_errors(environ, message):
    with pytest.raises(UsageError, match=message):
        spec("jax", environ)


def test_tensorflow_needs_srun_to_lay_tasks_out_node_by_node():
    environ = dict(SLURM_STEP, SLURM_DISTRIBUTION="cyclic")
    assert spec("jax", environ).coordinator == f"gpu07:{15000 + 4242}"
    with pytest.raises(UsageError, match="every worker's host:port.*--distribution=block"):
        spec("tensorflow", environ)


@pytest.mark.parametrize("args, command", [
    (["--epochs", "1"], [*TRAIN, "--epochs", "1"]),
    (["my_train.py", "--epochs", "1"], [sys.executable, "my_train.py", "--epochs", "1"]),
    # `python` ran PATH's, which may lack kdist (a venv not activated).
    (["python", "my_train.py"], [sys.executable, "my_train.py"]),
    (["python3", "-u", "my_train.py"], [sys.executable, "-u", "my_train.py"]),
    (["python3.11", "my_train.py"], ["python3.11", "my_train.py"]),
])
def test_the_launcher_runs_kdist_train_a_script_or_a_command(args, command):
    assert worker_command(args) == command


LOCAL_COUNTS = ("KDIST_LOCAL_PROCESSES", "LOCAL_WORLD_SIZE")


@pytest.mark.parametrize("environ, count", [
    ({}, 1), ({"LOCAL_WORLD_SIZE": "2"}, 2),
    ({"KDIST_LOCAL_PROCESSES": "3", "LOCAL_WORLD_SIZE": "2"}, 3)])
def test_the_local_process_count_is_kdists_then_torchruns(monkeypatch, environ, count):
    for name in LOCAL_COUNTS:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert processes.local_processes() == count


@pytest.mark.parametrize("name, value", [("KDIST_LOCAL_PROCESSES", "0"),
                                         ("KDIST_LOCAL_PROCESSES", "two"),
                                         ("LOCAL_WORLD_SIZE", "-1")])
def test_a_bad_local_process_count_is_one_usage_error(monkeypatch, name, value):
    for other in LOCAL_COUNTS:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=f"^{name}={value!r}: .*positive integer"):
        processes.local_processes()


def test_the_launcher_names_the_worker_that_failed_not_the_one_that_lost_it(capsys):
    # torch, 3 workers: worker 1's step raised; worker 0, its collective broken, exited
    # first, and kdist-launch reported worker 0's "lost the other workers" as the error.
    lost = ("print('kdist.errors.WorkerLost: lost the other workers mid-run (Connection closed "
            "by peer)'); raise SystemExit(1)")
    raised = "import time; time.sleep(1); raise ValueError('the step raised on its share')"
    workers = [processes.Worker(i, [sys.executable, "-c", code], dict(os.environ))
               for i, code in enumerate([lost, raised])]
    assert processes.supervise(workers, timeout=60, grace=5) == 1
    err = capsys.readouterr().err
    assert err.startswith("kdist-launch: error: worker 1 exited with status 1; stopped the "
                          "others. Its last lines:"), err
    assert "ValueError: the step raised on its share" in err, err
