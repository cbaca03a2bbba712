"""``tidegate quantize``'s options and the checks that need no model: which methods and formats
exist, and which combinations of them make sense.

Kept free of torch so the CLI can refuse a bad combination before importing it (~1.2 s); the
checks that need the source model's shape (a group size that divides its projections, a family
AWQ can fold into) stay in ``quantize``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# method -> (bits, algorithm)
METHODS: dict[str, tuple[int, str]] = {
    "rtn-int8": (8, "rtn"), "rtn-int4": (4, "rtn"),
    "gptq-int8": (8, "gptq"), "gptq-int4": (4, "gptq"), "awq-int4": (4, "awq"),
    "fp8": (8, "fp8"),
}
FORMATS = ("compressed-tensors", "gptq", "awq")


class QuantizeError(ValueError):
    """Bad arguments or an unusable source model (the CLI prints it, exit code 2)."""


@dataclass
class QuantizeOptions:
    method: str
    group_size: int | None | str = "auto"  # None / -1: one group per row
    symmetric: bool = True
    act_order: bool = False  # GPTQ only
    format: str = "compressed-tensors"
    calibration: str | None = None  # text, for GPTQ
    context: int = 512  # calibration tokens per window
    max_windows: int = 64
    damp: float = 0.01


def check_options(options: QuantizeOptions, out: Path) -> tuple[int, str]:
    """``(bits, algorithm)`` of ``options.method``; ``QuantizeError`` for a combination no model
    makes valid, or an ``out`` that already holds files."""
    if options.method not in METHODS:
        raise QuantizeError(f"--method {options.method!r}: one of {', '.join(METHODS)}")
    if options.format not in FORMATS:
        raise QuantizeError(f"--format {options.format!r}: one of {', '.join(FORMATS)}")
    bits, algorithm = METHODS[options.method]
    if algorithm == "fp8":
        _check_fp8_options(options)
    elif algorithm != "rtn" and not options.calibration:
        raise QuantizeError(f"--method {options.method} calibrates: give --calibration FILE")
    if options.act_order and algorithm != "gptq":
        raise QuantizeError("--act-order is a GPTQ option (gptq-int4, gptq-int8)")
    if options.act_order and options.format != "gptq":
        raise QuantizeError("--act-order checkpoints are written in the gptq format "
                            "(--format gptq)")
    if options.format == "awq" and bits != 4:
        raise QuantizeError("--format awq holds 4-bit integers in groups (not per channel)")
    if out.exists() and any(out.iterdir()):
        raise QuantizeError(f"{out} exists and is not empty")
    return bits, algorithm


def _check_fp8_options(options: QuantizeOptions) -> None:
    if options.format != "compressed-tensors":
        raise QuantizeError(f"--method fp8 writes compressed-tensors float-quantized, not "
                            f"--format {options.format}")
    if not options.symmetric:
        raise QuantizeError("--asymmetric: FP8 weights are symmetric (--method fp8)")
    if options.group_size not in ("auto", -1, None):
        raise QuantizeError(f"--group-size {options.group_size}: --method fp8 has one scale per "
                            "channel (auto or -1)")
