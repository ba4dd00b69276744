"""Process start-up settings (`kdist.startup`), each checked in a fresh process."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

# Allocates and frees a 64 MB buffer (numpy allocates through malloc) and
# prints what glibc's mallinfo2 says: bytes in separate mappings while the
# buffer lives (more than before it), then bytes of heap the process still holds after the free.
_ALLOCATE_AND_FREE = """
import ctypes, sys
import numpy as np
sys.path.insert(0, {repo!r})
from kdist import startup

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
print(startup.keep_freed_memory())
mapped_before = mallinfo2().hblkhd
buffer = np.ones(1 << 24, np.float32)
mapped = mallinfo2().hblkhd - mapped_before
del buffer
print(mapped, mallinfo2().arena)
"""
_BUFFER_BYTES = 64 << 20


def _allocate_and_free(keep):
    env = dict(os.environ, KDIST_KEEP_FREED_MEMORY="1" if keep else "0")
    result = subprocess.run([sys.executable, "-c", _ALLOCATE_AND_FREE.format(repo=REPO)],
                            env=env, capture_output=True, text=True, check=True)
    applied, mapped, heap_after_free = result.stdout.split()
    return applied == "True", int(mapped), int(heap_after_free)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_stays_in_the_heap_for_reuse():
    applied, mapped, heap_after_free = _allocate_and_free(keep=True)
    assert applied
    assert mapped == 0  # Served from the heap, not a fresh mapping to fault in.
    assert heap_after_free >= _BUFFER_BYTES  # Not handed back: the next call reuses it.


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_opting_out_keeps_the_c_library_default():
    # The control: by default glibc maps a 64 MB block anew and unmaps it on free.
    applied, mapped, heap_after_free = _allocate_and_free(keep=False)
    assert not applied
    assert mapped >= _BUFFER_BYTES
    assert heap_after_free < _BUFFER_BYTES
