"""Process start-up that must happen before Keras and its backend are imported.

Importing this module imports no framework. Both engines read their device
settings once, when they initialise: JAX reads `XLA_FLAGS` when its CPU
backend starts, and TensorFlow's logical CPU split (done by the TF engine) must
precede its first op. So `prepare_environment` runs first thing.
"""

import contextlib
import os
import re
import sys

SUPPORTED_BACKENDS = ("tensorflow", "jax")


class UsageError(ValueError):
    """The request cannot be met as asked (a flag or setting to change).

    The command line reports it like argparse does: one line, exit status 2.
    """
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def selected_backend():
    """The backend Keras will load: `KERAS_BACKEND`, else Keras' default."""
    return os.environ.get("KERAS_BACKEND", "tensorflow")


def prepare_environment(replicas=None, verbose=False):
    """Sets the environment for `replicas` CPU devices and quiet start-up logs.

    Raises UsageError for an unsupported `KERAS_BACKEND`.
    """
    backend = selected_backend()
    if backend not in SUPPORTED_BACKENDS:
        raise UsageError(f"KERAS_BACKEND={backend} is not supported; "
                         f"set it to one of: {', '.join(SUPPORTED_BACKENDS)}")
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # oneDNN/CUDA notices.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if backend == "jax" and replicas is not None and replicas > 1:
        set_host_device_count(replicas)


def set_host_device_count(count):
    """Asks XLA for `count` CPU devices (a no-op for GPUs), keeping other flags."""
    flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_COUNT_FLAG}={count}"])


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
