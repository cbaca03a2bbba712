"""Integer-weight projections for one or two rows (decode steps) on integer dot products.

At a decode step an INT4 projection is a stream of 4-bit weights, and turning each weight into
a float before its multiply (``tidegate.kernels.gpu.int_linear_triton``'s FMA path: ~9 instructions a
weight) bounds it by arithmetic at a quarter of the memory's rate. Here the activations are
rounded to 8-bit integers instead, per run of 32 columns with a float scale each (as llama.cpp
rounds them on GPUs and CPUs), and the weights meet them as bytes: one AND turns four nibbles
of a 32-bit word into four bytes, and ``dp4a`` multiplies four byte pairs and adds them to an
int32 sum in one instruction, so a weight costs under one instruction. The rounding adds about
1/254 of a run's largest activation to each (a percent of the output at most, against the
several percent of the 4-bit weights' own rounding).

Per run r of 32 columns and weight row n (group g of G columns, scale s, zero point z):
``out[n] += s[n, g] * xs[r] * (sum_i q[n, i] * xq[i] - z[n, g] * sum_i xq[i])``: the zero point
comes out of the integer sum through the run's sum of activations, once per run.

4-bit rows keep ``IntWeight``'s runs: 16 bytes per 32 columns, byte b holding column b (low
nibble) and 16 + b (high nibble). A 32-bit word j of a run then holds columns 4j..4j+3 in its
low nibbles and 16+4j..16+4j+3 in its high ones: with the activations packed four to a word in
column order, ``word & 0x0F0F0F0F`` meets activation word j and ``(word >> 4) & 0x0F0F0F0F``
word 4 + j, and no value moves between lanes. 8-bit rows are one value per byte: word j meets
activation word j.

The fusions of ``tidegate.kernels.gpu.linear_triton`` carry over: RMSNorm prologue (the sum of squares beside
the products, 1/rms on the finished sums; rounding per run is scale-free), SiLU-and-mul and the
residual add in the epilogue (``_store_rows``), act-order columns gathered through ``perm``, and
programmatic dependent launch. Reference: ``int_gemv_ref`` (activations rounded the same way,
then the float product with the dequantized matrix).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tidegate.kernels.gpu.linear_triton import _num_sms, _store_rows, pdl_supported
from tidegate.kernels.weights.int_weight import IntWeight

MAX_ROWS = 2
RUN = 32  # columns per activation scale
# The interpreter runs no PTX: there dp4a is spelled out in integer arithmetic.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds to integers


# Rows of x are rounded whole and kept in registers (K / 4 int8 words per row): up to this many
# columns (Llama-3-70B's down projection has 28672).
MAX_K = 32768


@dataclass(frozen=True, slots=True)
class IntGemvConfig:
    """Tile shape and launch options of one projection."""

    block_n: int = 2  # weight rows per block (a program loops over blocks)
    per_sm: int = 4  # programs per streaming multiprocessor
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "per_sm", "num_warps"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"IntGemvConfig.{name} must be a power of two, got {v}")


def default_config(n: int, k: int, bits: int, silu: bool) -> IntGemvConfig:
    """The tile per shape (``n``: output features), from ``benchmarks/kernels/int_gemv_sweep.py`` on an
    H200 at Llama-3-8B's decode shapes (one row, INT4 in groups of 128, INT8 per channel;
    second sweep, ``benchmarks/results/kernels/int_gemv.json``):

    * rows of up to 8192 columns: 4 programs of 4 warps per SM over blocks of 8 rows (INT4 qkv
      6.8, o_proj 4.8, gate_up 17.4 us; INT8 gate_up 31.3-32.4), INT8 without SiLU 4 programs
      of 8 warps over 2 rows (qkv 9.7, o_proj 7.1 us);
    * longer rows (down_proj, K = 14336: 14 KB of int8 activations a row): INT4 2 programs of
      16 warps over 4 rows (13.7 us), INT8 4 programs of 8 warps over 1 row (18.2 us)."""
    del n
    if k > 8192:
        return IntGemvConfig(block_n=4 if bits == 4 else 1, per_sm=2 if bits == 4 else 4,
                             num_warps=16 if bits == 4 else 8)
    if bits == 8 and not silu:
        return IntGemvConfig(block_n=2, per_sm=4, num_warps=8)
    return IntGemvConfig(block_n=8, per_sm=4, num_warps=4)


def applies(weight: IntWeight, m: int) -> bool:
    """Whether this kernel serves ``m`` rows over ``weight``: runs of 32 inside its groups,
    rows that fit registers."""
    n, k = weight.shape
    g = weight.group_size
    return (0 < m <= MAX_ROWS and k % RUN == 0 and k <= MAX_K
            and (g == k or (g % RUN == 0 and g & (g - 1) == 0)))


@triton.jit
def _dp4a(a, b, acc, INTERPRET: tl.constexpr):
    """acc + the sum of the four products of a's unsigned bytes and b's signed bytes."""
    # (Both branches assign and one return follows: code after a constexpr-taken return is
    # still compiled.)
    if INTERPRET:
        for i in tl.static_range(4):
            acc += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
    else:
        acc = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                        [a, b, acc], dtype=tl.int32, is_pure=True, pack=1)
    return acc


@triton.jit
def _quantize_runs(x, RUNS: tl.constexpr):
    """x [RUNS * 32] float32 -> (words [RUNS * 8] int32 of four int8 each, in column order;
    scales [RUNS] float32; sums [RUNS] int32 of the int8 values): x ~= int8 * scale per run."""
    xg = tl.reshape(x, [RUNS, 32])
    amax = tl.max(tl.abs(xg), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    q = ((xg * inv[:, None] + _ROUND) - _ROUND).to(tl.int32)
    sums = tl.sum(q, axis=1)
    shifts = tl.arange(0, 4) * 8
    words = tl.sum((tl.reshape(q, [RUNS * 8, 4]) & 0xFF) << shifts[None, :], axis=1)
    return words, amax / 127.0, sums


@triton.jit
def _load_x(x_rows, perm_ptr, norm_ptr, cols, xmask, kmask, PERM: tl.constexpr,
            NORM: tl.constexpr):
    """x[rows, perm[cols]] in float32 (NORM: times the norm weight's same columns), and the
    squares of x itself (the sum of squares that gives 1/rms). Shared with
    ``tidegate.kernels.gpu.int_linear_triton``'s kernels."""
    if PERM:
        cols = tl.load(perm_ptr + cols, mask=kmask, other=0)
    x = tl.load(x_rows + cols, mask=xmask, other=0.0).to(tl.float32)
    sq = x * x
    if NORM:
        x = x * tl.load(norm_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
    return x, sq


@triton.jit
def _run_sums(w, xw, BITS: tl.constexpr, RUNS: tl.constexpr, BLOCK_N: tl.constexpr,
              INTERPRET: tl.constexpr):
    """Weight words [BLOCK_N, words] against activation words -> [BLOCK_N, RUNS] int32 sums of
    q * xq per run."""
    if BITS == 4:
        # Activation words 0-3 of a run meet the low nibbles, 4-7 the high ones.
        lo_x, hi_x = tl.split(tl.permute(tl.reshape(xw, [RUNS, 2, 4]), (0, 2, 1)))
        lo_x = tl.reshape(lo_x, [RUNS * 4])
        hi_x = tl.reshape(hi_x, [RUNS * 4])
        acc = _dp4a(w & 0x0F0F0F0F, lo_x[None, :], tl.zeros_like(w), INTERPRET)
        acc = _dp4a((w >> 4) & 0x0F0F0F0F, hi_x[None, :], acc, INTERPRET)
        sums = tl.sum(tl.reshape(acc, [BLOCK_N, RUNS, 4]), axis=2)
    else:
        acc = _dp4a(w, xw[None, :], tl.zeros_like(w), INTERPRET)
        sums = tl.sum(tl.reshape(acc, [BLOCK_N, RUNS, 8]), axis=2)
    return sums


@triton.jit
def _scaled_runs(sums, xs, xsum, s_ptr, z_ptr, rows, mask_n, kmask, stride_sn, stride_zn,
                 BLOCK_N: tl.constexpr, RUNS: tl.constexpr, G: tl.constexpr,
                 ONE_GROUP: tl.constexpr):
    """Run sums [BLOCK_N, RUNS] -> float32 (q - z) . x per row: per run, the zero point's share
    out of the integer sum, times the run's activation scale; per group (G columns, runs of 32
    inside it), times the weight's scale (ONE_GROUP: one scale and zero per row, the scale
    left for the finished sums)."""
    if ONE_GROUP:
        z = tl.load(z_ptr + rows * stride_zn, mask=mask_n, other=0).to(tl.int32)
        vals = (sums - z[:, None] * xsum[None, :]).to(tl.float32) * xs[None, :]
        out = tl.sum(vals, axis=1)
    else:
        PER: tl.constexpr = G // 32  # runs per group
        GROUPS: tl.constexpr = RUNS // PER
        group = tl.arange(0, GROUPS)
        gmask = mask_n[:, None] & kmask[None, :]
        z = tl.load(z_ptr + rows[:, None] * stride_zn + group[None, :], mask=gmask, other=0)
        s = tl.load(s_ptr + rows[:, None] * stride_sn + group[None, :], mask=gmask, other=0.0)
        sums = tl.reshape(sums, [BLOCK_N, GROUPS, PER])
        zx = z.to(tl.int32)[:, :, None] * tl.reshape(xsum, [1, GROUPS, PER])
        vals = (sums - zx).to(tl.float32) * tl.reshape(xs, [1, GROUPS, PER])
        out = tl.sum(tl.sum(vals, axis=2) * s, axis=1)
    return out


@triton.jit
def _row_x(x_row, perm_ptr, norm_ptr, K, BLOCK_K: tl.constexpr, PERM: tl.constexpr,
           NORM: tl.constexpr):
    """One row of x, prologue applied and rounded per run: (words, scales, sums, sum of
    squares of x)."""
    cols = tl.arange(0, BLOCK_K)
    x, sq = _load_x(x_row, perm_ptr, norm_ptr, cols, cols < K, cols < K, PERM, NORM)
    words, xs, xsum = _quantize_runs(x, BLOCK_K // 32)
    return words, xs, xsum, tl.sum(sq, axis=0)


@triton.jit(do_not_specialize=["M"])  # rows vary by step: not a compile key
def _gemv_kernel(
    x_ptr, perm_ptr, norm_ptr, q_ptr, s_ptr, z_ptr, add_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_am, stride_om,
    eps,
    BITS: tl.constexpr, G: tl.constexpr, PERM: tl.constexpr, NORM: tl.constexpr,
    SILU: tl.constexpr, ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ONE_GROUP: tl.constexpr, PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[M, N] = prologue(x) @ values.T (+ add) for M <= 2, K <= BLOCK_K. Persistent: each
    program rounds x once (it stays in registers as int8 words) and loops over blocks of
    BLOCK_N weight rows (SILU: gate row j and up row N + j) pid, pid + programs, ...; the
    next block's weights load while the current one is reduced. q_ptr: the qweight bytes as
    int32 words (stride_qn in words)."""
    RUNS: tl.constexpr = BLOCK_K // 32
    WORDS: tl.constexpr = BLOCK_K * BITS // 32
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    words = tl.arange(0, WORDS)
    if EVEN_K:
        kmask_w = words < WORDS
    else:
        kmask_w = words < K * BITS // 32
    kmask_g = tl.arange(0, RUNS // (G // 32) if not ONE_GROUP else 1) * G < K
    # Rows past N read row 0 (their sums are never stored): the weight loads carry no row
    # predicates, and with EVEN_K none at all.
    rows = pid * BLOCK_N + offs_n
    w_ptrs = q_ptr + tl.where(rows < N, rows, 0).to(tl.int64)[:, None] * stride_qn + words[None, :]
    # The weights do not depend on the kernel before this one: load the first block, let the
    # next kernel launch, then wait for x.
    w = tl.load(w_ptrs, mask=kmask_w[None, :], other=0, eviction_policy="evict_first")
    u = w
    if SILU:
        u = tl.load(w_ptrs + N * stride_qn, mask=kmask_w[None, :], other=0,
                    eviction_policy="evict_first")
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    x0, xs0, xsum0, sq0 = _row_x(x_ptr, perm_ptr, norm_ptr, K, BLOCK_K, PERM, NORM)
    x1, xs1, xsum1, sq1 = x0, xs0, xsum0, sq0
    if BLOCK_M == 2:
        x1, xs1, xsum1, sq1 = _row_x(x_ptr + stride_xm * (M > 1), perm_ptr, norm_ptr, K,
                                     BLOCK_K, PERM, NORM)
    offs_m = tl.arange(0, BLOCK_M)
    sumsq = tl.where(offs_m == 0, sq0, sq1)
    rstd = 1.0 / tl.sqrt(sumsq / K + eps)

    for blk in range(pid, n_blocks, nprog):
        rows = blk * BLOCK_N + offs_n
        mask_n = rows < N
        gate = tl.where(mask_n, rows, 0).to(tl.int64)
        nxt = (blk + nprog) * BLOCK_N + offs_n
        nptrs = (q_ptr + tl.where(nxt < N, nxt, 0).to(tl.int64)[:, None] * stride_qn
                 + words[None, :])
        w_next = tl.load(nptrs, mask=kmask_w[None, :], other=0, eviction_policy="evict_first")
        out0 = _scaled_runs(_run_sums(w, x0, BITS, RUNS, BLOCK_N, INTERPRET), xs0, xsum0,
                            s_ptr, z_ptr, gate, mask_n, kmask_g, stride_sn, stride_zn,
                            BLOCK_N, RUNS, G, ONE_GROUP)
        out1 = out0
        if BLOCK_M == 2:
            out1 = _scaled_runs(_run_sums(w, x1, BITS, RUNS, BLOCK_N, INTERPRET), xs1, xsum1,
                                s_ptr, z_ptr, gate, mask_n, kmask_g, stride_sn, stride_zn,
                                BLOCK_N, RUNS, G, ONE_GROUP)
        out0_u = out0
        out1_u = out1
        u_next = w_next
        if SILU:
            up = gate + N
            u_next = tl.load(nptrs + N * stride_qn, mask=kmask_w[None, :], other=0,
                             eviction_policy="evict_first")
            out0_u = _scaled_runs(_run_sums(u, x0, BITS, RUNS, BLOCK_N, INTERPRET), xs0, xsum0,
                                  s_ptr, z_ptr, up, mask_n, kmask_g, stride_sn, stride_zn,
                                  BLOCK_N, RUNS, G, ONE_GROUP)
            out1_u = out0_u
            if BLOCK_M == 2:
                out1_u = _scaled_runs(_run_sums(u, x1, BITS, RUNS, BLOCK_N, INTERPRET), xs1,
                                      xsum1, s_ptr, z_ptr, up, mask_n, kmask_g, stride_sn,
                                      stride_zn, BLOCK_N, RUNS, G, ONE_GROUP)
        if ONE_GROUP:  # one scale per row multiplies the finished sums
            s = tl.load(s_ptr + gate * stride_sn, mask=mask_n, other=0.0)
            out0 *= s
            out1 *= s
            if SILU:
                s_u = tl.load(s_ptr + (gate + N) * stride_sn, mask=mask_n, other=0.0)
                out0_u *= s_u
                out1_u *= s_u
        first = (offs_m == 0)[:, None]
        out = tl.where(first, out0[None, :], out1[None, :])
        out_u = tl.where(first, out0_u[None, :], out1_u[None, :])
        _store_rows(out, out_u, rstd, offs_m, rows, offs_m < M, N, add_ptr, out_ptr,
                    stride_am, stride_om, NORM, SILU, ADD)
        w = w_next
        u = u_next


def int_gemv_ref(x: torch.Tensor, weight: IntWeight, norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-5, silu: bool = False, add: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """The kernel's reference: prologue(x) in stored column order rounded to int8 per run of
    32 (scale max|x| / 127, round to nearest), then the float32 product with the dequantized
    weights; 1/rms, SiLU-and-mul and the add as ``tidegate.kernels.gpu.linear_triton`` rounds them."""
    from tidegate.kernels.reference.activation import silu_and_mul_ref

    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=1, keepdim=True) + eps)
    if norm_weight is not None:
        x32 = x32 * norm_weight.float()
    if weight.perm is not None:
        x32 = x32[:, weight.perm]
    runs = x32.reshape(x32.shape[0], -1, RUN)
    amax = runs.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(runs * inv) * (amax / 127.0)
    values = weight.dequantize()
    if weight.perm is not None:
        values = values[:, weight.perm]
    out = xq.reshape(x32.shape) @ values.T
    if norm_weight is not None:
        out = out * rstd
    if silu:
        out = silu_and_mul_ref(out.to(x.dtype)).float()
    if add is not None:
        out = out + add.float()
    return out.to(x.dtype)


def int_gemv_triton(x: torch.Tensor, weight: IntWeight, n: int, *,
                    norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
                    silu: bool = False, add: torch.Tensor | None = None,
                    pdl: bool | None = None, config: IntGemvConfig | None = None
                    ) -> torch.Tensor:
    """One or two rows: out [M, n] (``n``: output width, already checked by the caller,
    ``tidegate.kernels.gpu.int_linear_triton``, with the operands)."""
    m, k = x.shape
    if not applies(weight, m):
        raise ValueError(f"the integer GEMV takes 1-{MAX_ROWS} rows and groups of whole runs "
                         f"of {RUN} columns, got {m} rows, group {weight.group_size}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    cfg = config or default_config(n, k, weight.bits, silu)
    use_pdl = pdl_supported(x.device) if pdl is None else pdl
    words = weight.qweight.view(torch.int32)  # [N, K * bits / 32]: rows are whole words
    blocks = triton.cdiv(n, cfg.block_n)
    block_k = max(128, triton.next_power_of_2(k))
    _gemv_kernel[(min(blocks, cfg.per_sm * _num_sms(x.device)),)](
        x, x if weight.perm is None else weight.perm, x if norm_weight is None else norm_weight,
        words, weight.scales, weight.zeros, out if add is None else add, out,
        m, n, k, x.stride(0), words.stride(0), weight.scales.stride(0), weight.zeros.stride(0),
        0 if add is None else add.stride(0), out.stride(0), eps,
        BITS=weight.bits, G=weight.group_size, PERM=weight.perm is not None,
        NORM=norm_weight is not None, SILU=silu, ADD=add is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
        BLOCK_K=block_k, EVEN_K=k == block_k, ONE_GROUP=weight.group_size == k,
        PDL=use_pdl, INTERPRET=_INTERPRET, num_warps=cfg.num_warps, num_stages=1,
        **({"launch_pdl": True} if use_pdl else {}))
    return out
