"""Which workers take part in a run, read from flags or the engines' own variables.

Importing this module imports no framework: the cluster must be known before
TensorFlow or JAX start (TF's MultiWorkerMirroredStrategy must be the first
thing TF creates; JAX's distributed runtime must start before its backend).

Sources, first match wins:

1. the flags `--peers`, `--workers`, `--worker-index` (or `kdist.connect`'s arguments);
2. the same as variables, `KDIST_PEERS`, `KDIST_WORKERS`, `KDIST_WORKER_INDEX`
   (`kdist-launch` sets them for any script; a Kubernetes manifest can too);
3. on TensorFlow, `TF_CONFIG` (a `chief` task, if any, counts as worker 0);
4. on JAX, `KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES`
   and `KERAS_DISTRIBUTION_PROCESS_ID` (as `keras.distribution.initialize` reads them);
5. on torch, `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (as `torchrun`
   sets them; each process is one replica);
6. a SLURM job step: each task `srun` starts is one worker (`kdist.workers.slurm`);
7. otherwise one worker.

Worker 0 is the chief: it alone prints epoch lines and writes checkpoints and
the metrics file. On JAX it is also the coordinator.
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys

from kdist import hints
from kdist.errors import UsageError
from kdist.workers import interrupt, slurm

KDIST_VARIABLES = ("KDIST_PEERS", "KDIST_WORKERS", "KDIST_WORKER_INDEX")  # As the flags.
JAX_VARIABLES = ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES",
                 "KERAS_DISTRIBUTION_PROCESS_ID")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The workers of one run and this process's place among them.

    `addresses` holds every worker's host:port in worker order, or (JAX only)
    just the coordinator's.
    """

    num_workers: int = 1
    worker_index: int = 0
    addresses: tuple = ()
    connect_timeout: float = 120.0
    source: str = "single process"

    @property
    def is_chief(self):
        return self.worker_index == 0

    @property
    def coordinator(self):
        return self.addresses[0] if self.addresses else None

    def tf_config(self):
        """The `TF_CONFIG` JSON that describes this spec to TensorFlow."""
        return json.dumps({"cluster": {"worker": list(self.addresses)},
                           "task": {"type": "worker", "index": self.worker_index}})


def parse_address(text, what):
    """Checks one `host:port`; returns it stripped."""
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{what}: {text.strip()!r} is not host:port")
    return text.strip()


def from_flags_and_env(workers=None, worker_index=None, peers=None, connect_timeout=120.0,
                       environ=None, backend="tensorflow"):
    """The ClusterSpec of this process; raises UsageError for inconsistent settings."""
    environ = os.environ if environ is None else environ
    if workers is not None or worker_index is not None or peers is not None:
        spec = _from_flags(workers, worker_index, peers)
    elif any(environ.get(name) for name in KDIST_VARIABLES):
        spec = _from_kdist_variables(environ)
    elif backend == "tensorflow" and environ.get("TF_CONFIG"):
        spec = _from_tf_config(environ["TF_CONFIG"])
    elif backend == "jax" and any(environ.get(name) for name in JAX_VARIABLES):
        spec = _from_jax_variables(environ)
    elif backend == "torch" and environ.get("WORLD_SIZE"):
        spec = _from_torchrun_variables(environ)
    elif environ.get(slurm.STEP_VARIABLE):
        spec = _from_slurm(environ)
    else:
        spec = ClusterSpec()
    if backend == "tensorflow" and spec.num_workers > 1 and len(spec.addresses) == 1:
        how = ("let srun lay the tasks out node by node (--distribution=block)"
               if spec.source.startswith("SLURM") else f"list {spec.num_workers} addresses")
        raise UsageError(f"{spec.source}: TensorFlow needs every worker's host:port, "
                         f"not only the coordinator's; {how}")
    return dataclasses.replace(spec, connect_timeout=connect_timeout)


def _check(num_workers, index, addresses, source):
    if len(addresses) > 1 and num_workers != len(addresses):
        raise UsageError(f"{source}: {num_workers} workers but {len(addresses)} addresses")
    if num_workers > 1 and not addresses:
        raise UsageError(f"{source}: {num_workers} workers need the coordinator's "
                         "host:port (--peers)")
    if index is None and num_workers > 1:
        raise UsageError(f"{source}: which worker is this? Set the worker index")
    index = index or 0
    if not 0 <= index < num_workers:
        raise UsageError(f"{source}: worker index {index} is not in 0..{num_workers - 1}")
    return ClusterSpec(num_workers, index, tuple(addresses), source=source)


def _from_flags(workers, worker_index, peers, source="--peers/--workers/--worker-index"):
    addresses = [parse_address(a, source) for a in peers.split(",")] if peers else []
    num_workers = workers if workers is not None else max(len(addresses), 1)
    return _check(num_workers, worker_index, addresses, source)


def _from_kdist_variables(environ):
    return _from_flags(_number(environ, "KDIST_WORKERS"), _number(environ, "KDIST_WORKER_INDEX"),
                       environ.get("KDIST_PEERS"), "KDIST_PEERS/KDIST_WORKERS/KDIST_WORKER_INDEX")


