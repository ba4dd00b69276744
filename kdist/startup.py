"""Process start-up that must happen before Keras and its backend are imported.

Importing this module imports no framework. Both engines read their device
settings once, when they initialise: JAX reads `XLA_FLAGS` when its CPU
backend starts, and TensorFlow's logical CPU split (done by the TF engine) must
precede its first op. So `prepare_environment` runs first thing.
"""

import contextlib
import ctypes
import json
import os
import re
import sys

from kdist.errors import UsageError

BACKENDS = ("tensorflow", "jax")  # The Keras backends kdist has an engine for.

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
    """Returns `backend` if kdist supports it; else raises UsageError naming where it was set."""
    if backend not in BACKENDS:
        where = ("KERAS_BACKEND" if os.environ.get("KERAS_BACKEND")
                 else f'"backend" in {os.path.join(keras_home(), "keras.json")}')
        raise UsageError(f"{where}={backend} is not supported; "
                         f"set it to one of: {', '.join(BACKENDS)}")
    return backend


def prepare_environment(replicas=None, verbose=False):
    """Sets the environment for `replicas` CPU devices and quiet start-up logs.

    Raises UsageError for an unsupported backend (see `selected_backend`).
    """
    backend = check_backend(selected_backend())
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # oneDNN/CUDA notices.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if backend == "jax" and replicas is not None and replicas > 1:
        set_host_device_count(replicas)
    keep_freed_memory()


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # mallopt, <malloc.h>.
KEPT_BLOCK_BYTES = 64 << 20


def keep_freed_memory():
    """Makes glibc's malloc keep freed blocks of up to 64 MiB for reuse.

    Every compiled call of XLA (JAX) allocates its scratch memory anew: 34-39
    MiB per device for this CNN. glibc serves blocks over its mmap threshold
    (32 MiB at most, by default) with fresh mappings and returns a freed heap
    top over its trim threshold, so each call faulted its scratch in again:
    about 8,700 page faults and 11 ms per call on this project's 2-core
    machine, more than the 7 ms the train step itself takes. With both
    thresholds at 64 MiB such blocks stay in the heap; bigger ones (a data
    set) still get their own mapping and go back to the kernel when freed.

    With several devices each runs on its own thread, whose per-thread arena
    grows in heaps of at most 64 MiB: a scratch block that does not fit the
    current heap gets a new one, which glibc unmaps as soon as it is empty,
    whatever the trim threshold: 8,000-19,000 page faults per call in 11 of
    16 runs on 2 JAX devices, 10-30% of the step time. A 64 MiB top pad
    keeps such a heap.

    Returns whether it took effect: on a C library without `mallopt` (macOS,
    musl) nothing changes. `KDIST_KEEP_FREED_MEMORY=0` keeps the C library's
    defaults.
    """
    mallopt = libc_function("mallopt")
    if os.environ.get("KDIST_KEEP_FREED_MEMORY") == "0" or mallopt is None:
        return False
    return all([mallopt(_M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES) == 1,
                mallopt(_M_TRIM_THRESHOLD, KEPT_BLOCK_BYTES) == 1,
                mallopt(_M_TOP_PAD, KEPT_BLOCK_BYTES) == 1])


def release_freed_memory():
    """Hands the free pages of glibc's heaps back to the kernel (`malloc_trim`).

    Compiling a JAX train chunk leaves about 200 MB freed but resident in
    the compiler thread's heap, where the devices' threads never reuse it;
    released before the program first runs, the peak RSS of a 2-device run
    fell from 777 to 623 MB. Returns whether it ran (glibc only).
    """
    malloc_trim = libc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def libc_function(name):
    """The C library's function `name`, or None where it has none (`mallopt` on
    macOS or musl, `prctl` outside Linux)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


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
