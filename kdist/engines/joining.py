"""Joining the other workers of a run: `kdist.connect`, and the join of
`train_and_evaluate` and the commands."""

import socket

import keras

from kdist import engines, hints
from kdist.errors import UsageError
from kdist.workers import cluster

_TOO_LATE = ("this process ran {framework} before joining the other workers ({error}); call "
             "kdist.connect() first thing in the script, before building data pipelines, "
             "models or tensors")


@hints.library_terms
def connect(*, peers: str | None = None, workers: int | None = None,
            worker_index: int | None = None, timeout: float = 120.0,
            replicas: int | None = None) -> cluster.ClusterSpec:
    """Joins this process to the other workers of its run; returns its `ClusterSpec`.

    The workers are read from the arguments, else from the environment, first
    match wins (`kdist.workers.cluster`): `KDIST_PEERS` / `KDIST_WORKERS` /
    `KDIST_WORKER_INDEX` (`kdist-launch` sets them), `TF_CONFIG` (TensorFlow),
    `KERAS_DISTRIBUTION_*` (JAX), torchrun's `RANK` / `WORLD_SIZE` /
    `MASTER_ADDR` / `MASTER_PORT` (torch), a SLURM job step (every backend).
    Alone (none of these), it does nothing. Joined already, it returns at once.

    Call it first thing: TensorFlow and JAX must join before they run anything.
    `train_and_evaluate` calls it itself, so a script needs it only where it
    runs TensorFlow or JAX before training, or wants its place (`worker_index`,
    `num_workers`, `is_chief`), e.g. to read its own share of the data.

    Args:
        peers: every worker's `host:port`, in worker order (JAX and torch
            need only worker 0's, the coordinator).
        workers: the number of workers (default: the number of `peers`).
        worker_index: this worker's place in `peers`, from 0.
        timeout: seconds to wait for every worker. A worker that cannot
            reach its peers in time prints one line naming them and exits
            with status 137: the frameworks wait in native code that Python
            cannot interrupt.
        replicas: this worker's device count (TensorFlow and JAX; on torch
            each process is one replica).

    Raises UsageError for inconsistent settings, or when the framework has
    already run.
    """
    spec = cluster.from_flags_and_env(workers, worker_index, peers, timeout,
                                      backend=keras.backend.backend())
    join(spec, replicas)
    return spec


def is_chief() -> bool:
    """Whether this process is the chief, the one that prints, writes the metrics
    file, TensorBoard's logs and the checkpoints: worker 0, and on torch, where
    each replica is a process, worker 0's first. A callback of your own that
    writes (or sends) checks it; `kdist.connect()`'s `is_chief` is the worker's."""
    return engines.is_chief()


# What the frameworks raise where a process joins after it ran: TensorFlow's strategy
# ("Collective ops must be configured at program startup") and thread pools (sized
# for the processes sharing a machine), JAX's "jax.distributed.initialize() must be
# called before any JAX calls ...".
_TOO_LATE_ERRORS = ("at program startup", "cannot be modified after initialization",
                    "before any JAX")
# Where the port this worker serves on is taken: JAX's coordinator, torch's store,
# TensorFlow's gRPC server.
_CANNOT_LISTEN_ERRORS = ("Failed to start RPC server", "EADDRINUSE",
                         "Could not start gRPC server")


def join(spec: cluster.ClusterSpec, replicas: int | None = None) -> None:
    """Joins the workers of `spec`, bounded by its timeout; nothing alone or joined."""
    if spec.num_workers == 1 or engines.connected():
        return
    address = engines.served_address(spec)
    if address is not None:
        _check_free(spec, address)
    with cluster.connect_deadline(spec):
        try:
            engines.connect(spec, replicas)
        except Exception as error:  # TensorFlow's errors are no RuntimeError.
            if any(late in str(error) for late in _TOO_LATE_ERRORS):
                raise UsageError(_TOO_LATE.format(framework=keras.backend.backend(),
                                                  error=error)) from None
            if address is not None and any(taken in str(error)
                                           for taken in _CANNOT_LISTEN_ERRORS):
                raise _cannot_listen(spec, address,
                                     str(error).strip().splitlines()[0][:200]) from None
            raise


def _check_free(spec, address):
    """A `UsageError` where another program holds `address`'s port: the frameworks
    fail on it in a traceback of their own (JAX's may crash the process)."""
    port = int(address.rsplit(":", 1)[1])
    try:
        if socket.has_dualstack_ipv6():  # As the frameworks listen: every address.
            socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True).close()
        else:
            socket.create_server(("", port)).close()
    except OSError as error:
        raise _cannot_listen(spec, address, error.strerror or str(error)) from None


def _cannot_listen(spec, address, reason):
    return UsageError(f"{spec.source}: worker {spec.worker_index} cannot listen at {address} "
                      f"({reason}): another program holds that port, or another worker was "
                      "given the same index")


def join_from_environment() -> None:
    """The join of `train_and_evaluate`: the workers the environment names
    (`connect` with no arguments), unless this process has joined already."""
    if not engines.connected():
        join(cluster.from_flags_and_env(backend=keras.backend.backend()))
