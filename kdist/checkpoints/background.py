"""Checkpoints written on a thread of their own while training goes on.

The step loop pauses only to take the snapshot (`kdist.checkpoints.take_snapshot`:
Keras' `save_weights` into memory); checking its values, the checksum, the
write to disk, the fsync, the rename and the pruning run on a background thread.
One write is in flight at a time: the next save waits for the one before, so
checkpoints land in order and memory holds at most two snapshots.

A write keeps every guarantee of `CheckpointManager.write`: until its rename
the older checkpoints are the newest on disk, so a process killed during the
write leaves them valid (and a temporary file, which the next run's `prepare`
removes). Its `CheckpointError` is raised by the next call that waits.
"""

import threading

from kdist.checkpoints import take_snapshot


class BackgroundWriter:
    """Saves through `manager` (a `CheckpointManager` or `DiscardingManager`),
    one write at a time, in the background."""

    def __init__(self, manager):
        self.manager = manager
        self._thread: threading.Thread | None = None
        self._outcome: str | BaseException | None = None

    def save(self, model, step, metadata):
        """Takes the snapshot of `model` at global step `step`, then starts its write
        once the write before it has ended. Returns the paths that write gave,
        as `written` does."""
        snapshot = take_snapshot(model, step, metadata)
        done = self.written(wait=True)
        self._thread = threading.Thread(target=self._write, args=(snapshot,),
                                        name="kdist-checkpoint-writer")
        self._thread.start()
        return done

    def _write(self, snapshot):
        try:
            self._outcome = self.manager.write(snapshot)
        except BaseException as e:  # Raised where the loop waits for it.
            self._outcome = e

    def written(self, wait=False):
        """The path of the write that ended since the last call, in a list (empty
        if none has, or if it is still running and `wait` is false); raises the
        error it ended with."""
        if self._thread is None or (self._thread.is_alive() and not wait):
            return []
        self._thread.join()
        self._thread, outcome, self._outcome = None, self._outcome, None
        if isinstance(outcome, BaseException):
            raise outcome
        return [] if outcome is None else [outcome]

    @property
    def busy(self):
        """Whether a write is in flight or its outcome is not yet taken."""
        return self._thread is not None
