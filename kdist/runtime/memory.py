"""glibc heap settings that keep XLA's per-call memory in the process, and hand
the compiler's back.

Nothing here runs on import: `kdist.runtime.startup.prepare_environment` calls
`keep_freed_memory` and, on JAX, `release_after_long_compiles`.
"""

import ctypes
import os

from kdist.errors import UsageError

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8  # <malloc.h>.
KEPT_BLOCK_BYTES = 64 << 20  # The default; `KDIST_KEEP_FREED_MIB` sets another.
MAX_KEPT_MIB = 2047  # mallopt takes a C int: 2 GiB and more would wrap around.
THREAD_HEAP_BYTES = 64 << 20  # The most a heap of a per-thread arena holds (64-bit glibc).
_kept = False  # Whether `keep_freed_memory` took effect in this process.


def keep_freed_memory():
    """Makes glibc's malloc keep freed blocks of up to 64 MiB (or
    `KDIST_KEEP_FREED_MIB`) for reuse.

    Every compiled call of XLA (JAX) allocates its scratch memory anew (tens
    of MiB per device for the tutorial CNN). glibc serves blocks over its mmap
    threshold (32 MiB at most, by default) with fresh mappings and returns a
    freed heap top over its trim threshold, so each call would fault its
    scratch in again, costing more than the step itself. With both
    thresholds at 64 MiB such blocks stay in the heap; bigger ones (a data
    set) still get their own mapping and go back to the kernel when freed.

    With several devices each runs on its own thread, whose per-thread arena
    grows in heaps of at most 64 MiB: a scratch block that does not fit the
    current heap gets a new one, which glibc unmaps as soon as it is empty,
    whatever the trim threshold. A 64 MiB top pad keeps such a heap.
    Eager torch frees and allocates its activations every step: without
    these settings glibc hands a freed block of several MiB back to the
    kernel and faults it in again at the next step (thousands of page faults
    per step for the tutorial CNN). (docs/performance.md has the measurements.)

    Bigger steps (XLA at 128 examples per device and more) allocate scratch
    blocks over 64 MiB, which a per-thread arena can never hold: glibc maps
    each anew. `KDIST_KEEP_FREED_MIB=N` keeps blocks of up to N MiB; over 64,
    every thread then allocates from glibc's one main arena, which has no
    such limit (at 64 per device that costs JAX a few percent).

    Returns whether it took effect: on a C library without `mallopt` (macOS,
    musl) nothing changes. `KDIST_KEEP_FREED_MEMORY=0` keeps the C library's
    defaults. Raises UsageError for a `KDIST_KEEP_FREED_MIB` that is not a
    whole number of MiB from 1 to 2047.
    """
    global _kept
    size = kept_block_bytes()
    mallopt = libc_function("mallopt")
    if os.environ.get("KDIST_KEEP_FREED_MEMORY") == "0" or mallopt is None:
        return False
    settings = [(_M_MMAP_THRESHOLD, size), (_M_TRIM_THRESHOLD, size),
                (_M_TOP_PAD, KEPT_BLOCK_BYTES)]
    if size > THREAD_HEAP_BYTES:
        settings.append((_M_ARENA_MAX, 1))
    _kept = all([mallopt(option, value) == 1 for option, value in settings])
    return _kept


def kept_block_bytes():
    """The largest freed block `keep_freed_memory` keeps: `KDIST_KEEP_FREED_MIB`
    MiB, or 64 MiB where it is unset."""
    text = os.environ.get("KDIST_KEEP_FREED_MIB", "").strip()
    if not text:
        return KEPT_BLOCK_BYTES
    if not text.isdigit() or not 1 <= int(text) <= MAX_KEPT_MIB:
        raise UsageError(f"KDIST_KEEP_FREED_MIB={text}: give the largest freed block to "
                         f"keep in MiB, a whole number from 1 to {MAX_KEPT_MIB} (unset: 64)")
    return int(text) << 20


