"""Process start-up settings (`kdist.runtime.startup`, `kdist.runtime.memory`), each checked
in a fresh process."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from kdist.errors import UsageError
from kdist.runtime import memory, startup

# Every script starts with this: kdist importable, glibc's malloc, mallinfo2.
_PREAMBLE = """
import ctypes, sys
sys.path.insert(0, {repo!r})
from kdist.runtime import memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
"""
SCRATCH = 48 << 20  # Like XLA's per-call scratch for the CNN (34-39 MiB).
DATA = 4 * memory.KEPT_BLOCK_BYTES  # Like a data set: over the threshold.

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def _run(script, nbytes, keep=True, **variables):
    """Runs the preamble and `script` in a fresh Python, with the environment's
    `variables` too; returns its printed words."""
    env = dict(os.environ, KDIST_KEEP_FREED_MEMORY="1" if keep else "0")
    env.pop("KDIST_KEEP_FREED_MIB", None)
    env.update(variables)
    source = (_PREAMBLE + script).format(repo=REPO, nbytes=nbytes)
    result = subprocess.run([sys.executable, "-c", source], env=env,
                            capture_output=True, text=True, check=True)
    return result.stdout.split()


# Allocates and frees a buffer of N bytes (numpy allocates through malloc) and
# prints what mallinfo2 says: bytes in separate mappings while the buffer
# lives (more than before it), then bytes of heap still held after the free.
_ALLOCATE_AND_FREE = """
import numpy as np
print(memory.keep_freed_memory())
mapped_before = libc.mallinfo2().hblkhd
buffer = np.ones({nbytes} // 4, np.float32)
mapped = libc.mallinfo2().hblkhd - mapped_before
del buffer
print(mapped, libc.mallinfo2().arena)
"""


def _allocate_and_free(nbytes, keep):
    applied, mapped, heap_after_free = _run(_ALLOCATE_AND_FREE, nbytes, keep)
    assert applied == str(keep)
    return int(mapped), int(heap_after_free)


@linux_only
def test_freed_scratch_memory_stays_in_the_heap_for_reuse():
    mapped, heap_after_free = _allocate_and_free(SCRATCH, keep=True)
    assert mapped == 0  # Served from the heap, not a fresh mapping to fault in.
    assert heap_after_free >= SCRATCH  # Not handed back: the next call reuses it.


@linux_only
def test_blocks_over_the_threshold_still_go_back_to_the_kernel():
    mapped, heap_after_free = _allocate_and_free(DATA, keep=True)
    assert mapped >= DATA
    assert heap_after_free < SCRATCH


@linux_only
def test_opting_out_keeps_the_c_library_default():
    # The control: by default glibc maps the scratch anew and unmaps it on free.
    mapped, heap_after_free = _allocate_and_free(SCRATCH, keep=False)
    assert mapped >= SCRATCH
    assert heap_after_free < SCRATCH


# In a thread other than the main one (XLA runs each device's program on its
# own), glibc serves malloc from a per-thread arena made of heaps of at most
# 64 MiB. With a 40 MiB block held, a 40 MiB scratch block needs a second
# heap; the script prints how many bytes that heap's free handed back.
_THREAD_SCRATCH = """
import threading
print(memory.keep_freed_memory())
returned = []

def device_thread():
    held = libc.malloc({nbytes})
    scratch = libc.malloc({nbytes})
    before = libc.mallinfo2().arena
    libc.free(scratch)
    returned.append(before - libc.mallinfo2().arena)
    libc.free(held)

thread = threading.Thread(target=device_thread)
thread.start()
thread.join()
print(returned[0])
"""


@linux_only
def test_a_threads_freed_scratch_heap_stays_for_reuse():
    applied, returned = _run(_THREAD_SCRATCH, 40 << 20)
    assert applied == "True"
    # glibc's default unmaps a heap as soon as it is empty (the 64 MB munmap
    # per call seen with 2 JAX devices); with the top pad it stays.
    assert int(returned) == 0


# A thread allocates and frees a scratch block over the 64 MiB a per-thread
# arena's heap can hold (XLA's at 128 examples per device); prints the bytes
# mapped for it and the bytes of heap still held after the free.
_BIG_THREAD_SCRATCH = """
import threading
print(memory.keep_freed_memory())
found = []

def device_thread():
    mapped_before = libc.mallinfo2().hblkhd
    scratch = libc.malloc({nbytes})
    found.append(libc.mallinfo2().hblkhd - mapped_before)
    libc.free(scratch)
    found.append(libc.mallinfo2().arena)

thread = threading.Thread(target=device_thread)
thread.start()
thread.join()
print(*found)
"""
BIG_SCRATCH = 96 << 20


@linux_only
def test_a_threads_scratch_over_64_mib_is_mapped_anew_by_default():
    applied, mapped, heap_after_free = _run(_BIG_THREAD_SCRATCH, BIG_SCRATCH)
    assert applied == "True"
    assert int(mapped) >= BIG_SCRATCH  # A fresh mapping, faulted in at every step.
    assert int(heap_after_free) < BIG_SCRATCH


@linux_only
def test_a_bigger_kept_size_keeps_a_threads_big_scratch_in_the_heap():
    applied, mapped, heap_after_free = _run(_BIG_THREAD_SCRATCH, BIG_SCRATCH,
                                            KDIST_KEEP_FREED_MIB="256")
    assert applied == "True"
    assert int(mapped) == 0
    assert int(heap_after_free) >= BIG_SCRATCH  # Kept for the next step.


@pytest.mark.parametrize("text", ["0", "-5", "64M", "1.5", "4096"])
def test_a_kept_size_that_is_no_whole_number_of_mib_is_refused(monkeypatch, text):
    monkeypatch.setenv("KDIST_KEEP_FREED_MIB", text)
    with pytest.raises(UsageError, match=f"KDIST_KEEP_FREED_MIB={text}: .* whole number"):
        memory.kept_block_bytes()


def test_the_kept_size_is_read_in_mib(monkeypatch):
    monkeypatch.delenv("KDIST_KEEP_FREED_MIB", raising=False)
    assert memory.kept_block_bytes() == 64 << 20
    monkeypatch.setenv("KDIST_KEEP_FREED_MIB", "512")
    assert memory.kept_block_bytes() == 512 << 20


# Frees a 48 MiB block that the heap keeps (see above), then releases it:
# prints the resident KiB after the free and after the release.
_RELEASE = """
import numpy as np

def resident_kib():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])

