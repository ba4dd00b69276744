"""Every error kdist raises on purpose, under one base class, `KdistError`.

Callers catch `kdist.KdistError` for "kdist refused or could not go on, and
the message says why"; the subclasses say what kind, and the command line
maps each kind to its exit status in one table (`kdist.cli`). Each class
also keeps the built-in base it had before the hierarchy existed
(`UsageError` is still a `ValueError`, ...), so older `except` clauses work.

Importing this module imports no framework: the command line needs these
classes before TensorFlow or JAX load. The classes are also importable from
the modules that raise them (`kdist.runtime.startup.UsageError`, `kdist.errors.DataError`, ...).

    KdistError
    ├── UsageError         a flag or setting to change (the CLI: exit status 2)
    │   └── ReplicaPerProcess  several replicas asked of one torch process
    ├── DataError          the data set is missing, incomplete or corrupt
    ├── CheckpointError    a checkpoint cannot be written, read or used
    │   ├── InvalidCheckpoint  a file that is not a valid kdist checkpoint
    │   ├── NonFiniteWeights   a model with NaN/inf values, not written
    │   └── LockHeld           another run holds the checkpoint folder
    ├── MetricsError       a metrics file cannot be written
    ├── TrainingError      training cannot go on (a non-finite loss)
    │   └── WorkerLost     another worker went away mid-run
    └── Interrupted        stopped on a signal after a checkpoint (128 + signal)
"""

import signal


class KdistError(Exception):
    """The base of every error kdist raises on purpose; its message is one line for the user."""


class UsageError(KdistError, ValueError):
    """The request cannot be met as asked (a flag or setting to change).

    The command line reports it like argparse does: one line, exit status 2.
    """


class ReplicaPerProcess(UsageError):
    """Several replicas asked of one process of an engine that runs one replica
    per process (torch): the loop or a launcher starts the processes."""


class DataError(KdistError, RuntimeError):
    """The data set is missing, incomplete or corrupt."""


class CheckpointError(KdistError, RuntimeError):
    """A checkpoint cannot be written or read, or does not fit the model."""


class InvalidCheckpoint(CheckpointError, ValueError):
    """A file that is not a kdist checkpoint, or one that fails verification."""


class NonFiniteWeights(CheckpointError, ValueError):
    """The model holds NaN or infinite values; `names` lists where."""

    def __init__(self, names):
        super().__init__(f"non-finite values in {', '.join(names[:3])}"
                         + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
        self.names = names


class LockHeld(CheckpointError):
    """Another run holds the checkpoint folder's lock; the message names it."""


class MetricsError(KdistError, RuntimeError):
    """A metrics file cannot be written (a full disk, a folder gone)."""


class TrainingError(KdistError, RuntimeError):
    """Training cannot go on (e.g. a non-finite loss)."""


class WorkerLost(TrainingError):
    """A collective with the other workers failed mid-run: another worker stopped
    or its machine went away. The message names the framework's cause."""


LOST_WORKERS = "lost the other workers mid-run"
"""How a `WorkerLost` message begins (`kdist-launch` looks for it in the output)."""


class Interrupted(KdistError, RuntimeError):
    """Training stopped on a signal, after writing a checkpoint (or before its
    first step, where there was nothing to write).

    `signal_name` is the signal this process received ("SIGTERM", ...), or
    None when another worker's signal, or the `stop` object given to
    `train_and_evaluate`, stopped it. `where` says where the run stopped and
    what it saved (the message after its cause), or None before any step.
    """

    def __init__(self, message, signal_name=None, where=None):
        super().__init__(message)
        self.signal_name = signal_name
        self.where = where

    @property
    def exit_status(self) -> int:
        """What a script that ends here exits with, as a process killed by the signal
        would: 128 + its number (SIGTERM's where another worker's signal stopped it).
        `kdist-launch` counts a worker that exits so as stopped, not failed."""
        return 128 + getattr(signal, self.signal_name or "SIGTERM")
