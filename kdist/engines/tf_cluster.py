"""Where the TensorFlow engine's replicas run: this process's devices, or the
workers that `connect` joins in a `MultiWorkerMirroredStrategy`."""

import os

import tensorflow as tf

from kdist.errors import UsageError
from kdist.runtime.startup import split_tensorflow_cpu
from kdist.workers import processes


def replica_devices(replicas):
    """Device names for `replicas` replicas: GPUs if any, else a split CPU."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if replicas is not None and replicas > len(gpus):
            raise UsageError(f"--replicas {replicas} but only {len(gpus)} GPUs are "
                             f"visible; pass --replicas {len(gpus)} or fewer")
        return [f"/gpu:{i}" for i in range(replicas or len(gpus))]
    replicas = replicas or 1
    cpus = split_tensorflow_cpu(replicas)
    if replicas > len(cpus):
        raise UsageError(f"--replicas {replicas} but TensorFlow already started with "
                         f"{len(cpus)} CPU devices; create the engine before any "
                         "TensorFlow op runs")
    return [d.name for d in cpus[:replicas]]


_connected = None  # (MultiWorkerMirroredStrategy, ClusterSpec) once connect() ran.


def served_address(spec):
    """Every TensorFlow worker serves gRPC on its own address."""
    return spec.addresses[spec.worker_index]


def connect(spec, replicas=None):
    """Creates the MultiWorkerMirroredStrategy of `spec`; blocks until every worker joins.

    TensorFlow requires this strategy before any other op. Flags become
    `TF_CONFIG`, which the strategy reads. On CPUs the collectives use RING
    (gRPC); each worker then has one replica, its CPU. On GPUs each worker
    uses all its GPUs. Workers that share a machine share its cores
    (`_share_cores`).
    """
    global _connected
    cpus = tf.config.list_physical_devices("CPU")
    split = tf.config.get_logical_device_configuration(cpus[0]) if cpus else None
    if split and len(split) > 1 and not tf.config.list_physical_devices("GPU"):
        raise UsageError(_ONE_CPU.format(replicas=len(split), local=1) + ": this process split "
                         "its CPU before joining (kdist.prepare_environment(replicas=N)); call "
                         "kdist.connect() first thing in the script, without replicas")
    _share_cores()
    if spec.source != "TF_CONFIG":
        os.environ["TF_CONFIG"] = spec.tf_config()
    on_cpu = not tf.config.list_physical_devices("GPU")
    implementation = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation.RING if on_cpu else implementation.AUTO)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    local = len(strategy.extended.worker_devices)
    if replicas is not None and replicas != local:
        raise UsageError(_ONE_CPU.format(replicas=replicas, local=local))
    _connected = (strategy, spec)


_ONE_CPU = ("--replicas {replicas}: with several workers, each TensorFlow worker uses all its "
            "GPUs, or one CPU ({local} here); leave --replicas out")


def _share_cores():
    """Splits this machine's cores between the training processes on it.

    Each TensorFlow process sizes its thread pools to every core it may run on;
    two workers on one machine then run twice as many threads as cores, and
    each waits longer in every step's all-reduce for the other
    (docs/performance.md). The count of processes comes from kdist's launchers
    (`kdist.workers.processes.cores_per_process`); `TF_NUM_INTRAOP_THREADS` or
    `TF_NUM_INTEROP_THREADS`, if set, are left to TensorFlow.
    """
    if (processes.local_processes() == 1 or os.environ.get("TF_NUM_INTRAOP_THREADS")
            or os.environ.get("TF_NUM_INTEROP_THREADS")):
        return
    cores = processes.cores_per_process()
    tf.config.threading.set_intra_op_parallelism_threads(cores)
    tf.config.threading.set_inter_op_parallelism_threads(cores)


def connected():
    """Whether `connect` created this process's MultiWorkerMirroredStrategy."""
    return _connected is not None


def is_chief():
    """Whether this process is worker 0 of those `connect` joined."""
    return _connected is None or _connected[1].is_chief


def failed_collective(error):
    """Whether `error` is a collective across the workers that failed: the
    errors TensorFlow's collectives raise when a peer goes away (an
    unreachable task, an aborted or cancelled collective, a deadline)."""
    return isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError,
                              tf.errors.CancelledError, tf.errors.DeadlineExceededError))


def joined():
    """(MultiWorkerMirroredStrategy, ClusterSpec) that `connect` created."""
    return _connected
