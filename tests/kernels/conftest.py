"""Shared by the CPU kernel tests: the native kernels, or a skip where they do not build."""

from __future__ import annotations

import pytest

from tidegate.kernels.cpu.native_cpu import NativeCpuKernels, native_kernels


@pytest.fixture(scope="module")
def native() -> NativeCpuKernels:
    lib = native_kernels()
    if lib is None:
        pytest.skip("native CPU kernels do not build here")
    return lib