def keeping_freed_memory():
    """Whether `keep_freed_memory` took effect in this process (the replica
    processes of `kdist.loop.replicas` then call it too)."""
    return _kept


def release_freed_memory():
    """Hands the free pages of glibc's heaps back to the kernel (`malloc_trim`).

    Compiling a JAX train chunk leaves a few hundred MB freed but resident in
    the compiler thread's heap, where the devices' threads never reuse it
    (docs/performance.md has the figures). Returns whether it ran (glibc only).
    """
    malloc_trim = libc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def libc_function(name):
    """The C library's function `name`, or None where it has none (`mallopt` on
    macOS or musl)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # XLA compiled a program.
LONG_COMPILE_SECONDS = 0.25
_listening = False


def release_after_long_compiles():
    """Hands the compiler's freed memory back after each compile of 0.25 s or more.

    A JAX train or eval chunk is such a compile; the release runs before the
    program first runs, so it lowers the peak RSS. Short compiles (eager ops)
    skip it, as a release costs tens of milliseconds. Registers a
    `jax.monitoring` listener once per process (importing JAX, which must
    not have started its backend yet only if device counts still change:
    importing does not start it). Returns whether it is registered;
    `KDIST_RELEASE_COMPILER_MEMORY=0` turns it off.
    """
    global _listening
    if os.environ.get("KDIST_RELEASE_COMPILER_MEMORY") == "0":
        return False
    if not _listening:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_after_compile)
        _listening = True
    return True


def _after_compile(event, duration_secs, **kwargs):
    if event == COMPILE_EVENT and duration_secs >= LONG_COMPILE_SECONDS:
        release_freed_memory()


FAULTS_PER_STEP_HINT = 4096  # Minor page faults (16 MiB of 4 KiB pages) per train step.
_MEASURED_STEPS = 8  # The fewest steps the hint is judged on.


class FaultMeter:
    """Counts the minor page faults of an epoch's train steps after its first
    chunk (which compiles), and says once when they suggest `KDIST_KEEP_FREED_MIB`.

    A step that faults in megabytes of fresh memory each time has scratch
    blocks over the kept size (`keep_freed_memory`). `faults` reads this
    process's count (`getrusage`; None where there is none).
    """

    def __init__(self, faults=None):
        self._faults = faults or _minor_faults
        self._said = False
        self._start: tuple[int, int] | None = None  # (faults, steps) after the first chunk.
        self._now = (0, 0)

    def start_epoch(self):
        self._start = None

    def after_chunk(self, steps_done):
        """After a chunk; `steps_done`: the epoch's steps so far in this call."""
        faults = self._faults()
        if faults is None:
            return
        if self._start is None:
            self._start = (faults, steps_done)
        self._now = (faults, steps_done)

    def hint(self):
        """The line to print once, after an epoch's steps, or None."""
        if self._said or self._start is None or not _kept:
            return None
        if os.environ.get("KDIST_KEEP_FREED_MIB"):
            return None
        steps = self._now[1] - self._start[1]
        per_step = (self._now[0] - self._start[0]) / steps if steps >= _MEASURED_STEPS else 0
        if per_step < FAULTS_PER_STEP_HINT:
            return None
        self._said = True
        mib = per_step * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
        return (f"Each train step faulted in about {mib:,.0f} MiB of fresh memory: setting "
                f"KDIST_KEEP_FREED_MIB={suggested_mib(mib)} may make the steps faster "
                f"(docs/library.md, Commands and flags)")


def suggested_mib(faulted_mib):
    """The kept size to suggest for steps that fault in `faulted_mib` each: 512, or
    the power of two that holds them all as one block, at most `MAX_KEPT_MIB`."""
    size = 512
    while size < faulted_mib and size < MAX_KEPT_MIB:
        size *= 2
    return min(size, MAX_KEPT_MIB)


def _minor_faults():
    try:
        import resource
    except ImportError:  # Not on Windows.
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