def _from_tf_config(text):
    try:
        config = json.loads(text)
        cluster, task = config.get("cluster", {}), config["task"]
        chiefs, workers = list(cluster.get("chief", [])), list(cluster.get("worker", []))
        kind, index = task["type"], int(task.get("index", 0))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"TF_CONFIG is not valid ({type(e).__name__}: {e}); expected "
                         '{"cluster": {"worker": [...]}, "task": {"type": "worker", '
                         '"index": N}}') from None
    if kind not in ("chief", "worker") or set(cluster) - {"chief", "worker"}:
        raise UsageError("TF_CONFIG: kdist runs only 'chief' and 'worker' tasks, got "
                         f"task type {kind!r} in cluster {sorted(cluster)}")
    addresses = [parse_address(a, "TF_CONFIG") for a in chiefs + workers]
    position = index if kind == "chief" else len(chiefs) + index
    return _check(len(addresses), position, addresses, "TF_CONFIG")


def _number(environ, name):
    text = environ.get(name)
    if text is None:
        return None
    if not text.strip().isdigit():
        raise UsageError(f"{name}={text!r} is not a whole number")
    return int(text)


def _from_jax_variables(environ):
    def number(name):
        return _number(environ, name)

    jobs = environ.get(JAX_VARIABLES[0], "")
    addresses = [parse_address(a, JAX_VARIABLES[0]) for a in jobs.split(",") if a.strip()]
    num_workers = number(JAX_VARIABLES[1])
    num_workers = num_workers if num_workers is not None else max(len(addresses), 1)
    return _check(num_workers, number(JAX_VARIABLES[2]), addresses, "KERAS_DISTRIBUTION_*")


def _from_torchrun_variables(environ):
    """The spec `torchrun` describes: process RANK of WORLD_SIZE, rendezvous at
    MASTER_ADDR:MASTER_PORT."""
    missing = [name for name in TORCHRUN_VARIABLES if not environ.get(name)]
    if missing:
        raise UsageError(f"WORLD_SIZE is set but {', '.join(missing)} is not; start the "
                         "processes with torchrun, or set all of "
                         f"{', '.join(TORCHRUN_VARIABLES)}")
    address = parse_address(f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
                            "MASTER_ADDR:MASTER_PORT")
    return _check(_number(environ, "WORLD_SIZE"), _number(environ, "RANK"), [address],
                  "RANK/WORLD_SIZE (torchrun)")


def _from_slurm(environ):
    """The spec of a SLURM job step: task SLURM_PROCID of SLURM_STEP_NUM_TASKS."""
    num_tasks = _number(environ, slurm.STEP_VARIABLE)
    addresses = slurm.addresses(environ, num_tasks) if num_tasks > 1 else []
    return _check(num_tasks, _number(environ, "SLURM_PROCID"), addresses, "SLURM (srun)")


_WATCHDOG = """
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    time.sleep(0.2)
    if os.getppid() != parent:  # The worker is gone: nothing to stop.
        sys.exit(0)
sys.stderr.write(sys.argv[3] + "\\n")
sys.stderr.flush()
os.kill(parent, 9)
"""


@contextlib.contextmanager
def connect_deadline(spec, remedy=None):
    """Ends this process with a one-line error if the block outlasts the timeout;
    the line ends in `remedy` (default: the addresses, the ports, the timeout).

    Connecting blocks in native code that Python cannot interrupt: TF's
    MultiWorkerMirroredStrategy waits for every worker forever, holding the
    GIL (so no Python thread or signal handler runs) and catching SIGTERM;
    JAX aborts with a C++ stack trace after its own timeout. So a small
    watchdog process prints the error and kills the worker (exit status 137);
    it is stopped as soon as the block ends.

    For the same reason, SIGINT, SIGTERM and SIGHUP end the process at once
    within the block (`interrupt.signals_end_the_process`): a launcher that
    stops the workers while one waits for a peer that is gone gets no answer
    from a Python handler. This holds on torch and JAX. TensorFlow's join
    takes SIGTERM over in native code before it waits (its preemption
    notifier), so there a worker waiting for a peer that is gone ends at
    the timeout, by the watchdog, or by the launcher's SIGKILL after its
    grace period.
    """
    others = ", ".join(a for i, a in enumerate(spec.addresses) if i != spec.worker_index)
    remedy = remedy or ("start every worker with the same addresses, check that the ports "
                        f"are open, or raise {hints.name('--connect-timeout')}")
    message = (f"error: worker {spec.worker_index} of {spec.num_workers} could not reach its "
               f"peers ({others or spec.coordinator}) within {spec.connect_timeout:g} s; "
               f"{remedy}")
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(spec.connect_timeout), message],
        stdin=subprocess.DEVNULL)
    try:
        with interrupt.signals_end_the_process():
            yield
    finally:
        watchdog.kill()
        watchdog.wait(timeout=30)
