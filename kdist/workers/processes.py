"""Training processes on one machine: starting them with their output prefixed,
supervising them with bounded waits, stopping them all, and a worker following
its launcher (`follow_launcher`). `kdist-launch` (`kdist.cli.launch`) and the
torch replica processes (`kdist.loop.replicas`) use them. Imports no framework.
"""

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from kdist.errors import LOST_WORKERS, UsageError

# The training command, kdist-train's `kdist.cli.train.main`, run by kdist/__main__.py.
TRAIN = [sys.executable, "-m", "kdist"]

# Set by the launcher; inherited values would describe another cluster
# (`kdist.workers.cluster` reads them; SLURM_STEP_NUM_TASKS marks a SLURM job step).
CLUSTER_VARIABLES = ("TF_CONFIG", "KERAS_DISTRIBUTION_JOB_ADDRESSES",
                     "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID",
                     "KDIST_PEERS", "KDIST_WORKERS", "KDIST_WORKER_INDEX", "SLURM_STEP_NUM_TASKS")
PEERS_VARIABLE, WORKER_INDEX_VARIABLE = "KDIST_PEERS", "KDIST_WORKER_INDEX"  # What it sets.

LAST_LINES = 20

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# What train.py returns after it checkpointed and stopped on SIGINT, SIGTERM or SIGHUP.
STOPPED_STATUSES = tuple(128 + s for s in STOP_SIGNALS)

LAUNCHER_VARIABLE = "KDIST_LAUNCHER_PID"  # Tells a worker which process to follow,
GRACE_VARIABLE = "KDIST_LAUNCHER_GRACE"  # and how long to take to stop once it is gone.
DEFAULT_GRACE = 30.0

# Tells a worker how many training processes share this machine (the engines split
# the cores between them: `cores_per_process`).
LOCAL_PROCESSES_VARIABLE = "KDIST_LOCAL_PROCESSES"

# Set in the processes `kdist.loop.replicas` starts: they are one machine's replicas, not
# workers (the banner then has no "Workers:" line, as on the other backends).
REPLICA_PROCESSES_VARIABLE = "KDIST_REPLICA_PROCESSES"


def free_ports(count):
    """`count` distinct ports that were free on 127.0.0.1 a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Worker:
    """One worker process whose output is printed with a prefix as it comes."""

    def __init__(self, index, command, env):
        self.index = index
        self.last: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, env=env,
                                     start_new_session=True)  # Signals come from us only.
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self):
        assert self.proc.stdout is not None  # stdout=PIPE.
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.last.append(line)
            _print_line(f"[worker {self.index}] {line}")

    def terminate(self):
        """SIGTERM: the worker stops after the step all workers agree on."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait_or_kill(self, deadline):
        """Waits until `deadline` (time.monotonic()), then SIGKILL; bounded."""
        try:
            self.proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.reader.join(timeout=5)


_OUTPUT = threading.Lock()  # The workers' pumps share this process's stdout.


def _print_line(text):
    """Prints `text` and its newline in one write, under a lock: `print` writes the
    text and the newline apart, so another worker's pump could land between them
    ("...h5[worker 1] interrupted" on one line)."""
    with _OUTPUT:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def stop_all(workers, grace):
    """Stops every worker; returns once none is left.

    SIGTERM goes to every worker at once; they agree on the step to stop
    after and the chief checkpoints. Any worker still running `grace`
    seconds later gets SIGKILL. `grace` 0: SIGKILL at once.
    """
    if grace > 0:
        for worker in workers:
            worker.terminate()
    deadline = time.monotonic() + grace
    for worker in workers:
        worker.wait_or_kill(deadline)


