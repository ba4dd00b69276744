"""The checkpoints of one folder: saving (a `Snapshot` taken in memory, then written
atomically), listing by training progress, pruning, and the newest valid one
(`CheckpointManager`); `DiscardingManager` for the workers that do not write."""

import dataclasses
import errno
import os
import re
import shutil
import tempfile
import warnings

from kdist import checks, hints
from kdist.checkpoints import ckptfile, runlock
from kdist.checkpoints.reading import (
    CheckpointWarning,
    failure_reason,
    model_signature,
    progress,
    read_metadata,
    read_verified,
)
from kdist.config import TrainConfig
from kdist.errors import CheckpointError

FORMAT = ckptfile.FORMAT
_NAME = re.compile(r"^ckpt-(\d{8})\.weights\.h5$")
_TMP_PREFIX = ".tmp-"
_TMP = re.compile(r"^\.tmp-\d+-(ckpt\.weights\.h5|probe)$")  # What kdist writes, by name.


def _warn(message):
    warnings.warn(message, CheckpointWarning, stacklevel=3)


class CheckpointManager:
    """Saves, lists, prunes and restores the checkpoints of one folder."""

    def __init__(self, directory, keep=TrainConfig.keep):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        # Resolved once: a later os.chdir must not move the run's writes, and its
        # pruning, into another folder.
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.lock = runlock.RunLock(self.directory)

    def check(self):
        """Raises CheckpointError where the folder cannot be made as a folder or
        written, making nothing: `train_and_evaluate` runs it before any work."""
        existing = checks.nearest_existing(self.directory)
        problem = ("is a file, not a folder" if not os.path.isdir(existing)
                   else "is not writable" if not os.access(existing, os.W_OK) else None)
        if problem:
            raise CheckpointError(f"checkpoint folder {self.directory}: {existing} {problem}; "
                                  "pass --checkpoint-dir with a folder you can write")

    def prepare(self, lock=False, break_lock=False):
        """Creates the folder, proves it is writable, optionally locks it, removes leftovers.

        Run before training so a bad folder fails in seconds, not after an
        epoch. With `lock`, the folder's run lock is taken first (see
        `kdist.checkpoints.runlock`), so leftovers of a live run are never touched.
        """
        self.check()
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f"{_TMP_PREFIX}{os.getpid()}-probe")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint folder {self.directory} is not writable ({e.strerror}); "
                "pass --checkpoint-dir with a folder you can write") from e
        if lock:
            self._lock(break_lock)
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if _TMP.match(name) and os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)

    def _lock(self, force):
        try:
            replaced = self.lock.acquire(force)
        except runlock.LockHeld as e:
            raise CheckpointError(
                f"checkpoint folder {self.directory} is in use by another run ({e}); "
                "wait for it to end, use another --checkpoint-dir, or pass --break-lock "
                "if that run is gone") from None
        except OSError as e:
            raise CheckpointError(f"cannot lock checkpoint folder {self.directory}: "
                                  f"{e.strerror or e}") from None
        if replaced is not None:
            forced = force and not runlock.is_stale(replaced)
            why = f"forced by {hints.name('--break-lock')}" if forced else "its process is gone"
            _warn(f"took over the lock of {self.directory} from "
                  f"{runlock.describe(replaced)} ({why})")

    def release(self):
        """Releases the folder's run lock if this process holds it. A lock file that
        cannot be removed (the folder turned read-only) is a warning, not an
        error: the run's own error, if any, is the one to see, and the next run
        takes a lock of a process that is gone over."""
        try:
            self.lock.release()
        except OSError as e:
            _warn(f"could not remove {self.lock.path}: {e.strerror or e}; the next run "
                  "takes it over once this process has ended")

    def _scan(self):
        """(kdist's checkpoints as (progress, path, metadata), oldest first;
        (path, reason) of other files named like checkpoints)."""
        try:
            names = sorted(n for n in os.listdir(self.directory) if _NAME.match(n))
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint folder {self.directory}: "
                                  f"{e.strerror or e}") from None
        ours, others = [], []
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                meta = read_metadata(path)
            except Exception as e:  # h5py raises several types for bad files.
                others.append((path, failure_reason(e)))
                continue
            ours.append((progress(meta), path, meta))
        ours.sort(key=lambda item: item[:2])
        return ours, others

    def paths(self):
        """Paths of the checkpoints kdist wrote, oldest first (by training progress)."""
        return [path for _, path, _ in self._scan()[0]]

    def save(self, model, step, metadata):
        """Writes checkpoint `step` atomically and prunes old ones; returns its path."""
        return self.write(take_snapshot(model, step, metadata))

    def write(self, snapshot):
        """Writes a `Snapshot` as checkpoint `ckpt-<its step>` atomically and prunes old
        ones; returns its path. Raises `CheckpointError` (non-finite values, a failed
        write); earlier checkpoints stay as they were."""
        final = self._path_for(snapshot)
        try:
            data = ckptfile.finish(snapshot.taken, snapshot.metadata)
        except ckptfile.NonFiniteWeights as e:
            raise CheckpointError(
                f"refusing to write checkpoint {final}: the model has {e} (training "
                "diverged; try a lower --learning-rate); earlier checkpoints stay as "
                "they were") from None
        try:
            self._set_aside_foreign(final)
            self._write(final, data)
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoint in {self.directory}: "
                                  f"{e.strerror or e}") from None
        self._prune(final, progress(snapshot.metadata))
        return final

    def _path_for(self, snapshot):
        """`ckpt-<its step>`; where that name holds an older checkpoint (a resume
        with another global batch numbers the steps by the new steps per epoch),
        the step after the folder's highest, so no checkpoint is replaced before
        pruning's turn. A newer one there belongs to a run this one replaces."""
        final = os.path.join(self.directory, f"ckpt-{snapshot.step:08d}.weights.h5")
        try:
            older = progress(read_metadata(final)) < progress(snapshot.metadata)
        except Exception:  # noqa: BLE001 - none there, or not kdist's (set aside).
            return final
        if not older:
            return final
        steps = [int(m.group(1)) for m in map(_NAME.match, os.listdir(self.directory)) if m]
        return os.path.join(self.directory, f"ckpt-{max(steps) + 1:08d}.weights.h5")

    def _set_aside_foreign(self, final):
        """Renames a file kdist did not write that holds the name `final` needs."""
        if not os.path.lexists(final):
            return
        try:
            read_metadata(final)
            return  # kdist's own: replaced like any older checkpoint.
        except Exception as e:
            reason = failure_reason(e)
        aside = next(f"{final}.set-aside-{n}" for n in range(1, 10**6)
                     if not os.path.lexists(f"{final}.set-aside-{n}"))
        os.rename(final, aside)
        _warn(f"moved {final} to {aside}: kdist cannot tell it wrote it ({reason}) "
              "and needs its name")

    def _write(self, final, data):
        tmp = os.path.join(self.directory, f"{_TMP_PREFIX}{os.getpid()}-ckpt.weights.h5")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_directory(self.directory)
        except BaseException:
            _remove_if_present(tmp)
            raise

    def _prune(self, final, key):
        """Keeps the newest `keep` up to `final`; removes only kdist's own files."""
        ours, others = self._scan()
        for path, reason in others:
            _warn(f"leaving {path} in place: kdist cannot tell it wrote it ({reason})")
        # Checkpoints past `final` belong to a run this one replaces (--no-resume).
        kept = [path for k, path, _ in ours if k <= key and path != final] + [final]
        for _, path, _ in ours:
            if path not in kept[-self.keep:]:
                try:
                    os.remove(path)
                except OSError as e:
                    _warn(f"could not remove old checkpoint {path}: {e.strerror or e}")

    def latest(self):
        """(path, metadata) of the newest valid checkpoint, or None.

        A file that cannot be read, is not kdist's, fails its checksum or
        holds non-finite values is skipped with a warning naming it.
        """
        ours, others = self._scan()
        for path, reason in others:
            _warn(f"skipping {path}: not a readable kdist checkpoint ({reason})")
        for _, path, _ in reversed(ours):
            try:
                return path, read_verified(path)[1]
            except CheckpointError as e:
                _warn(f"skipping {e}")
        return None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A checkpoint taken in memory (`ckptfile.snapshot`), not yet written."""

    step: int
    metadata: dict
    taken: ckptfile.Buffer


def take_snapshot(model, step, metadata):
    """The `Snapshot` of `model` at global step `step`, with kdist's state `metadata`."""
    return Snapshot(step, dict(metadata, step=step, signature=model_signature(model)),
                    ckptfile.snapshot(model))


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_if_present(path):
    try:
        os.remove(path)
    except OSError as e:
        if e.errno != errno.ENOENT:
            warnings.warn(f"could not remove {path}: {e.strerror or e}", CheckpointWarning,
                          stacklevel=1)


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
        return self.write(take_snapshot(model, step, metadata))

    def write(self, snapshot):
        folder = tempfile.mkdtemp(prefix=f"kdist-worker-{os.getpid()}-")
        try:
            return CheckpointManager(folder, keep=1).write(snapshot)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
