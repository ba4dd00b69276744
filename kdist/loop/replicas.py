"""One process per replica on this machine, for the engines that need it (torch).

Keras' torch backend has no in-process data parallelism, so the torch
engine is one replica per process (`PROCESS_PER_REPLICA` in its module).
`run` starts those processes for `train_and_evaluate(replicas=N)` and
`kdist-train --replicas N`, so one machine needs no launcher:

- each process is a fresh interpreter (`python -c`, this one's, in its own
  session, so signals reach it only through the parent); it imports no
  script of the caller's: the function and its arguments travel pickled by
  cloudpickle, which also takes lambdas and functions of a script's own,
  and Keras' global settings go with them (`keras_settings`: floatx, the
  dtype policy, the counters that name metrics and layers made without a
  name);
- it joins a process group on a free loopback port (the engine's
  `connect`), runs the function with the same arguments and sends its
  outcome back through a pipe; the chief's log lines go to the caller's
  `log` as they come; its messages name settings as the caller's do (flags
  under a command, keywords in a script: `kdist.hints`); it keeps freed
  memory for reuse where the caller does (`kdist.runtime.memory`, set by
  `prepare_environment`): eager torch would otherwise fault its
  activations in again every step;
- a stop request in the parent (`stop`, a signal, Ctrl-C) becomes the same
  signal to every process (SIGTERM for a stop object, once the processes
  have joined): they agree on a step, the chief checkpoints, and the parent
  raises the chief's `Interrupted`, which names that signal ("asked to
  stop" for a stop object, as one process does);
- a process that fails makes the parent stop the others (a process left
  alone would wait in its next all-reduce) and raise that failure, as
  one process would (its traceback printed; an exception whose class or
  attributes do not pickle as a `TrainingError` naming its type); a parent
  killed outright leaves processes that stop as on SIGTERM, with a
  checkpoint (`follow_launcher`, and a broken pipe to the parent), and exit
  without a word: what they would send the parent is dropped; one still
  running `GRACE_SECONDS` later ends itself.

An input that cannot be pickled (a tf.data pipeline) is refused with one line,
and so is a Keras object that Keras' pickling would change (`pickled`).
"""

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from multiprocessing import connection

import cloudpickle

from kdist import hints
from kdist.errors import Interrupted, TrainingError, UsageError, WorkerLost
from kdist.loop import pickled
from kdist.runtime import memory
from kdist.workers import cluster
from kdist.workers.processes import (
    CLUSTER_VARIABLES,
    GRACE_VARIABLE,
    LAUNCHER_VARIABLE,
    LOCAL_PROCESSES_VARIABLE,
    REPLICA_PROCESSES_VARIABLE,
    STOP_SIGNALS,
    exit_status,
    free_ports,
)

GRACE_SECONDS = 30.0  # For the others to stop once one process has failed.
# What one replica process holds before its data: Python, Keras and the framework
# (torch 2.13 on a CPU: about 0.5 GB resident), with room for a model and its batches.
PROCESS_GB = 0.75
# How a replica process ends on a stop signal while it joins the others
# (`cluster.connect_deadline`); elsewhere its handler stops it with a result.
_STOPPED_JOINING = tuple(-s for s in STOP_SIGNALS)
_CHILD = "from kdist.loop.replica_process import replica_main; replica_main()"


def run(num_replicas, fn, kwargs, log=print, stop=None, connect_timeout=120.0):
    """`fn(**kwargs, log=..., stop=...)` in `num_replicas` processes, one replica
    each; returns what process 0's call returned.

    Raises, in this order of preference: `Interrupted` where a process ended
    on a stop signal while joining the others; `TrainingError` naming a
    process that ended without reporting (killed by a signal, say); the first kdist
    error a process reported, else the first other error (the others then
    fail in a collective; that one's traceback is printed); process 0's
    `Interrupted` after a stop.
    """
    _check_memory(num_replicas)
    modules: set[str] = set()
    try:
        call = pickled.dumps((fn, kwargs), modules)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 (whatever pickling raises, one line)
        raise UsageError(_unpicklable(kwargs) or (
            f"on this backend each replica is a process, which gets the data and functions "
            f"pickled; these cannot be ({type(e).__name__}: {e}); pass arrays, a "
            "kdist.Dataset or a picklable input")) from None
    folder = tempfile.mkdtemp(prefix="kdist-replicas-")
    processes, pipes = [], []
    try:
        payload = os.path.join(folder, "call.pickle")
        with open(payload, "wb") as f:
            pickle.dump(sys.path, f)  # The caller's modules, importable in every process.
            f.write(cloudpickle.dumps(warnings.showwarning))  # How it shows warnings.
            pickle.dump(keras_settings(), f)
            pickle.dump(pickled.module_table(modules), f)  # Checked where they arrive.
            f.write(call)
        address = f"127.0.0.1:{free_ports(1)[0]}"
        for rank in range(num_replicas):
            spec = cluster.ClusterSpec(num_replicas, rank, (address,), connect_timeout,
                                       source=f"{num_replicas} local replica processes")
            process, pipe = _start(spec, payload)
            processes.append(process)
            pipes.append(pipe)
        try:
            return _supervise(processes, pipes, log, stop)
        except Interrupted as stopped:
            raise _as_asked(stopped, stop) from None
    finally:
        _kill(processes)
        shutil.rmtree(folder, ignore_errors=True)  # kdist's own temporary folder.


