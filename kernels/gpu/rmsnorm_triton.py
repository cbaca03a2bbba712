"""The Triton RMSNorm: residual add, sum of squares and scaling fused in one pass per row.

Same contract and rounding as ``rms_norm_ref`` (``kernels/reference/rmsnorm.py``): the residual sum is
rounded to the input dtype before it is normalized (it is also what the next layer adds to),
the normalization runs in float32, and its result is rounded to the input dtype before the
weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidegate.kernels.gpu.fp8_linear_triton import _INTERPRET, FP8_DTYPE, Fp8Rows, _store_row_e4m3


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    x_row_stride,
    residual_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr = False,
    scale_ptr=None,
    INTERPRET: tl.constexpr = False,
):
    # int64 row offsets: T * row stride can pass 2**31 on long prefills of wide models.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype first: the reference normalizes the rounded sum.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    # Masked lanes load 0, so they add nothing to the sum of squares.
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FP8:  # the row as the reference rounds it, then e4m3 with its scale (out is e4m3)
        v = (normed * w).to(x_ptr.dtype.element_ty).to(tl.float32)
        _store_row_e4m3(v, out_ptr + row * hidden, scale_ptr, row, cols, mask, INTERPRET)
    else:
        tl.store(out_ptr + row * hidden + cols, (normed * w).to(out_ptr.dtype.element_ty),
                 mask=mask)


def _check_rows(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, H], got shape {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on {x.device}, got {t.device}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[Fp8Rows, torch.Tensor]:
    """``rms_norm_triton`` whose normed rows come out rounded to e4m3 per token, for a W8A8
    GEMM (``tidegate.kernels.gpu.fp8_linear_triton.fp8_gemm``): one pass instead of a norm and a
    quantization."""
    return rms_norm_triton(x, weight, eps, residual, fp8=True)  # type: ignore[return-value]


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """(normed, new_residual) for x [T, H] (any row stride), weight [H]; see ``rms_norm_ref``.

    normed is a new contiguous tensor in ``promote_types(x.dtype, weight.dtype)`` (``fp8``: an
    ``Fp8Rows`` of it, in x's dtype); new_residual is a new contiguous x + residual, or x itself
    when residual is None (as the reference).
    """
    _check_rows("x", x, x)
    t, h = x.shape
    # One block holds the whole row in registers; past this it would spill and a looping
    # kernel would be needed. Llama-class hidden sizes are at most 8192.
    max_hidden = 32768
    if h > max_hidden:
        raise ValueError(f"x: hidden size must be at most {max_hidden}, got {h}")
    if weight.shape != (h,):
        raise ValueError(f"weight must have shape ({h},), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on {x.device}, got {weight.device}")
    if h > 1 and weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous, got stride {weight.stride()}")
    if residual is not None:
        _check_rows("residual", residual, x)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have shape {tuple(x.shape)}, "
                             f"got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must have dtype {x.dtype}, got {residual.dtype}")

    out = torch.empty((t, h), dtype=FP8_DTYPE if fp8 else torch.promote_types(
        x.dtype, weight.dtype), device=x.device)
    scales = torch.empty(t if fp8 else 0, dtype=torch.float32, device=x.device)
    new_residual = x if residual is None else torch.empty((t, h), dtype=x.dtype, device=x.device)
    normed: torch.Tensor | Fp8Rows = Fp8Rows(out, scales, x.dtype) if fp8 else out
    if t == 0:
        return normed, new_residual
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(t,)](
        x,
        x if residual is None else residual,  # unread without a residual
        weight,
        out,
        new_residual,
        x.stride(0),
        h if residual is None else residual.stride(0),
        h,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        FP8=fp8,
        scale_ptr=scales if fp8 else None,
        INTERPRET=_INTERPRET,
        # About 16 elements per thread: enough to hide latency without spilling.
        num_warps=min(max(block // 512, 1), 16),
    )
    return normed, new_residual
