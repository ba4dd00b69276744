"""The engines: one module per backend, each an `Engine` of `kdist.engines.contract`.

`create_engine` picks the active Keras backend's; `connect` joins several
workers before anything else runs.
"""

import importlib
import re

import keras

from kdist.engines import contract
from kdist.errors import UsageError  # noqa: F401 (the engines raise it)
from kdist.runtime.startup import BACKENDS, check_backend  # noqa: F401 (one registry, in startup)
from kdist.workers.interrupt import retake_signals


def _backend_module():
    """The engine module of the active Keras backend (`KERAS_BACKEND`)."""
    backend = check_backend(keras.backend.backend())
    return importlib.import_module(f"kdist.engines.{backend}")


def create_engine(replicas: int | None = None, distributed: bool = True) -> contract.Engine:
    """The engine of the active Keras backend (`KERAS_BACKEND`)."""
    return _backend_module().Engine(replicas=replicas, distributed=distributed)


def replica_processes(replicas):
    """How many processes to start for `replicas` replicas (`kdist.loop.replicas`): 0
    where the engine runs them in this process (TensorFlow, JAX), where one
    replica is asked for, or where this process already is one replica of a
    group; `replicas` where the engine runs one replica per process (torch)."""
    module = _backend_module()
    if not getattr(module, "PROCESS_PER_REPLICA", False) or (replicas or 1) == 1:
        return 0
    return 0 if module.connected() else replicas


def connected() -> bool:
    """Whether this process has joined other workers (`connect`) on the active backend."""
    return bool(getattr(_backend_module(), "connected", lambda: False)())


def is_chief() -> bool:
    """Whether this process is the chief (the engine module's `is_chief`; alone, yes)."""
    return not connected() or bool(_backend_module().is_chief())


def lost_peer(error: BaseException) -> str | None:
    """The cause, in one line, where `error` is a collective with the other
    workers that failed mid-run (another worker stopped or its machine went
    away: the engine module's `failed_collective`); None for any other error
    and where this process has not joined other workers."""
    if not isinstance(error, Exception) or not connected():
        return None
    if not _backend_module().failed_collective(error):
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = next((line for line in lines if _CAUSE.search(line)), lines[0] if lines else "")
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0]  # gloo's source file, advice.
    return f"{type(error).__name__}: {line[:160]}"


def bound_exit() -> None:
    """Called where a run starts: the engine module's `bound_exit`, where it has one
    (JAX's), bounds how long this process, joined to others, may wait for them
    at its exit, until `unbound_exit`."""
    if connected():
        getattr(_backend_module(), "bound_exit", lambda: None)()


def unbound_exit() -> None:
    """Called where this worker's run ended where every worker's did (its last
    step or a coordinated stop): the engine module's `unbound_exit`, where it
    has one, lets the process wait for the others at its exit again."""
    if connected():
        getattr(_backend_module(), "unbound_exit", lambda: None)()


_CAUSE = re.compile(r"connection (reset|closed|refused)|socket|heartbeat|timed? ?out|peer",
                    re.IGNORECASE)


def served_address(spec):
    """The host:port this worker of `spec` serves on while it joins, or None (the
    engine module's `served_address`): `kdist.engines.joining` checks it is free."""
    return _backend_module().served_address(spec)


def connect(spec, replicas=None):
    """Joins the workers of `spec` (a `kdist.workers.cluster.ClusterSpec`) on the active backend.

    Must run first, before any tensor or Keras object exists: TensorFlow's
    MultiWorkerMirroredStrategy and JAX's distributed runtime both have to be
    set up before the framework runs anything (torch's process group, so
    that every engine starts alike). Engines created afterwards span
    every worker's devices. `replicas` is the device count of this worker.

    Joining starts TensorFlow's or JAX's preemption notifier, which takes
    SIGTERM over in native code; this process's Python handlers are put back
    at once (`kdist.workers.interrupt.retake_signals`), so a SIGTERM still
    reaches kdist's stop (or Python's default, which ends the process).
    """
    _backend_module().connect(spec, replicas)
    retake_signals()
