"""Projections with FP8 weights (``Fp8Weight``) on the GPU: W8A8 GEMMs on the tensor cores for
many rows, a weight stream for few.

* many rows (prefill chunks, large decode batches): the activations are quantized per token
  (``quantize_rows_fp8``: each row's largest magnitude lands on 448, the e4m3 maximum), and
  ``[BLOCK_M, BLOCK_N]`` output tiles multiply e4m3 by e4m3 on the FP8 matrix units with float32
  sums, scaled at the end by the row's activation scale times the weight row's scale (both
  factor out of the sum over K). The SiLU-and-mul and residual-add epilogues are
  ``tidegate.kernels.gpu.linear_triton``'s ``_store_rows``: with ``silu`` a program computes gate rows and
  the matching up rows together and writes ``silu(gate) * up``.
* few rows (decode steps of one or two sequences): ``tidegate.kernels.gpu.linear_triton``'s few-row kernels
  stream the e4m3 weights and multiply them with the activations in float32 (weight-only: at a
  row or two the step is bound by the weight bytes, which FP8 halves, and the activations need
  no rounding); the weight row's scale multiplies the finished sums.

``fp8_gemm`` serves many rows: cuBLAS's FP8 GEMM with the same row-wise scales
(``torch._scaled_mm``) where it takes the shape and no fused epilogue is asked for (on an H200 it
was 5-15% faster than this module's Triton GEMM at 4096-16384 rows and ~1.5x at a 1000-row
decode step, ``benchmarks/results/engine/quantized_gpu.md``), else the Triton GEMM.

Reference: ``w8a8_linear_ref`` (activations rounded per token the same way, then the float
product of the dequantized matrices) and ``Fp8Weight.dequantize`` then
``tidegate.kernels.cpu.linear.linear_ref`` for the weight-only path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidegate.kernels.gpu.linear_triton import SUPPORTED_DTYPES, _grouped_tile, _store_rows
from tidegate.kernels.reference.activation import silu_and_mul_ref
from tidegate.kernels.weights.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Weight

# Triton's interpreter rounds float -> e4m3 without carrying a rounded-up mantissa into the
# exponent (7.9 becomes 4, not 8): there, values are first rounded to e4m3's 4 significant bits
# in float32 (Veltkamp's split), so the cast itself is exact. On a GPU the cast (cvt.rn.satfinite)
# is right and this is skipped.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_SPLIT = tl.constexpr(1048577.0)  # 2**20 + 1: keeps 24 - 20 = 4 significant bits
# A row of zeros gets this scale (any positive value would do: its values are all 0).
_MIN_SCALE = 1e-12


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Activations already rounded to e4m3 per token (by the kernel that produced them:
    ``quantize_rows_fp8``, ``tidegate.kernels.gpu.rmsnorm_triton.rms_norm_fp8``,
    ``tidegate.kernels.gpu.activation_triton.silu_and_mul_fp8``): ``q`` [M, K] e4m3, ``scales`` [M] float32,
    ``dtype`` the dtype of the rows they stand for (the product's)."""

    q: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass(frozen=True, slots=True)