def _unpicklable(kwargs):
    """The message for a tf.data pipeline among the inputs, or a callback whose
    attribute cannot be pickled, naming both (an open file, a lock); None where
    neither is."""
    for split in ("train", "test"):
        given = getattr(kwargs.get("dataset"), split, None)
        if type(given).__module__.startswith("tensorflow"):
            return (f"on this backend each replica is a process, which gets the data pickled; "
                    f"the {split} data is a tf.data pipeline, which cannot be; pass a function "
                    f"that makes it ({split}=lambda: make_pipeline()): each process calls it")
    for callback in kwargs.get("callbacks") or ():
        for name, value in vars(callback).items():
            try:
                pickled.dumps(value)
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 (whatever pickling raises, one line)
                return (f"on this backend each replica is a process, which gets the callbacks "
                        f"pickled; callback {type(callback).__name__}'s attribute {name} cannot "
                        f"be ({type(e).__name__}: {e}); create it in on_train_begin, where "
                        "each process makes its own (a file to write: where kdist.is_chief())")
    return None


def keras_settings():
    """Keras' global state in this process that a fresh interpreter lacks:
    {name: value} for each `keras.config.set_<name>` (floatx, the dtype
    policy, epsilon, the image data format), and its counters of automatic
    names (a run after another here names its metrics `auc_1`, a fresh
    interpreter `auc`), as {"names": {prefix: count}}; {} before Keras is
    imported."""
    keras = sys.modules.get("keras")
    if keras is None:
        return {}
    from kdist.loop import building  # Imports Keras, imported already.

    config = keras.config
    return {"floatx": config.floatx(), "dtype_policy": config.dtype_policy().name,
            "epsilon": config.epsilon(), "image_data_format": config.image_data_format(),
            "names": building.object_names()}


