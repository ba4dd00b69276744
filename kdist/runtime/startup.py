"""Process start-up that must happen before Keras and its backend are imported.

Importing this module imports no framework. Both engines read their device
settings once, when they initialise: JAX reads `XLA_FLAGS` when its CPU
backend starts, and TensorFlow's logical CPU split (done by the TF engine) must
precede its first op. So `prepare_environment` runs first thing.
"""

import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys

from kdist.errors import UsageError
from kdist.runtime import memory

BACKENDS = ("tensorflow", "jax", "torch")  # The Keras backends kdist has an engine for.

_COUNT_FLAG = "--xla_force_host_platform_device_count"


KERAS_DEFAULT_BACKEND = "tensorflow"


def keras_home():
    """Keras' own folder, found as `keras.src.backend.config` finds it.

    `$KERAS_HOME` if set, else `~/.keras`, or `/tmp/.keras` when the home
    folder is not writable.
    """
    if "KERAS_HOME" in os.environ:
        return os.environ["KERAS_HOME"]
    base = os.path.expanduser("~")
    return os.path.join(base if os.access(base, os.W_OK) else "/tmp", ".keras")


def selected_backend():
    """The backend Keras will load, read as Keras reads it, without importing it.

    A non-empty `KERAS_BACKEND` wins; else the "backend" key of
    `keras.json` in `keras_home()`; else Keras' default, tensorflow. A
    keras.json that is not valid JSON counts as absent, as in Keras.
    """
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    path = os.path.expanduser(os.path.join(keras_home(), "keras.json"))
    try:
        with open(path) as f:
            return json.load(f).get("backend", KERAS_DEFAULT_BACKEND)
    except (OSError, ValueError, AttributeError):
        return KERAS_DEFAULT_BACKEND


def check_backend(backend):
    """Returns `backend` if kdist supports it and it is installed; else raises
    UsageError naming where it was set (before Keras fails to import it)."""
    path = os.path.join(keras_home(), "keras.json")
    where = ("KERAS_BACKEND" if os.environ.get("KERAS_BACKEND") else
             f'"backend" in {path}' if os.path.exists(path) else None)
    if backend not in BACKENDS:
        raise UsageError(f"{where}={backend} is not supported; "
                         f"set it to one of: {', '.join(BACKENDS)}")
    if importlib.util.find_spec(backend) is None:
        chosen = (f"{where}={backend}" if where else
                  f"KERAS_BACKEND is unset, so Keras loads its default, {backend}")
        raise UsageError(f"{chosen}, which is not installed: install 'kdist[{backend}]', "
                         "or set KERAS_BACKEND to the backend you installed")
    return backend


def prepare_environment(replicas: int | None = None, verbose: bool = False) -> None:
    """Sets up this process for a kdist run; call it before Keras loads.

    The library works without it; `scripts/train.py` calls it first. Each
    effect, and how to turn it off:

    - JAX with `replicas` > 1: `XLA_FLAGS` asks for `replicas` CPU devices
      (`--xla_force_host_platform_device_count`; none when `replicas` is None).
    - TensorFlow with `replicas` > 1 and no GPU: imports TensorFlow and
      splits its CPU into `replicas` logical devices now, so a tf.data
      pipeline built before the run does not start TensorFlow with one.
    - Unless `verbose`: `TF_CPP_MIN_LOG_LEVEL=2` and `GRPC_VERBOSITY=ERROR`,
      only where they are unset (set them yourself to keep yours).
    - glibc keeps freed blocks of up to 64 MiB for reuse
      (`kdist.runtime.memory.keep_freed_memory`; `KDIST_KEEP_FREED_MEMORY=0` turns it off,
      `KDIST_KEEP_FREED_MIB=N` keeps blocks of up to N MiB).
    - JAX: after each long compile, the compiler's freed memory goes back to
      the kernel (`kdist.runtime.memory.release_after_long_compiles`, a
      `jax.monitoring` listener; `KDIST_RELEASE_COMPILER_MEMORY=0` turns it off).

    Raises UsageError for an unsupported backend (see `selected_backend`) or a
    `KDIST_KEEP_FREED_MIB` that is not a whole number of MiB.
    """
    backend = check_backend(selected_backend())
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # oneDNN/CUDA notices.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if backend == "jax" and replicas is not None and replicas > 1:
        set_host_device_count(replicas)
    if backend == "tensorflow" and replicas is not None and replicas > 1:
        with native_logs_silenced(not verbose):
            _split_tensorflow_cpu(replicas)
    memory.keep_freed_memory()
    if backend == "jax":
        memory.release_after_long_compiles()


def _split_tensorflow_cpu(count):
    """TensorFlow's CPU as `count` logical devices (`split_tensorflow_cpu`),
    unless it has GPUs; if it started already, the engine
    says what it found."""
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        split_tensorflow_cpu(count)


def split_tensorflow_cpu(count):
    """Splits TensorFlow's CPU into `count` logical devices, if TF has not started yet.

    The split must precede TensorFlow's first op, which is why engines are
    created before any tensor exists. Returns the logical CPU devices.
    """
    import tensorflow as tf  # Here: this module loads before any framework.

    if count > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError:
            pass  # Runtime already started: use the logical devices it has.
    return tf.config.list_logical_devices("CPU")


def set_host_device_count(count):
    """Asks XLA for `count` CPU devices (a no-op for GPUs), keeping other flags."""
    flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_COUNT_FLAG}={count}"])


def load_frameworks(quiet=True):
    """Imports Keras, which loads its backend, and TensorFlow where installed
    (Keras on any backend loads it for seeding and tf.data), their start-up
    notices hidden when `quiet` (`native_logs_silenced`)."""
    with native_logs_silenced(quiet):
        importlib.import_module("keras")
        if importlib.util.find_spec("tensorflow"):
            importlib.import_module("tensorflow")


@contextlib.contextmanager
def native_logs_silenced(enabled=True):
    """Hides what native code prints to stderr while the frameworks load.

    TensorFlow's C++ start-up notices (oneDNN, absl) ignore
    TF_CPP_MIN_LOG_LEVEL and go straight to file descriptor 2. Python
    exceptions are unaffected: they are printed after the block.
    """
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
