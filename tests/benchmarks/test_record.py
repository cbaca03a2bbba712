"""The machine facts every benchmark result carries: the CPU's instruction sets as the kernel
reports them, since the same code is a different program on an AVX2 and an AVX-512 host."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidegate.benchmarks.harness.measure import record


def cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("no flags line in /proc/cpuinfo")


def test_cpu_flags_are_the_kernels_list() -> None:
    flags = record.cpu_flags()
    assert flags == cpuinfo_flags()
    assert ("avx512f" in flags) <= ("avx2" in flags)  # no AVX-512 CPU lacks AVX2


def test_machine_names_the_vector_instruction_sets() -> None:
    simd = record.machine()["cpu_simd"]
    have = cpuinfo_flags()
    assert simd == [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f in have]
