"""Nested structures of arrays: a batch's x, y or sample weights as one array or
a tuple, list or dict of them."""

import zlib
from typing import TypeAlias

import numpy as np

Arrays: TypeAlias = np.ndarray | tuple["Arrays", ...] | list["Arrays"] | dict[str, "Arrays"]
"""A NumPy array, or a tuple, list or dict of `Arrays` (x, y or sample weights)."""


def map_arrays(fn, *structures):
    """`fn` over the arrays of same-shaped structures (tuple, list, dict, None)."""
    first = structures[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {key: map_arrays(fn, *(s[key] for s in structures)) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(map_arrays(fn, *parts) for parts in zip(*structures))
    return fn(*structures)


def leaves(structure):
    """The arrays of a structure, in order."""
    found: list = []
    map_arrays(found.append, structure)
    return found


def num_examples(structure):
    return len(leaves(structure)[0])


def take_rows(batch, rows):
    """The `rows` (an index array or a slice) of every array of `batch`."""
    return tuple(map_arrays(lambda a: a[rows], part) for part in batch)


CHECKSUM_LIMIT = 2 ** 24  # Checksums are exact in float32, as collectives carry them.


def checksum(arrays):
    """A number in [0, CHECKSUM_LIMIT) for NumPy arrays: equal arrays, equal numbers."""
    digest = 0
    for array in arrays:
        digest = zlib.crc32(np.ascontiguousarray(array).tobytes(), digest)
    return digest % CHECKSUM_LIMIT