memory.keep_freed_memory()
buffer = np.ones({nbytes} // 4, np.float32)
del buffer
kept = resident_kib()
print(memory.release_freed_memory(), kept, resident_kib())
"""


@linux_only
def test_released_memory_leaves_the_process():
    ran, kept_kib, released_kib = _run(_RELEASE, SCRATCH)
    assert ran == "True"
    assert int(kept_kib) - int(released_kib) >= (SCRATCH >> 10) * 9 // 10


def test_backend_comes_from_keras_json_when_keras_backend_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    assert startup.selected_backend() == "tensorflow"  # No keras.json: Keras' default.
    (tmp_path / "keras.json").write_text(json.dumps({"floatx": "float32", "backend": "jax"}))
    assert startup.selected_backend() == "jax"
    monkeypatch.setenv("KERAS_BACKEND", "")  # Empty: Keras ignores it.
    assert startup.selected_backend() == "jax"
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    assert startup.selected_backend() == "tensorflow"
    monkeypatch.delenv("KERAS_BACKEND")
    (tmp_path / "keras.json").write_text("{not json")
    assert startup.selected_backend() == "tensorflow"


def test_selected_backend_agrees_with_keras(tmp_path, monkeypatch):
    backend = os.environ["KERAS_BACKEND"]  # This session's, installed.
    (tmp_path / "keras.json").write_text(json.dumps({"backend": backend}))
    env = dict(os.environ, KERAS_HOME=str(tmp_path))
    del env["KERAS_BACKEND"]
    source = (f"import sys; sys.path.insert(0, {REPO!r}); from kdist.runtime import startup; "
              "chosen = startup.selected_backend(); import keras; "
              "print(chosen, keras.backend.backend())")
    result = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True,
                            text=True, check=True)
    assert result.stdout.split() == [backend, backend]


def test_unsupported_backend_in_keras_json_names_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "numpy"}))
    with pytest.raises(startup.UsageError, match=r'"backend" in .*keras.json=numpy'):
        startup.prepare_environment()


def test_importing_kdist_and_its_engine_changes_nothing_process_wide():
    source = (f"import importlib, os, sys; sys.path.insert(0, {REPO!r}); "
              "import keras; before = dict(os.environ); "  # Keras sets some itself.
              "import kdist; from kdist.loop import training; from kdist.runtime import memory; "
              "importlib.import_module('kdist.engines.' + keras.backend.backend()); "
              "print(dict(os.environ) == before, memory._listening)")
    result = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


class _Counter:
    """A page fault count that the test advances (`_epoch`)."""

    def __init__(self):
        self.value = 0

    def __call__(self):
        return self.value


def _epoch(meter, counter, chunks, per_step, first_chunk=0, steps_per_chunk=8):
    """Runs an epoch of `chunks` chunks through `meter`; returns its hint."""
    meter.start_epoch()
    for k in range(chunks):
        counter.value += first_chunk if k == 0 else per_step * steps_per_chunk
        meter.after_chunk((k + 1) * steps_per_chunk)
    return meter.hint()


@pytest.fixture
def kept(monkeypatch):
    monkeypatch.setattr(memory, "_kept", True)
    monkeypatch.delenv("KDIST_KEEP_FREED_MIB", raising=False)


def test_steps_that_fault_in_fresh_memory_get_one_hint(kept):
    counter = _Counter()
    meter = memory.FaultMeter(counter)
    pages_per_mib = (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    hint = _epoch(meter, counter, chunks=4, per_step=72 * pages_per_mib)
    assert hint.startswith("Each train step faulted in about 72 MiB of fresh memory")
    assert "KDIST_KEEP_FREED_MIB=512" in hint
    assert _epoch(meter, counter, chunks=4, per_step=72 * pages_per_mib) is None  # Once.


@pytest.mark.parametrize("mib, suggested", [(72, 512), (600, 1024), (1500, 2047), (9000, 2047)])
def test_the_hint_suggests_a_kept_size_that_holds_a_steps_fresh_memory(kept, mib, suggested):
    counter = _Counter()
    pages_per_mib = (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    hint = _epoch(memory.FaultMeter(counter), counter, chunks=4, per_step=mib * pages_per_mib)
    assert f"about {mib:,} MiB" in hint and f"KDIST_KEEP_FREED_MIB={suggested} " in hint


def test_the_first_chunks_compile_and_few_faults_give_no_hint(kept):
    counter = _Counter()
    meter = memory.FaultMeter(counter)
    # Half a million faults while compiling, then 100 per step: a steady step.
    assert _epoch(meter, counter, chunks=4, per_step=100, first_chunk=500_000) is None
    # Each epoch's window starts after its first chunk; 8 steps are the fewest judged.
    assert _epoch(meter, counter, chunks=1, per_step=10**6) is None


def test_no_hint_once_the_kept_size_is_set(kept, monkeypatch):
    monkeypatch.setenv("KDIST_KEEP_FREED_MIB", "512")
    counter = _Counter()
    assert _epoch(memory.FaultMeter(counter), counter, chunks=4, per_step=10**5) is None