class Fp8GemmConfig:
    """Tile shape and launch options of one FP8 GEMM."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8  # row blocks launched together, so they share weight tiles in the L2
    num_warps: int = 8
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "group_m", "num_warps"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"Fp8GemmConfig.{name} must be a power of two, got {v}")
        if min(self.block_m, self.block_n) < 16 or self.block_k < 32:
            raise ValueError(f"Fp8GemmConfig: block_m, block_n >= 16 and block_k >= 32, got "
                             f"{self}")
        if self.num_stages < 1:
            raise ValueError(f"Fp8GemmConfig.num_stages must be >= 1, got {self.num_stages}")


def default_config(m: int, n: int, k: int, silu: bool) -> Fp8GemmConfig:
    """The tile per shape: 128 x 128 output tiles (64 wide with the SiLU pair, whose two
    accumulators share the registers), fewer rows for small batches so more programs stream
    the weights."""
    block_n = 64 if silu else 128
    if m <= 64:
        return Fp8GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    return Fp8GemmConfig(block_m=128, block_n=block_n, block_k=128, num_warps=8, num_stages=4)


@triton.jit
def _to_e4m3(v, INTERPRET: tl.constexpr):
    """float32 v (|v| <= 448) -> e4m3, rounded to nearest."""
    if INTERPRET:
        c = v * _SPLIT
        v = c - (c - v)
    return v.to(tl.float8e4nv)


@triton.jit
def _store_row_e4m3(v, q_row_ptr, s_ptr, row, cols, mask, INTERPRET: tl.constexpr):
    """A whole row v (float32, 0 where masked) -> its e4m3 values at q_row_ptr + cols and its
    scale max|v| / 448 at s_ptr + row (the epilogue of the kernels that feed W8A8 GEMMs)."""
    scale = tl.maximum(tl.max(tl.abs(v), axis=0) / 448.0, 1e-12)
    q = tl.minimum(tl.maximum(v * (1.0 / scale), -448.0), 448.0)
    tl.store(q_row_ptr + cols, _to_e4m3(q, INTERPRET), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                          BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """Row pid of x -> e4m3 values q (x / scale) and the row's float32 scale max|x| / 448."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    inv = 1.0 / scale
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        v = tl.minimum(tl.maximum(x.to(tl.float32) * inv, -448.0), 448.0)
        tl.store(q_ptr + row * stride_qm + k0 + offs, _to_e4m3(v, INTERPRET), mask=k0 + offs < K)
    tl.store(s_ptr + row, scale)


