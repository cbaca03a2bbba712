"""The entry points models call; today each dispatches to its plain-torch reference."""

from __future__ import annotations

from kernels.activation import silu_and_mul_ref as silu_and_mul
from kernels.rmsnorm import rms_norm_ref as rms_norm
from kernels.rotary import rotary_ref as rotary

__all__ = ["rms_norm", "rotary", "silu_and_mul"]
