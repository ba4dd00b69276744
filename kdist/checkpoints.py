"""Atomic, backend-portable checkpoints: one Keras `.weights.h5` file each.

A checkpoint is what `model.save_weights` writes for a model compiled with its
optimizer (model variables plus optimizer variables, iteration count
included), with kdist's own state (epoch, step, seed, history, ...) as a JSON
attribute on the file's root. Any Keras backend reads it, and
`model.load_weights(path)` works on it directly.

Writes go to a temporary name in the same folder, are flushed to disk, then
renamed: a crash leaves the previous checkpoints and at most a `.tmp-` file,
which the next start removes. The newest `keep` checkpoints are kept; a run
that started over (--no-resume) replaces the old run's checkpoints only when
it writes its first one.
"""

import glob
import json
import os
import re
import shutil
import tempfile
import warnings

import h5py

FORMAT = "kdist-checkpoint-1"
_NAME = re.compile(r"^ckpt-(\d{8})\.weights\.h5$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or does not fit the model."""


def model_signature(model):
    """The shapes of the model's weights, in order: what a checkpoint must match.

    Shapes, not variable paths: paths carry auto-generated layer names that
    differ between two instances of the same model.
    """
    return [list(v.shape) for v in model.weights]


def read_metadata(path):
    """kdist's state stored in checkpoint `path`; raises if it is not one."""
    with h5py.File(path, "r") as f:
        meta = json.loads(f.attrs["kdist"])
    if meta.get("format") != FORMAT:
        raise ValueError(f"unknown checkpoint format {meta.get('format')!r}")
    return meta


class CheckpointManager:
    """Saves, lists, prunes and restores the checkpoints of one folder."""

    def __init__(self, directory, keep=3):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = directory
        self.keep = keep

    def prepare(self):
        """Creates the folder, proves it is writable and removes leftovers.

        Run before training so a bad folder fails in seconds, not after an epoch.
        """
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f"{_TMP_PREFIX}probe-{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint folder {self.directory} is not writable ({e.strerror}); "
                "pass --checkpoint-dir with a folder you can write") from e
        for leftover in glob.glob(os.path.join(self.directory, _TMP_PREFIX + "*")):
            os.remove(leftover)

    def paths(self):
        """Checkpoint paths, oldest first."""
        names = [n for n in os.listdir(self.directory) if _NAME.match(n)] \
            if os.path.isdir(self.directory) else []
        return [os.path.join(self.directory, n) for n in sorted(names)]

    def save(self, model, step, metadata):
        """Writes checkpoint `step` atomically and prunes old ones; returns its path."""
        final = os.path.join(self.directory, f"ckpt-{step:08d}.weights.h5")
        tmp = os.path.join(self.directory, f"{_TMP_PREFIX}{os.getpid()}-ckpt.weights.h5")
        meta = dict(metadata, format=FORMAT, step=step, signature=model_signature(model))
        try:
            model.save_weights(tmp)
            with h5py.File(tmp, "a") as f:
                f.attrs["kdist"] = json.dumps(meta)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_directory(self.directory)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        # Checkpoints past `step` belong to a run this one replaces (--no-resume).
        kept = [p for p in self.paths() if p <= final]
        for old in set(self.paths()) - set(kept[-self.keep:]):
            os.remove(old)
        return final

    def latest(self):
        """(path, metadata) of the newest readable checkpoint, or None.

        A checkpoint that cannot be read (truncated, corrupt, not a kdist
        file) is skipped with a warning naming it.
        """
        for path in reversed(self.paths()):
            try:
                return path, read_metadata(path)
            except Exception as e:  # h5py raises several types for bad files.
                warnings.warn(f"skipping unreadable checkpoint {path}: "
                              f"{type(e).__name__}: {e}", stacklevel=2)
        return None


def latest_checkpoint(directory):
    """Path of the newest readable checkpoint in `directory`, or None."""
    latest = CheckpointManager(directory).latest()
    return latest[0] if latest else None


def restore(model, path, metadata=None):
    """Loads checkpoint `path` into `model` (and its compiled optimizer).

    Raises `CheckpointError` if the checkpoint was written for another model.
    """
    metadata = metadata or read_metadata(path)
    if metadata["signature"] != model_signature(model):
        raise CheckpointError(
            f"{path} was written for a different model; use another "
            "--checkpoint-dir, or --no-resume to start over")
    model.load_weights(path)
    return metadata


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiscardingManager:
    """Where a worker other than the chief saves: a private folder, removed at once.

    Only the chief writes to --checkpoint-dir, so two workers never write the
    same file. The others still run the whole save, as TensorFlow's
    MultiWorkerMirroredStrategy guide prescribes: every worker then executes
    the same code, and a save that needs the other workers (a collective, as
    `tf.train.Checkpoint` can) cannot deadlock. Keras' `save_weights` reads
    each worker's local copy of the (identical) variables and needs no
    collective, so the copy is only thrown away; it costs one small file write.
    """

    def save(self, model, step, metadata):
        folder = tempfile.mkdtemp(prefix=f"kdist-worker-{os.getpid()}-")
        try:
            return CheckpointManager(folder, keep=1).save(model, step, metadata)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
