"""The entry points models call; today each dispatches to its plain-torch implementation.

Triton kernels go behind these same names (GPU issue); callers never import an implementation.
"""

from __future__ import annotations

from kernels.activation import silu_and_mul_ref as silu_and_mul
from kernels.linear import linear
from kernels.paged_attention import paged_attention
from kernels.paged_attention import store_kv_ref as store_kv
from kernels.rmsnorm import rms_norm_ref as rms_norm
from kernels.rotary import rotary_ref as rotary

__all__ = ["linear", "paged_attention", "rms_norm", "rotary", "silu_and_mul", "store_kv"]
