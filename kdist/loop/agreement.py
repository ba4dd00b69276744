"""The workers of a run start alike, or none of them trains.

Each worker runs its own copy of the script; kdist broadcasts the chief's
weights, but nothing else of one worker's reaches the others. Workers given
other flags or data, or checkpoint folders that are not one folder, would
train on (some hang in a collective, some train from other steps, some end
first). So before the first step every worker sends what its run counts
in, and every worker raises the same `UsageError` where they differ.
"""

import zlib

import numpy as np

from kdist import tree
from kdist.errors import UsageError

_LIMIT = 2 ** 24  # What `Engine.workers_values` carries exactly.


def check_workers_agree(engine, facts):
    """Raises the same UsageError on every worker where their `facts`, {name:
    int or None}, differ (no communication with one worker)."""
    if engine.shard[1] == 1:
        return
    names = list(facts)
    encoded = [_encode(facts[name]) for name in names]
    rows = engine.workers_values(encoded)
    for column, name in enumerate(names):
        seen = [row[column] for row in rows]
        if len(set(seen)) > 1:
            values = ", ".join(f"worker {i}: {_decode(v)}" for i, v in enumerate(seen))
            hint = (" (each worker resumes from the newest checkpoint it sees: give every "
                    "worker one checkpoint folder, on a file system they share)"
                    if name == "resume steps" else "")
            raise UsageError(f"the workers start with different {name} ({values}){hint}; "
                             "start every worker with the same script, flags and data")


def fingerprint(batch):
    """A number for some rows of data (`tree` arrays): equal rows, equal numbers."""
    digest = 0
    for array in tree.leaves(batch):
        digest = zlib.crc32(np.ascontiguousarray(array).tobytes(), digest)
    return digest % _LIMIT


def _encode(value):
    return _LIMIT - 1 if value is None else int(value) % (_LIMIT - 1)


def _decode(value):
    return "none" if value == _LIMIT - 1 else value