def _check_memory(num_replicas, meminfo="/proc/meminfo"):
    """Refuses more processes than this machine's available memory holds."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f)
        available_gb = int(fields["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return  # Not Linux: nothing to check against.
    if num_replicas * PROCESS_GB > available_gb:
        raise UsageError(
            f"--replicas {num_replicas} but {num_replicas} processes (one per replica on "
            f"this backend) need about {num_replicas * PROCESS_GB:.0f} GB and "
            f"{available_gb:.1f} GB is available; use at most "
            f"{max(1, int(available_gb // PROCESS_GB))}")


def _start(spec, payload):
    read, write = os.pipe()
    env = dict(os.environ, **{LAUNCHER_VARIABLE: str(os.getpid()),
                              GRACE_VARIABLE: str(GRACE_SECONDS),
                              LOCAL_PROCESSES_VARIABLE: str(spec.num_workers),
                              REPLICA_PROCESSES_VARIABLE: "1"})
    for name in CLUSTER_VARIABLES + cluster.TORCHRUN_VARIABLES:
        env.pop(name, None)  # This group is described by `spec` alone.
    process = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(spec.num_workers), str(spec.worker_index),
         spec.coordinator, str(spec.connect_timeout), payload, str(write),
         "flags" if hints.on_command_line() else "keywords",
         "keep" if memory.keeping_freed_memory() else "default"],
        stdin=subprocess.DEVNULL, pass_fds=(write,), env=env, start_new_session=True)
    os.close(write)
    return process, connection.Connection(read, writable=False)


def _supervise(processes, pipes, log, stop, forwarded=False):
    """Passes on the chief's lines and a stop until every process has ended; returns
    or raises their outcome (`_outcome`). A signal's stop goes on at once (SIGINT
    and SIGTERM end a process that is still joining); a stop object's once the
    chief has written its first line, after joining, so that the processes
    stop after their first chunk of steps, with a checkpoint, as one process does."""
    reported, open_pipes = {}, dict(enumerate(pipes))
    failed_at, joined = None, False
    try:
        while open_pipes or any(p.poll() is None for p in processes):
            for pipe in connection.wait(list(open_pipes.values()), timeout=0.05):
                rank = next(r for r, p in open_pipes.items() if p is pipe)
                try:
                    kind, value = open_pipes[rank].recv()
                except EOFError:  # The process closed it: it is ending.
                    del open_pipes[rank]
                    continue
                if kind == "log":
                    joined = True
                    log(value)
                else:
                    reported[rank] = (kind, value)
            if not open_pipes:
                time.sleep(0.05)
            if stop and not forwarded and (joined or getattr(stop, "signal_name", None)):
                forwarded = _terminate(processes, getattr(stop, "signal_name", None))
            if failed_at is None and _failed(processes, reported):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_SECONDS:
                break  # The others wait in a collective for the failed one.
    except KeyboardInterrupt:
        if forwarded:  # A second Ctrl-C: `run` kills them (checkpoint writes are atomic).
            raise
        _terminate(processes, "SIGINT")  # Every process checkpoints and stops; then report.
        return _supervise(processes, pipes, log, stop=None, forwarded=True)
    return _outcome(processes, reported)


def _as_asked(stopped, stop):
    """The processes' `Interrupted` as this process's run raises it: where a stop
    object (no signal) stopped them, "asked to stop", not the SIGTERM that
    carried it to them."""
    if (stop and getattr(stop, "signal_name", None) is None
            and stopped.signal_name == "SIGTERM" and stopped.where is not None):
        return Interrupted(f"asked to stop: {stopped.where}", where=stopped.where)
    return stopped


def _failed(processes, reported):
    """Whether a process reported an error or ended without reporting."""
    return any(kind == "error" for kind, _ in reported.values()) or any(
        p.poll() not in (None, 0) and rank not in reported for rank, p in enumerate(processes))


def _outcome(processes, reported):
    """Process 0's result, or the error that `run` raises (see `run`)."""
    errors = [(rank, _rebuilt(*value)) for rank, (kind, value) in reported.items()
              if kind == "error"]
    if not errors and reported.get(0, (None,))[0] == "ok":
        return reported[0][1]
    for rank, process in enumerate(processes):
        if rank not in reported and process.poll() in _STOPPED_JOINING:
            name = signal.Signals(-process.poll()).name  # Its default action, while joining.
            raise Interrupted(f"{name}: stopped while the replica processes were joining, "
                              "before the first step", name)
        if rank not in reported and process.poll() is not None:
            raise TrainingError(f"replica process {rank} exited with status "
                                f"{exit_status(process.poll())} without a result; "
                                "stopped the others")
    # kdist's own errors first, then the others (a step's own exception); last a
    # `WorkerLost`: a collective that failed because another process left.
    causes = sorted((e for _, e in errors if not isinstance(e, Interrupted)),
                    key=lambda e: (isinstance(e, WorkerLost), e.replica_traceback is not None))
    if causes:
        raise _raised(causes[0])
    if errors:
        raise _raised(dict(errors).get(0, errors[0][1]))
    raise TrainingError(f"the replica processes gave no result within {GRACE_SECONDS:g} s "
                        "of a failure; stopped them")


def _terminate(processes, signal_name=None):
    """Sends every running process `signal_name` (None: SIGTERM)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(getattr(signal, signal_name or "SIGTERM"))
    return True


def _kill(processes):
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _rebuilt(cls, message, attributes, trace, itself=None):
    """The error a replica process reported (`replica_process._portable`): the
    exception itself where its class, arguments and attributes came pickled
    (made again without calling its `__init__`, as its arguments may not be
    the constructor's), else `cls(message)` with `attributes`;
    `replica_traceback` is its traceback in that process."""
    if itself is not None:
        try:
            kind, args, attributes = pickle.loads(itself)
            error = kind.__new__(kind, *args)
            error.args = args
            vars(error).update(attributes, replica_traceback=trace)
            return error
        except Exception:  # noqa: BLE001 - a class this process cannot import or make.
            pass
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    vars(error).update(attributes)
    error.replica_traceback = trace
    return error


def _raised(error):
    """`error`, after printing the traceback of the process it came from, if it
    was not a kdist error (only the cause's: the others fail after it)."""
    if error.replica_traceback:
        sys.stderr.write(error.replica_traceback)
    return error
