"""The Triton gated activations: x [T, 2I] -> silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up
(GeGLU, Gemma), [T, I].

Same results as ``silu_and_mul_ref`` / ``gelu_and_mul_ref`` (``kernels/reference/activation.py``) but
computed in float32 and rounded once to x's dtype. Each program handles one block of one row's columns, so a wide
intermediate size (14336) spreads over many programs even for a single decode token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidegate.kernels.gpu.fp8_linear_triton import _INTERPRET, FP8_DTYPE, Fp8Rows, _store_row_e4m3


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    inter,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,
):
    # int64 row offsets: a padded row stride times a long prefill's T may pass 2**31.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptrs = x_ptr + row * x_row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # gelu's tanh form; tanh(u) = 1 - 2 / (exp(2u) + 1) stays finite for any u.
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gelu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> gelu_tanh(gate) * up, new [T, I]."""
    return silu_and_mul_triton(x, gelu=True)


def silu_and_mul_triton(x: torch.Tensor, *, gelu: bool = False) -> torch.Tensor:
    """x [T, 2I] (gate then up; any row stride, contiguous last dim) -> new [T, I]."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be 2-D [T, 2I] with an even last dim, got {tuple(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dim, got strides {x.stride()}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens == 0 or inter == 0:
        return out
    # 1024 columns per program: wide enough for 128-bit accesses on every thread at 4 warps,
    # narrow enough that I = 14336 gives 14 programs per row.
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), inter, BLOCK=block, GELU=gelu,
        num_warps=4 if block >= 512 else 1,
    )
    return out


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, x_row_stride, inter, BLOCK: tl.constexpr,
                             INTERPRET: tl.constexpr):
    """One whole row per program: silu(gate) * up rounded to x's dtype, then to e4m3 with the
    row's scale."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptrs = x_ptr + row * x_row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    h = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_row_e4m3(h, q_ptr + row * inter, s_ptr, row, cols, mask, INTERPRET)


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    """``silu_and_mul_triton`` rounded to e4m3 per token, for the W8A8 down projection: one pass
    over [T, 2I] instead of the activation and a quantization."""
    if x.dim() != 2 or x.shape[1] % 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be 2-D [T, 2I] with a contiguous last dim, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    tokens, inter = x.shape[0], x.shape[1] // 2
    rows = Fp8Rows(torch.empty((tokens, inter), dtype=FP8_DTYPE, device=x.device),
                   torch.empty(tokens, dtype=torch.float32, device=x.device), x.dtype)
    if tokens and inter:
        block = triton.next_power_of_2(inter)
        _silu_and_mul_fp8_kernel[(tokens,)](x, rows.q, rows.scales, x.stride(0), inter,
                                            BLOCK=block, INTERPRET=_INTERPRET,
                                            num_warps=min(max(block // 512, 1), 16))
    return rows
