"""Dense projections: ``x @ weight.T``, with the fastest path for few-row inputs on the CPU.

A decode step's projections have a handful of rows: each is a stream over a weight matrix.
* float32, up to ``NATIVE_ROWS`` rows: the native kernel (``csrc/linear_cpu.c``), which reads
  every weight once at close to the memory's bandwidth. BLAS reached about a third of it here
  (batch-1 decode: layers 35 -> 17 ms, LM head 10 -> 4 ms; at 32 rows 65 -> 56 and 20 -> 16).
* otherwise up to ``SKINNY_ROWS``: ``(weight @ x.T).T``, since with ``F.linear`` BLAS spends a
  third of the time copying (packing) the large weight matrix on every call, and in the
  transposed form it packs the small activation instead.
* prefill chunks: ``F.linear``.
Same arithmetic throughout; results differ only in summation order.

Packed GGUF weights (``tidegate.kernels.weights.packed_weight``) go to the native packed kernel
(``csrc/packed_linear_cpu.c``), which dequantizes a strip of rows at a time into cache and
multiplies it with float32 activations: the dequantized matrix's product up to summation order,
which ``packed_linear_ref`` (dequantize, then ``linear_ref``) is. Integer weights with group
scales (``tidegate.kernels.weights.int_weight``: GPTQ, AWQ, compressed-tensors) take the same kernel with their
own row dequantizer; ``int_linear_ref`` is theirs. FP8 weights (``tidegate.kernels.weights.fp8_weight``) too:
the CPU has no FP8 arithmetic, so their rows are widened to float32 (exactly) and multiplied
with float32 activations, weight-only; ``fp8_linear_ref`` is theirs.

Weights in the "int8" activation mode (``tidegate.kernels.reference.q8_activations``) go to the 8-bit kernel
(``csrc/q8_linear_cpu.c``): x rounded per row to 8-bit blocks, integer dot products. Its
reference is the same references with x rounded first (``dequantize_rows_q8_ref``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidegate.kernels.cpu.native_cpu import native_kernels
from tidegate.kernels.reference.activation import silu_and_mul_ref
from tidegate.kernels.reference.q8_activations import dequantize_rows_q8_ref
from tidegate.kernels.reference.rmsnorm import rms_norm_ref
from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.kernels.weights.packed_weight import PackedWeight

# The native kernel won at 1-32 rows on every projection shape of the default model and was
# level with BLAS at 64.
NATIVE_ROWS = 48
# Up to this many rows the transposed form won on every projection shape of the default model
# on the CPU (and on the 49152-wide LM head by 1.5-1.9x).
SKINNY_ROWS = 64


def linear_ref(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x @ weight.T (+ add, the residual stream's add)."""
    out = F.linear(x, weight)
    return out if add is None else out + add


def packed_linear_ref(x: torch.Tensor, weight: PackedWeight, add: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """The packed kernels' reference: the whole matrix dequantized, then ``linear_ref``; in
    the "int8" mode each quantized part multiplies x rounded to 8-bit blocks."""
    if not any(weight.takes_int8(p) for p in weight.parts):
        return linear_ref(x, weight.dequantize().to(x.dtype), add)
    rounded = _rounded(x)
    outs = [linear_ref(rounded if weight.takes_int8(part) else x,
                       PackedWeight((part.rows, weight.shape[1]), (part,)).dequantize().to(x.dtype))
            for part in weight.parts]
    out = torch.cat(outs, dim=-1)
    return out if add is None else out + add


def int_linear_ref(x: torch.Tensor, weight: IntWeight, add: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The integer kernels' reference: the whole matrix dequantized, then ``linear_ref``; in
    the "int8" mode x rounded to 8-bit blocks first (in the stored column order, as the
    kernel reads it: act-order weights round x[:, perm])."""
    if weight.takes_int8:
        if weight.perm is None:
            x = _rounded(x)
        else:
            rounded = torch.empty_like(x)
            rounded[..., weight.perm] = _rounded(x[..., weight.perm])
            x = rounded
    return linear_ref(x, weight.dequantize().to(x.dtype), add)


def fp8_linear_ref(x: torch.Tensor, weight: Fp8Weight, add: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The FP8 kernels' reference: the whole matrix dequantized, then ``linear_ref``."""
    return linear_ref(x, weight.dequantize().to(x.dtype), add)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the 8-bit kernels read it (rows rounded to 8-bit blocks), in x's dtype."""
    return dequantize_rows_q8_ref(x.reshape(-1, x.shape[-1])).reshape(x.shape).to(x.dtype)


def norm_linear_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """RMSNorm, then the projection, then (``silu``: weight holds gate then up rows) SwiGLU:
    what ``tidegate.kernels.gpu.linear_triton`` fuses into one weight stream."""
    out = linear_ref(rms_norm_ref(x, norm_weight, eps)[0], weight)
    return silu_and_mul_ref(out) if silu else out


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight | IntWeight | Fp8Weight,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K] -> [M, N] (contiguous), plus ``add`` [M, N] if given."""
    if isinstance(weight, IntWeight):
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and (
                native := native_kernels()) is not None:
            return native.int_linear(x, weight, add)
        return int_linear_ref(x, weight, add)
    if isinstance(weight, Fp8Weight):
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and (
                native := native_kernels()) is not None:
            return native.fp8_linear(x, weight, add)
        return fp8_linear_ref(x, weight, add)
    if isinstance(weight, PackedWeight):
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and (
                native := native_kernels()) is not None:
            return native.packed_linear(x, weight, add)
        return packed_linear_ref(x, weight, add)
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= SKINNY_ROWS:
        if (x.shape[0] <= NATIVE_ROWS and x.dtype == torch.float32
                and weight.dtype == torch.float32 and (native := native_kernels()) is not None):
            out = native.skinny_linear(x, weight)
        else:
            out = torch.mm(weight, x.t()).t().contiguous()
        return out if add is None else out.add_(add)
    if add is not None:  # one GEMM with the add in its epilogue
        return torch.addmm(add, x, weight.t())
    return F.linear(x, weight)
