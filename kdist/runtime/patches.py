"""Attributes of a framework's module replaced while any thread needs them.

kdist replaces a few functions of Keras' loss module while a step runs (its
reductions over the global batch; on TensorFlow, no division of the losses by
the replica count). TensorFlow's `MirroredStrategy` runs each replica's step
on its own thread, the threads taking turns at each all-reduce, so a save and
restore per thread put back another thread's replacement: it then stayed for
the rest of the process (a later `fit` trained with twice the gradients), and
the code a replica ran after another had left ran with Keras' originals. A
`Patch` puts its replacements in when the first thread enters and the
originals, as they were when it was made, back when the last one leaves.

Importing this module imports no framework.
"""

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class Patch:
    """`replacements`: (owner, attribute name, value) triples; the owners'
    current values are the originals `active()` puts back."""

    def __init__(self, replacements: list[tuple[Any, str, Any]]):
        self.replacements = replacements
        self.originals = [(owner, name, getattr(owner, name))
                          for owner, name, _ in replacements]
        self._lock = threading.Lock()
        self._inside = 0  # Threads within `active()`.

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, on every thread, the owners hold the replacements."""
        with self._lock:
            if self._inside == 0:
                self._set(self.replacements)
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0:
                    self._set(self.originals)

    @staticmethod
    def _set(values: list[tuple[Any, str, Any]]) -> None:
        for owner, name, value in values:
            setattr(owner, name, value)