@triton.jit(do_not_specialize=["M"])  # rows vary by step: not a compile key
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, add_ptr, out_ptr,
    M, N, K,
    stride_am, stride_wn, stride_addm, stride_om, up_offset,
    SILU: tl.constexpr, ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """out[M, N] = (a[M, K] @ w[N, K].T) * a_scale[:, None] * w_scale[None, :], then the
    epilogue (SILU: w holds gate rows then up rows, N = I)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Rows past the edges read row 0 / weight row 0 rather than a mask per load (their results
    # are never stored), so the steady-state loads carry no predicates.
    safe_m = tl.where(mask_m, offs_m, 0).to(tl.int64)
    safe_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
    a_ptrs = a_ptr + safe_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + offs_k[None, :]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + k0)
            w = tl.load(w_ptrs + k0)
        else:
            km = (offs_k + k0 < K)[None, :]
            a = tl.load(a_ptrs + k0, mask=km, other=0.0)
            w = tl.load(w_ptrs + k0, mask=km, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        if SILU:
            if EVEN_K:
                u = tl.load(w_ptrs + up_offset + k0)
            else:
                u = tl.load(w_ptrs + up_offset + k0, mask=km, other=0.0)
            acc_u = tl.dot(a, tl.trans(u), acc_u)

    a_scale = tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)
    out = acc * a_scale[:, None] * tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    out_u = acc_u
    if SILU:
        out_u = acc_u * a_scale[:, None] * tl.load(w_scale_ptr + N + offs_n, mask=mask_n,
                                                   other=0.0)[None, :]
    _store_rows(out, out_u, a_scale, offs_m, offs_n, mask_m, N, add_ptr, out_ptr, stride_addm,
                stride_om, False, SILU, ADD)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (q [M, K] e4m3, scales [M] float32) with
    ``x ~= q * scales[:, None]``; each row's largest magnitude becomes 448."""
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be 2-D with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_rows_kernel[(m,)](x, q, scales, k, x.stride(0), q.stride(0),
                                    BLOCK_K=min(4096, triton.next_power_of_2(k)),
                                    INTERPRET=_INTERPRET, num_warps=4)
    return q, scales


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_fp8``'s reference in plain torch."""
    x = x.float()
    scales = (x.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (x / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def w8a8_linear_ref(x: torch.Tensor, weight: Fp8Weight, add: torch.Tensor | None = None,
                   silu: bool = False) -> torch.Tensor:
    """The W8A8 kernel's reference: x rounded per token to e4m3, the float32 product of the
    dequantized operands, rounded to x's dtype (then SiLU-and-mul and the add as the kernels
    round them)."""
    q, scales = quantize_rows_ref(x)
    out = (q.float() * scales[:, None]) @ weight.dequantize().to(x.device).T
    if silu:
        out = silu_and_mul_ref(out.to(x.dtype)).float()
    if add is not None:
        out = out + add.float()
    return out.to(x.dtype)


def _scaled_mm_takes(x: torch.Tensor, dtype: torch.dtype, n: int, k: int) -> bool:
    """cuBLAS FP8 with row-wise scales: Hopper or later, widths multiples of 16, bf16 out."""
    return (x.is_cuda and hasattr(torch, "_scaled_mm") and dtype == torch.bfloat16
            and n % 16 == 0 and k % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def fp8_gemm(x: torch.Tensor | Fp8Rows, weight: Fp8Weight, *, silu: bool = False,
             add: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_linear_triton``'s product for many rows, on cuBLAS where it takes the call (no
    SiLU or add epilogue: the engine's many-row steps ask for neither). ``x`` may come
    rounded already (``Fp8Rows``)."""
    n, k = weight.shape
    probe = x.q if isinstance(x, Fp8Rows) else x
    dtype = x.dtype
    if silu or add is not None or not _scaled_mm_takes(probe, dtype, n, k):
        return fp8_linear_triton(x, weight, silu=silu, add=add)
    _check_inputs(x, weight, silu, add)
    rows = _rounded(x)
    return torch._scaled_mm(rows.q, weight.weight.t(), scale_a=rows.scales[:, None],
                            scale_b=weight.scales[None, :], out_dtype=dtype)


def _rounded(x: torch.Tensor | Fp8Rows) -> Fp8Rows:
    if isinstance(x, Fp8Rows):
        return x
    q, scales = quantize_rows_fp8(x if x.stride(1) == 1 else x.contiguous())
    return Fp8Rows(q, scales, x.dtype)


def _check_inputs(x: torch.Tensor | Fp8Rows, weight: Fp8Weight, silu: bool,
                  add: torch.Tensor | None) -> int:
    """Raise ValueError for anything the kernels cannot take; return the output width."""
    if not isinstance(weight, Fp8Weight):
        raise ValueError(f"weight must be an Fp8Weight, got {type(weight).__name__}")
    rows = x.q if isinstance(x, Fp8Rows) else x
    if isinstance(x, Fp8Rows) and (x.q.dtype != FP8_DTYPE or x.scales.shape != x.q.shape[:1]
                                   or not x.q.is_contiguous()):
        raise ValueError("Fp8Rows: q must be contiguous e4m3 [M, K] and scales [M]")
    if rows.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(rows.shape)}")
    n_rows, k = weight.shape
    if rows.shape[1] != k:
        raise ValueError(f"x {tuple(rows.shape)} does not fit weight {weight.shape}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x: dtype {x.dtype} is not supported (takes {SUPPORTED_DTYPES})")
    for name, t in (("weight", weight.weight), ("scales", weight.scales)):
        if t.device != rows.device:
            raise ValueError(f"{name} must be on {rows.device}, got {t.device}")
    if not weight.weight.is_contiguous():
        raise ValueError("the FP8 weight must be contiguous")
    if silu and n_rows % 2:
        raise ValueError(f"silu needs gate and up rows: weight has an odd {n_rows} rows")
    n = n_rows // 2 if silu else n_rows
    if add is not None and (tuple(add.shape) != (rows.shape[0], n) or add.stride(-1) != 1
                            or add.device != rows.device):
        raise ValueError(f"add must be [{rows.shape[0]}, {n}] on {rows.device} with a "
                         f"contiguous last dim, got {tuple(add.shape)}")
    return n


def fp8_linear_triton(
    x: torch.Tensor | Fp8Rows,
    weight: Fp8Weight,
    *,
    silu: bool = False,
    add: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (any M) @ weight [N, K].T in W8A8: x quantized per token to e4m3, the product
    on the FP8 tensor cores, out [M, N] in x's dtype; ``silu``: weight is [2I, K] (gate rows,
    then up rows) and out = silu(gate) * up [M, I]; ``add`` [M, N]: out += add. No host
    synchronization (graph-capturable)."""
    n = _check_inputs(x, weight, silu, add)
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=weight.device)
    if m == 0 or n == 0:
        return out
    rows = _rounded(x)
    q, a_scales = rows.q, rows.scales
    cfg = config or default_config(m, n, k, silu)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        q, a_scales, weight.weight, weight.scales, out if add is None else add, out,
        m, n, k, q.stride(0), weight.weight.stride(0), 0 if add is None else add.stride(0),
        out.stride(0), n * weight.weight.stride(0),
        SILU=silu, ADD=add is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
