"""Which implementation serves a kernel call: ``TIDEGATE_KERNELS`` and the tensor's device.

* ``auto`` (default): Triton for CUDA tensors; on the CPU the native C kernels where they apply
  and build (``kernels.native_cpu``), else the plain-torch reference.
* ``reference``: the plain-torch reference everywhere.
* ``native``: like ``auto``, but the CPU's native kernels must build (tests, benchmarks).
* ``triton``: Triton everywhere, CPU tensors included; on a machine without a GPU that needs
  ``TRITON_INTERPRET=1`` (the CI tests run every Triton kernel that way).
"""

from __future__ import annotations

import os

import torch

MODES = ("auto", "reference", "native", "triton")


def kernel_mode() -> str:
    mode = os.environ.get("TIDEGATE_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"TIDEGATE_KERNELS must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel serves a call on ``x``."""
    mode = kernel_mode()
    if mode == "triton":
        return True
    return mode != "reference" and x.is_cuda
