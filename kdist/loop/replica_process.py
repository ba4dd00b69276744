"""One replica process's side of `kdist.loop.replicas.run`: it joins the others,
runs the pickled call, and sends its outcome to the parent through a pipe."""

import contextlib
import os
import pickle
import sys
import traceback
import warnings
from multiprocessing import connection

import cloudpickle

from kdist import hints
from kdist.errors import KdistError, TrainingError
from kdist.runtime import memory, startup
from kdist.workers import cluster, interrupt
from kdist.workers.processes import follow_launcher, silence_output

_SLOW_START = "this machine may lack the memory or CPU time to start every replica process"


def replica_main():
    """The entry point of one replica process (`python -c`, started by `run`)."""
    workers, rank, address, timeout, payload, fd, terms, heap = sys.argv[1:9]
    if heap == "keep":
        memory.keep_freed_memory()
    spec = cluster.ClusterSpec(int(workers), int(rank), (address,), float(timeout),
                               source=f"{workers} local replica processes")
    stop = interrupt.StopRequest()
    pipe = _ParentPipe(int(fd), stop)
    follow_launcher(stop)  # The parent: gone, it cannot stop this process.
    chief = spec.worker_index == 0

    def log(line):
        if chief:
            pipe.send(("log", line))

    try:
        with interrupt.stop_on_signals(stop, escalate=False), (  # `run` ends it if need be.
                hints.command_line() if terms == "flags" else contextlib.nullcontext()):
            # Start-up notices hidden as in the parent, whose
            # `startup.prepare_environment` sets TF_CPP_MIN_LOG_LEVEL unless --verbose.
            startup.load_frameworks(quiet="TF_CPP_MIN_LOG_LEVEL" in os.environ)
            with open(payload, "rb") as f:
                sys.path[:] = pickle.load(f)
                warnings.showwarning = pickle.load(f)
                settings = pickle.load(f)
                modules = pickle.load(f)
                fn, kwargs = pickle.load(f)
            if not chief:  # Every replica reads one checkpoint folder: the chief tells.
                from kdist.checkpoints import CheckpointWarning

                warnings.simplefilter("ignore", CheckpointWarning)
            import keras  # And the backend.

            from kdist import engines
            from kdist.loop import building, pickled

            pickled.check_modules(modules)
            names = settings.pop("names", {})
            for name, value in settings.items():  # The parent's, in its order.
                getattr(keras.config, f"set_{name}")(value)
            building.continue_object_names(names)

            with cluster.connect_deadline(spec, remedy=_SLOW_START):
                engines.connect(spec)
            result = fn(**kwargs, log=log, stop=stop)
        pipe.send(("ok", result if chief else None))
    except BaseException as e:  # noqa: BLE001 (every outcome goes to the parent)
        pipe.send(("error", _portable(e)))
    finally:
        pipe.close()


class _ParentPipe:
    """The pipe to the parent. Once the parent is gone (the pipe is broken), what
    is sent is dropped, `stop` is requested as SIGTERM would (the processes
    agree on a step, the chief checkpoints), and nothing more is printed: the
    parent's output may be gone with it."""

    def __init__(self, fd, stop):
        self.pipe = connection.Connection(fd, readable=False)
        self.stop = stop
        self.gone = False

    def send(self, item):
        if self.gone:
            return
        try:
            self.pipe.send(item)
        except OSError:  # BrokenPipeError: the parent was killed.
            self.gone = True
            if not self.stop:
                self.stop.request("SIGTERM")

    def close(self):
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:
            self.gone = True
        if self.gone:  # Nothing left to print to: Python's own flush at exit stays quiet.
            silence_output()


def _portable(error):
    """(class, message, attributes, traceback, pickled) of `error`: a kdist error
    comes back as itself; any other with its traceback, as itself where its
    class, arguments and attributes pickle (`pickled`, their cloudpickle bytes;
    else None), as a TrainingError with its type and message where they do not."""
    if isinstance(error, KdistError):
        return type(error), str(error), dict(vars(error)), None, None
    itself = None
    if isinstance(error, Exception):  # Not an exit or a KeyboardInterrupt.
        try:
            itself = cloudpickle.dumps((type(error), error.args, dict(vars(error))))
        except Exception:  # noqa: BLE001 - what does not pickle comes as a TrainingError.
            pass
    return (TrainingError, f"{type(error).__name__}: {error}", {},
            "".join(traceback.format_exception(error)), itself)
