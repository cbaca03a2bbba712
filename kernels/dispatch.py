"""Which implementation serves a kernel call: ``TIDEGATE_KERNELS`` and the tensor's device.

* ``auto`` (default): Triton for CUDA tensors; on the CPU the native C kernels where they apply
  and build (``tidegate.kernels.cpu.native_cpu``), else the plain-torch reference.
* ``reference``: the plain-torch reference everywhere.
* ``native``: like ``auto``, but the CPU's native kernels must build (tests, benchmarks).
* ``triton``: Triton everywhere, CPU tensors included; on a machine without a GPU that needs
  ``TRITON_INTERPRET=1`` (the CI tests run every Triton kernel that way).
"""

from __future__ import annotations

import os

import torch

MODES = ("auto", "reference", "native", "triton")
# Rows up to which a Triton-served projection takes the fused few-row kernel
# (``kernels/gpu/linear_triton.py``) rather than the GEMM library. On an H200 (Llama-3-8B shapes,
# bf16, ``benchmarks/kernels/gemv_sweep.py``) one row beat cuBLAS on every shape (o_proj 3.7 against
# 2.5 TB/s, a step's projections 3.63 against 4.25 ms); at two rows cuBLAS won on three of five.
SERVE_ROWS = 1


# Every kernel call asks for the mode (tests change it between calls), a few hundred times per
# decode step: os.environ.get costs ~2 us (key encoding, Mapping.get), 2 ms of a 20 ms CPU step.
# The environment's own bytes dict, with the parsed mode cached per raw value, costs ~0.1 us.
_ENV_DATA: dict[bytes, bytes] | None = (getattr(os.environ, "_data", None)
                                         if os.name == "posix" else None)
_ENV_KEY = b"TIDEGATE_KERNELS"
_parsed: dict[bytes | None, str] = {}


def kernel_mode() -> str:
    if _ENV_DATA is None:  # not POSIX's bytes environment
        return _parse(os.environ.get("TIDEGATE_KERNELS"))
    raw = _ENV_DATA.get(_ENV_KEY)
    mode = _parsed.get(raw)
    if mode is None:
        mode = _parsed[raw] = _parse(None if raw is None else os.fsdecode(raw))
    return mode


def _parse(raw: str | None) -> str:
    mode = (raw or "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"TIDEGATE_KERNELS must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel serves a call on ``x``."""
    mode = kernel_mode()
    if mode == "triton":
        return True
    return mode != "reference" and x.is_cuda
