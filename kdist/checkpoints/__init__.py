"""Atomic, verified, backend-portable checkpoints: one Keras `.weights.h5` file each.

A checkpoint is what `model.save_weights` writes for a model compiled with its
optimizer (model variables plus optimizer variables, iteration count
included), with kdist's own state (epoch, step, seed, history, a checksum,
...) as a JSON attribute on the file's root (`kdist.checkpoints.ckptfile`). Any Keras
backend reads it, and `model.load_weights(path)` works on it directly.

Files are named `ckpt-<global step>.weights.h5`, but ordered by training
progress, (epoch, step in the epoch) from their metadata: the global step
depends on the global batch, which a resumed run may change. A checkpoint is
trusted only after its checksum and values check out; one that fails is
skipped, with a warning naming it, for the newest one that passes. No
checkpoint with non-finite values is written.

A save is two parts: `take_snapshot` (the file in memory, as the model is now)
and `CheckpointManager.write` (checks, writes, prunes), which
`kdist.checkpoints.background` runs on a thread of its own. Writes go to a
temporary name in the same folder, are flushed to disk, then renamed: a failed
write (a full disk, a read-only file system) leaves the previous checkpoints,
removes the temporary file and raises `CheckpointError` naming the folder and
the cause. The newest `keep` checkpoints are kept; a run that started over
(--no-resume) replaces the old run's checkpoints only when it writes its first
one. Only files with kdist's metadata are ever removed; others are left in
place with a warning.
"""

from kdist.checkpoints.manager import FORMAT as FORMAT
from kdist.checkpoints.manager import CheckpointManager as CheckpointManager
from kdist.checkpoints.manager import DiscardingManager as DiscardingManager
from kdist.checkpoints.manager import Snapshot as Snapshot
from kdist.checkpoints.manager import take_snapshot as take_snapshot
from kdist.checkpoints.reading import CheckpointWarning as CheckpointWarning
from kdist.checkpoints.reading import model_signature as model_signature
from kdist.checkpoints.reading import progress as progress
from kdist.checkpoints.reading import read_metadata as read_metadata
from kdist.checkpoints.reading import restore as restore
from kdist.errors import CheckpointError as CheckpointError


def latest_checkpoint(directory: str) -> str | None:
    """Path of the newest valid checkpoint in `directory`, or None."""
    latest = CheckpointManager(directory).latest()
    return latest[0] if latest else None