def exit_status(returncode):
    """The shell's convention: a process killed by signal N exits 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def local_processes():
    """How many training processes share this machine: kdist's launchers say it
    (`KDIST_LOCAL_PROCESSES`), torchrun too (`LOCAL_WORLD_SIZE`); else 1. A value
    that is no positive integer is a `UsageError`."""
    for name in (LOCAL_PROCESSES_VARIABLE, "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"{name}={value!r}: set it to the count of training "
                                 "processes on this machine (a positive integer), or unset it")
            return int(value)
    return 1


def cores_per_process():
    """This process's share of the cores it may run on, split evenly between the
    training processes on this machine (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // local_processes())


def worker_command(args):
    """What each worker runs: `args` where it names a program (`python train.py
    ...`; `python` or `python3`, or a first word ending in .py, runs with this
    Python, the one kdist is installed in, whatever PATH holds), else
    kdist-train with `args` as its flags."""
    if not args or args[0].startswith("-"):
        return [*TRAIN, *args]
    if args[0] in ("python", "python3"):
        return [sys.executable, *args[1:]]
    return [sys.executable, *args] if args[0].endswith(".py") else list(args)


def start(num_workers, args, grace=DEFAULT_GRACE):
    """Starts `num_workers` workers of `worker_command(args)` on 127.0.0.1, each told
    the cluster by `KDIST_PEERS` and `KDIST_WORKER_INDEX`, and `grace`, the seconds it
    has to stop (`follow_launcher`). If one cannot start, those started before it are
    killed and the error is raised."""
    ports = free_ports(num_workers)
    peers = ",".join(f"127.0.0.1:{port}" for port in ports)
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    env.update({"PYTHONUNBUFFERED": "1", LAUNCHER_VARIABLE: str(os.getpid()),
                GRACE_VARIABLE: str(grace),
                LOCAL_PROCESSES_VARIABLE: str(num_workers), PEERS_VARIABLE: peers})
    workers = []
    try:
        for index in range(num_workers):
            env[WORKER_INDEX_VARIABLE] = str(index)
            workers.append(Worker(index, worker_command(args), dict(env)))
            _print_line(f"kdist-launch: worker {index} pid {workers[-1].proc.pid} ({peers})")
    except BaseException:
        stop_all(workers, 0)
        raise
    return workers


def supervise(workers, timeout, grace):
    """Waits for every worker; on the first failure or the timeout stops the rest.

    Returns the launcher's exit status.
    """
    deadline = time.monotonic() + timeout
    running = list(workers)
    while running:
        for worker in list(running):
            code = worker.proc.poll()
            if code is None:
                continue
            running.remove(worker)
            if code in STOPPED_STATUSES:
                return stopped(worker, workers, grace)
            if code != 0:
                worker = _cause(worker, running, grace)
                return fail(worker, workers, grace,
                            f"exited with status {exit_status(worker.proc.returncode)}")
        if time.monotonic() > deadline:
            return fail(None, workers, grace, f"still running after --timeout {timeout:g} s")
        time.sleep(0.1)
    for worker in workers:
        worker.reader.join(timeout=grace)
    return 0


def _cause(first, others, grace):
    """The failed worker whose error caused the others': `first`, unless it only lost
    its peers (`kdist.WorkerLost` in its last lines) and another worker fails of
    its own within `grace` seconds (at most 10): a step that raised on worker 1
    ends worker 0's collective, which may exit first."""
    def lost(worker):
        worker.reader.join(timeout=1)  # Its last lines, read to the end.
        return any(LOST_WORKERS in line for line in worker.last)

    if not lost(first):
        return first
    deadline = time.monotonic() + min(grace, 10)
    while time.monotonic() < deadline:
        for other in others:
            if other.proc.poll() not in (None, 0) and not lost(other):
                return other
        time.sleep(0.1)
    return first


def stopped(worker, workers, grace):
    """A worker stopped on a signal: after a checkpoint every worker stops after that
    same step, so the others get `grace` seconds to exit on their own. They get
    SIGTERM too: a worker signalled while starting exits before any step, and the
    others, with no step to agree on, stop only so.

    Returns the worker's exit status.
    """
    for other in workers:
        other.terminate()  # After an agreed stop, a second request changes nothing.
    deadline = time.monotonic() + grace
    for other in workers:
        other.wait_or_kill(deadline)
    print(f"kdist-launch: stopped on a signal (worker {worker.index} exited first, status "
          f"{worker.proc.returncode}); the others stopped too", file=sys.stderr, flush=True)
    return worker.proc.returncode


def fail(dead, workers, grace, what):
    """Kills every worker, reports `dead`'s last lines, returns its exit status.

    No SIGTERM first: the others cannot finish a step without the dead worker
    (every step is a collective over all of them), so they would never reach
    the step boundary where they checkpoint. Killing is safe: checkpoint
    writes are atomic. After the timeout the workers get `grace` to stop.
    """
    stop_all(workers, grace if dead is None else 0)
    if dead is None:
        print(f"kdist-launch: error: workers {what}; stopped them all", file=sys.stderr, flush=True)
        return 1
    print(f"kdist-launch: error: worker {dead.index} {what}; stopped the others. Its last lines:",
          file=sys.stderr)
    for line in dead.last:
        print(f"  {line}", file=sys.stderr)
    sys.stderr.flush()
    return exit_status(dead.proc.returncode) or 1


def follow_launcher(stop, environ=os.environ, interval=0.5):
    """In a worker the launcher started: asks `stop` to stop once the launcher is gone.

    A launcher killed outright (SIGKILL, an out-of-memory kill) cannot stop
    its workers. A daemon thread watches this process's parent; when it is no
    longer the launcher, it requests a stop as SIGTERM would, so the workers
    agree on a step, the chief checkpoints, and each exits. A process still
    running the launcher's grace period later (`KDIST_LAUNCHER_GRACE`, default
    30 s; stuck in a collective whose peer is gone, say) ends itself with
    status 137, as the launcher's SIGKILL would have ended it. No signal is
    involved: a signal's handling can be taken over by the frameworks'
    native code. Returns whether this process follows a launcher.
    """
    launcher = environ.get(LAUNCHER_VARIABLE)
    if not launcher:
        return False
    grace = float(environ.get(GRACE_VARIABLE) or DEFAULT_GRACE)

    def watch():
        while os.getppid() == int(launcher):
            time.sleep(interval)
        silence_output()  # The launcher read it; a line to it now would raise.
        stop.request("SIGTERM")
        time.sleep(grace)
        os._exit(128 + signal.SIGKILL)

    threading.Thread(target=watch, name="kdist-follow-launcher", daemon=True).start()
    return True


def silence_output():
    """Points this process's stdout and stderr at /dev/null: their reader (a killed
    launcher or parent) is gone, and a write would raise BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
