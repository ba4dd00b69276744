"""The CPU a benchmark runs on: its model, the flags that matter for speed, the
cores this process may use, and a measured matmul peak on the active backend.

`kdist-bench` records these in its header and in every JSON line, so figures
from different machines can be told apart and compared with what the CPU can
do. `parse_cpuinfo` reads Linux's /proc/cpuinfo text (x86 "model name" and
"flags"; Arm "Features", with "CPU part" as the model where there is no name).
Importing this module imports no framework; `matmul_gflops` imports Keras
when called.
"""

import os
import time

# The flags that decide which kernels the frameworks can use, in this order:
# x86 vector and matrix units (AVX2/FMA, AVX-512 and its bf16/fp16/VNNI
# forms, AMX tiles) and Arm's (NEON/ASIMD, SVE, bf16 and int8 matmul).
SPEED_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
               "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
               "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")
PEAK_SIZE = 2048  # Rows = columns of the square matmul `measure` times.
PEAK_SECONDS = 1.0  # How long each dtype's matmul is timed, after one warm-up call.
PEAK_DTYPES = ("float32", "bfloat16")


def parse_cpuinfo(text):
    """(model name or None, the `SPEED_FLAGS` present, in that order) of the first
    processor described in /proc/cpuinfo `text`."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields.get("flags") or fields.get("features"):
                break  # The first processor's block is complete.
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("cpu model") or (
        f"CPU part {fields['cpu part']}" if "cpu part" in fields else None)
    present = set((fields.get("flags") or fields.get("features") or "").split())
    return model, [flag for flag in SPEED_FLAGS if flag in present]


def visible_cores():
    """The cores this process may run on (its affinity mask, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # No sched_getaffinity outside Linux.
        return os.cpu_count()


def matmul_gflops(dtype="float32", size=PEAK_SIZE, seconds=PEAK_SECONDS):
    """GFLOP/s of a `size` x `size` matmul in `dtype` on the active Keras backend.

    One call first (it compiles and warms the caches), then calls one after
    the other until `seconds` have passed, each finished by reading one
    element back to the host (so asynchronous dispatch cannot overlap or
    flatter them, and no large copy is timed). A matmul costs 2 * size^3
    floating-point operations. The backend uses every core of the process's
    affinity mask, as training does.
    """
    import numpy as np
    from keras import (
        ops,  # Here: the command line imports this module before Keras loads.
    )

    a, b = (ops.cast(ops.convert_to_tensor(m), dtype) for m in
            np.random.default_rng(0).normal(size=(2, size, size)).astype(np.float32))

    def once():
        return float(ops.convert_to_numpy(ops.cast(ops.matmul(a, b)[0, 0], "float32")))

    once()
    calls, start = 0, time.perf_counter()
    while True:
        once()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * size ** 3 * calls / elapsed / 1e9


def describe(measure_peak=True, cpuinfo_path="/proc/cpuinfo"):
    """The CPU record of a benchmark: a flat dict for its JSON lines.

    Keys: cpu_model, cpu_flags (list), cpu_cores (visible to this process),
    and matmul_gflops_<dtype> for each of `PEAK_DTYPES` (None unless
    `measure_peak`). Model and flags are None and [] where `cpuinfo_path`
    cannot be read.
    """
    try:
        with open(cpuinfo_path) as f:
            model, flags = parse_cpuinfo(f.read())
    except OSError:
        model, flags = None, []
    record = dict(cpu_model=model, cpu_flags=flags, cpu_cores=visible_cores())
    for dtype in PEAK_DTYPES:
        record[f"matmul_gflops_{dtype}"] = (round(matmul_gflops(dtype), 1) if measure_peak
                                            else None)
    return record


def format_record(record):
    """One header line of `describe`'s record."""
    peaks = ", ".join(f"{record[f'matmul_gflops_{d}']:,.0f} {d}" for d in PEAK_DTYPES
                      if record.get(f"matmul_gflops_{d}") is not None)
    line = (f"CPU {record['cpu_model'] or 'unknown'}, {record['cpu_cores']} core(s) visible, "
            f"flags: {' '.join(record['cpu_flags']) or 'none of note'}")
    if peaks:
        line += f"; {PEAK_SIZE}x{PEAK_SIZE} matmul GFLOP/s: {peaks}"
    return line
