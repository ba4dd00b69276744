"""The CPU record of the benchmark (`kdist.bench.cpuinfo`)."""

import os

import pytest

from kdist.bench import cpuinfo

# Nothing here depends on the backend (the benchmark's CPU record): one session runs it.
pytestmark = pytest.mark.any_backend

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512fx avx512_bf16 amx_tile amx_bf16 avx

processor\t: 1
model name\t: Another CPU
flags\t\t: fpu sse2 amx_int8
"""

ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes sve bf16 i8mm
CPU implementer\t: 0x41
CPU part\t: 0xd40

processor\t: 1
Features\t: fp
"""


def test_the_first_processors_model_and_speed_flags_in_a_fixed_order():
    # Only whole flags count: avx512fx is not avx512f; the second processor is ignored.
    assert cpuinfo.parse_cpuinfo(X86) == ("Intel(R) Xeon(R) Platinum 8480+",
                                          ["avx", "avx2", "fma", "avx512f", "avx512_bf16",
                                           "amx_tile", "amx_bf16"])


def test_arm_features_and_part_number_stand_in_for_flags_and_model():
    assert cpuinfo.parse_cpuinfo(ARM) == ("CPU part 0xd40", ["asimd", "sve", "bf16", "i8mm"])
    assert cpuinfo.parse_cpuinfo("") == (None, [])


def test_the_record_reads_the_file_and_counts_the_cores_of_the_affinity_mask(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(X86)
    record = cpuinfo.describe(measure_peak=False, cpuinfo_path=str(path))
    assert record == dict(cpu_model="Intel(R) Xeon(R) Platinum 8480+",
                          cpu_flags=["avx", "avx2", "fma", "avx512f", "avx512_bf16",
                                     "amx_tile", "amx_bf16"],
                          cpu_cores=len(os.sched_getaffinity(0)),
                          matmul_gflops_float32=None, matmul_gflops_bfloat16=None)
    line = cpuinfo.format_record(dict(record, matmul_gflops_float32=123.4))
    assert line.startswith("CPU Intel(R) Xeon(R) Platinum 8480+, ")
    assert "avx2 fma avx512f" in line and "123 float32" in line and "bfloat16" not in line
    missing = cpuinfo.describe(measure_peak=False, cpuinfo_path=str(tmp_path / "none"))
    assert (missing["cpu_model"], missing["cpu_flags"]) == (None, [])
    assert "CPU unknown" in cpuinfo.format_record(missing)


@pytest.mark.parametrize("dtype", cpuinfo.PEAK_DTYPES)
def test_matmul_gflops_is_a_positive_rate(dtype):
    rate = cpuinfo.matmul_gflops(dtype, size=64, seconds=0.02)
    # 64^3 * 2 flops in at least 1 us per call bounds it well under 1e6 GFLOP/s.
    assert 0 < rate < 1e6
