"""Triton projections with weight-only INT4/INT8 weights (``IntWeight``), dequantized in registers.

``int_linear_triton`` computes ``x @ values.T`` for an ``IntWeight`` [N, K] without ever writing
a float matrix: each program loads the packed bytes of its tile, turns them into
``(q - zero) * scale`` in float32 registers and uses them at once. It fuses the same neighbours
as ``tidegate.kernels.gpu.linear_triton`` (RMSNorm prologue, SiLU-and-mul epilogue, residual add; the
epilogue is that module's ``_store_rows``) and reads act-order weights' ``x[:, perm]`` by
gathering x's columns (and the norm weight's) through ``perm`` in the kernel. Two paths:

* few rows (decode, up to ``MAX_FMA_ROWS``): FMA. Each program owns ``BLOCK_N`` weight rows
  over all of K. A K-step is ``SUB_TILES`` sub-tiles of ``SUB_K`` columns, each inside one
  group, so a step may span many groups (a long weight stream per program) while its scales
  and zeros are loaded per (row, sub-tile), not per weight. Products build up element by
  element in partial sums of the byte tile's own shape and layout, reduced once at the end;
  one group per row (G = K) leaves the scale to multiply the finished sums.
* more rows (prefill): [BLOCK_M, BLOCK_N] output tiles on the tensor cores; a K-step lies
  inside one group, its weights are dequantized to x's dtype and fed to ``tl.dot``.

4-bit rows keep each run of 32 columns in 16 bytes (low nibbles columns 0-15, high 16-31): a
byte tile yields two half-tiles of weights, and x is loaded as the two matching column sets
(runs of 16 contiguous columns), so no nibble ever moves between lanes.
Reference: ``IntWeight.dequantize`` then ``tidegate.kernels.cpu.linear.linear_ref`` / ``norm_linear_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidegate.kernels.gpu.int_gemv_triton import IntGemvConfig, _load_x, int_gemv_triton
from tidegate.kernels.gpu.int_gemv_triton import applies as gemv_applies
from tidegate.kernels.gpu.linear_triton import SUPPORTED_DTYPES, _grouped_tile, _store_rows
from tidegate.kernels.weights.int_weight import BITS, IntWeight

# The FMA path keeps partial sums per row of x, in registers of the weight tile's shape (so at
# most this many rows); beyond them the default tiles take the tensor cores.
MAX_FMA_ROWS = 2
# OR-ing an integer q < 2**23 into the mantissa of the float 2**23 gives the float 2**23 + q:
# an exact int -> float conversion in one logic op and, with the zero folded into the bias, one
# subtraction (a cvt per weight issues at a fraction of the FMA rate, and this loop is bound by
# its arithmetic, not by memory).
_MAGIC = tl.constexpr(0x4B000000)
_TWO_23 = tl.constexpr(8388608.0)


@dataclass(frozen=True, slots=True)
class IntLinearConfig:
    """Tile shape and launch options of one integer-weight projection."""

    block_m: int = 16  # dot: rows of x per program (FMA: all of x's rows, at most 2)
    block_n: int = 4  # weight rows (output features) per program
    block_k: int = 1024  # columns per loop step (dot: capped so a step lies inside one group)
    num_warps: int = 4
    num_stages: int = 1
    dot: bool = False  # tensor-core tl.dot over [block_m, block_n] tiles rather than FMA + reduce
    group_m: int = 8  # dot: row blocks launched together, so they share weight tiles in the L2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps", "group_m"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"IntLinearConfig.{name} must be a power of two, got {v}")
        if self.block_k < 16 or (self.dot and min(self.block_m, self.block_n) < 16):
            raise ValueError("IntLinearConfig: block_k (and for dot block_m, block_n) must be "
                             f">= 16, got {self}")
        if self.num_stages < 1:
            raise ValueError(f"IntLinearConfig.num_stages must be >= 1, got {self.num_stages}")


def default_config(m: int, n: int, k: int, group: int, bits: int) -> IntLinearConfig:
    """The tile per shape (``n``: output features), from ``benchmarks/kernels/int_gemv_sweep.py`` on an
    H200 at Llama-3-8B's decode shapes (INT4 G=128 and INT8 per channel; first sweep, to tune):

    * up to ``MAX_FMA_ROWS`` rows, FMA: 8-bit, 4 weight rows a program, 512 columns a step; 4-bit,
      8 rows and 1024 columns (512 bytes of each row), 512 columns for wide matrices (gate_up,
      its SiLU pair doubling the rows) and 4 rows of 2048 columns for long rows (down_proj).
      Hundreds to thousands of programs, 1-2.4 TB/s of packed weights: the dequantization's
      arithmetic bounds these, not the memory (INT4 still beats the bf16 stream by 1.1-1.2x);
    * more rows: tensor-core tiles growing with the rows; a step of 128 4-bit or 256 8-bit
      columns (capped by the kernel to lie inside one group)."""
    del group  # the kernel fits the step to the groups (_tiling)
    if m <= MAX_FMA_ROWS:
        if bits == 8:
            block_n, block_k = 4, 512
        elif k > 4096:
            block_n, block_k = 4, 2048
        else:
            block_n, block_k = 8, 512 if n > 8192 else 1024
        block_k = min(block_k, max(32, triton.next_power_of_2(k)))  # short rows: one step
        return IntLinearConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=1)
    block_k = 128 if bits == 4 else 256
    if m <= 16:
        return IntLinearConfig(block_m=16, block_n=32, block_k=block_k, num_warps=4,
                               num_stages=3, dot=True)
    if m <= 64:
        return IntLinearConfig(block_m=32, block_n=64, block_k=block_k, num_warps=4,
                               num_stages=3, dot=True)
    return IntLinearConfig(block_m=64, block_n=128, block_k=min(block_k, 128), num_warps=4,
                           num_stages=3, dot=True)


@triton.jit
def _minus_zero(q, zero_biased):
    """(q - zero) in float32, exactly: q int32 in 0..255, zero_biased = zero + 2**23."""
    return (q | _MAGIC).to(tl.float32, bitcast=True) - zero_biased


@triton.jit
def _group_params(s_ptr, z_ptr, rows, group, gmask, stride_sn, stride_zn):
    """Scales and zeros (plus 2**23, see _minus_zero) of rows x groups, [BLOCK_N, GROUPS, 1]."""
    s = tl.load(s_ptr + rows[:, None] * stride_sn + group[None, :], mask=gmask, other=0.0)
    z = tl.load(z_ptr + rows[:, None] * stride_zn + group[None, :], mask=gmask, other=0)
    return s[:, :, None], (z.to(tl.float32) + _TWO_23)[:, :, None]


@triton.jit
def _dequant_step(q_ptr, s_ptr, z_ptr, rows, wmask, kb, offs_b, start, gmask, G, s, zb,
                  stride_qn, stride_sn, stride_zn,
                  BITS: tl.constexpr, SPLIT: tl.constexpr, ONE_GROUP: tl.constexpr):
    """One K-tile of weight rows ``rows`` (int64) in float32, [BLOCK_N, SUB_TILES, SUB_BYTES]
    (4 bits: the low nibbles' values and the high nibbles'; 8 bits: the values twice).

    kb: the tile's first byte; offs_b: the bytes of its row; start [SUB_TILES]: its sub-tiles'
    first columns. ONE_GROUP: s, zb are the rows' one scale and biased zero [BLOCK_N, 1, 1],
    and the values are left unscaled (the scale multiplies the finished sums)."""
    q = tl.load(q_ptr + rows[:, None, None] * stride_qn + (kb + offs_b)[None], mask=wmask,
                other=0, eviction_policy="evict_first").to(tl.int32)
    if not ONE_GROUP:  # each sub-tile lies inside one group
        s, zb = _group_params(s_ptr, z_ptr, rows, start // G, gmask, stride_sn, stride_zn)
    if BITS == 8:
        w = _minus_zero(q, zb)
        if not ONE_GROUP:
            w = w * s
        return w, w
    s_hi = s
    zb_hi = zb
    if SPLIT:  # G % 32 == 16: a run's high half starts the next group
        s_hi, zb_hi = _group_params(s_ptr, z_ptr, rows, (start + 16) // G, gmask, stride_sn,
                                    stride_zn)
    lo = _minus_zero(q & 0xF, zb)
    hi = _minus_zero(q >> 4, zb_hi)
    if not ONE_GROUP:
        lo = lo * s
        hi = hi * s_hi
    return lo, hi


@triton.jit
def _fma(acc, x, x_hi, lo, hi, BITS: tl.constexpr):
    """acc [BLOCK_N, SUB_TILES, SUB_BYTES] += one row of x times the tile, element by element."""
    acc += x[None] * lo
    if BITS == 4:
        acc += x_hi[None] * hi
    return acc


@triton.jit
def _load_row(x_ptr, perm_ptr, norm_ptr, m, M, stride_xm, cols, kmask, sq,
              BITS: tl.constexpr, PERM: tl.constexpr, NORM: tl.constexpr, EVEN_K: tl.constexpr):
    """Row m of x at the tile's columns (and the high nibbles' columns), and sq plus their
    squares (NORM)."""
    xmask = m < M
    if not EVEN_K:
        xmask = xmask & kmask
    x, x_sq = _load_x(x_ptr + m * stride_xm, perm_ptr, norm_ptr, cols, xmask, kmask, PERM, NORM)
    x_hi = x
    if BITS == 4:
        x_hi, hi_sq = _load_x(x_ptr + m * stride_xm, perm_ptr, norm_ptr, cols + 16, xmask,
                              kmask, PERM, NORM)
        x_sq += hi_sq
    if NORM:
        sq += x_sq
    return x, x_hi, sq


@triton.jit
def _row_sums(acc, s, ONE_GROUP: tl.constexpr):
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if ONE_GROUP:
        out = out * tl.sum(tl.sum(s, axis=2), axis=1)
    return out


@triton.jit(do_not_specialize=["M"])  # rows vary by step: not a compile key
def _few_rows_kernel(
    x_ptr, perm_ptr, norm_ptr, q_ptr, s_ptr, z_ptr, add_ptr, out_ptr,
    M, N, K, G,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_am, stride_om,
    eps,
    BITS: tl.constexpr, PERM: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
    ADD: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUB_TILES: tl.constexpr, SUB_K: tl.constexpr, SUB_BYTES: tl.constexpr, EVEN_K: tl.constexpr,
    ONE_GROUP: tl.constexpr,
):
    """out[M, N] = prologue(x) @ values.T (+ add) for M <= 2, FMA + reduce; each program owns
    BLOCK_N weight rows (SILU: gate row j and up row N + j) over all of K.

    Each row of x has its own [BLOCK_N, SUB_TILES, SUB_BYTES] partial sums, the weight tile's
    shape: they build up element by element in the layout the bytes are loaded in (no shuffle
    of the tile between threads) and are reduced once at the end (a reduction per step would
    cost a round of warp shuffles per weight row and sub-tile every few hundred bytes)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    gate = rows.to(tl.int64)  # rows x row bytes passes 2**31 on large LM heads
    up = gate + N
    sub = tl.arange(0, SUB_TILES)
    byte = tl.arange(0, SUB_BYTES)
    first = sub * SUB_K
    offs_b = sub[:, None] * SUB_BYTES + byte[None, :]
    if BITS == 4:  # the column of each byte's low nibble; its high nibble's is 16 further
        col = first[:, None] + (byte // 16 * 32 + byte % 16)[None, :]
    else:
        col = first[:, None] + byte[None, :]
    # One group per row: its scale and zero are loaded once (the group index is 0).
    g0 = tl.zeros([1], dtype=tl.int32)
    s, zb = _group_params(s_ptr, z_ptr, gate, g0, mask_n[:, None], stride_sn, stride_zn)
    s_u = s
    zb_u = zb
    if SILU:
        s_u, zb_u = _group_params(s_ptr, z_ptr, up, g0, mask_n[:, None], stride_sn, stride_zn)

    sq0 = tl.zeros([SUB_TILES, SUB_BYTES], dtype=tl.float32)
    sq1 = tl.zeros([SUB_TILES, SUB_BYTES], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_N, SUB_TILES, SUB_BYTES], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, SUB_TILES, SUB_BYTES], dtype=tl.float32)
    acc0_u = tl.zeros([BLOCK_N, SUB_TILES, SUB_BYTES], dtype=tl.float32)
    acc1_u = tl.zeros([BLOCK_N, SUB_TILES, SUB_BYTES], dtype=tl.float32)
    # Steps counted in tiles: k0 and kb are then known multiples of the tile, so the loads
    # vectorize (k0 * BITS // 8 would hide that behind a division).
    for tile in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = tile * BLOCK_K
        kb = tile * (BLOCK_K * BITS // 8)
        cols = k0 + col
        kmask = cols < K
        wmask = mask_n[:, None, None]
        if not EVEN_K:
            wmask = wmask & kmask[None]
        start = k0 + first
        gmask = mask_n[:, None] & (start < K)[None, :]
        x0, x0_hi, sq0 = _load_row(x_ptr, perm_ptr, norm_ptr, 0, M, stride_xm, cols, kmask,
                                   sq0, BITS, PERM, NORM, EVEN_K)
        if BLOCK_M == 2:
            x1, x1_hi, sq1 = _load_row(x_ptr, perm_ptr, norm_ptr, 1, M, stride_xm, cols, kmask,
                                       sq1, BITS, PERM, NORM, EVEN_K)
        lo, hi = _dequant_step(q_ptr, s_ptr, z_ptr, gate, wmask, kb, offs_b, start, gmask, G,
                               s, zb, stride_qn, stride_sn, stride_zn, BITS, SPLIT, ONE_GROUP)
        acc0 = _fma(acc0, x0, x0_hi, lo, hi, BITS)
        if BLOCK_M == 2:
            acc1 = _fma(acc1, x1, x1_hi, lo, hi, BITS)
        if SILU:
            lo, hi = _dequant_step(q_ptr, s_ptr, z_ptr, up, wmask, kb, offs_b, start, gmask, G,
                                   s_u, zb_u, stride_qn, stride_sn, stride_zn, BITS, SPLIT,
                                   ONE_GROUP)
            acc0_u = _fma(acc0_u, x0, x0_hi, lo, hi, BITS)
            if BLOCK_M == 2:
                acc1_u = _fma(acc1_u, x1, x1_hi, lo, hi, BITS)

    offs_m = tl.arange(0, BLOCK_M)
    first_row = (offs_m == 0)[:, None]
    out = tl.where(first_row, _row_sums(acc0, s, ONE_GROUP)[None, :],
                   _row_sums(acc1, s, ONE_GROUP)[None, :])
    out_u = tl.where(first_row, _row_sums(acc0_u, s_u, ONE_GROUP)[None, :],
                     _row_sums(acc1_u, s_u, ONE_GROUP)[None, :])
    sumsq = tl.where(offs_m == 0, tl.sum(tl.sum(sq0, axis=1), axis=0),
                     tl.sum(tl.sum(sq1, axis=1), axis=0))
    rstd = 1.0 / tl.sqrt(sumsq / K + eps)
    _store_rows(out, out_u, rstd, offs_m, rows, offs_m < M, N, add_ptr, out_ptr, stride_am,
                stride_om, NORM, SILU, ADD)


@triton.jit
def _dot_tile(acc, a, a_hi, q_ptr, s_ptr, z_ptr, rows, mask_n, k0, kb, G, byte, kmask,
              stride_qn, stride_sn, stride_zn,
              BITS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
              PRECISION: tl.constexpr):
    """acc += a @ values[rows, tile].T for one K-tile inside one group (a, a_hi: x's columns of
    the low and high nibbles, in x's dtype)."""
    rows = rows.to(tl.int64)
    wmask = mask_n[:, None]
    if not EVEN_K:
        wmask = wmask & kmask[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qn + (kb + byte)[None, :],
                mask=wmask, other=0, eviction_policy="evict_first").to(tl.int32)
    group = k0 // G
    s = tl.load(s_ptr + rows * stride_sn + group, mask=mask_n, other=0.0)[:, None]
    z = tl.load(z_ptr + rows * stride_zn + group, mask=mask_n, other=0).to(tl.float32)[:, None]
    if BITS == 8:
        w = (_minus_zero(q, z + _TWO_23) * s).to(a.dtype)
        return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    w = (_minus_zero(q & 0xF, z + _TWO_23) * s).to(a.dtype)
    acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    if SPLIT:  # G % 32 == 16: the high half of the (one) run starts the next group
        group_hi = (k0 + 16) // G
        s = tl.load(s_ptr + rows * stride_sn + group_hi, mask=mask_n, other=0.0)[:, None]
        z = tl.load(z_ptr + rows * stride_zn + group_hi, mask=mask_n,
                    other=0).to(tl.float32)[:, None]
    w = (_minus_zero(q >> 4, z + _TWO_23) * s).to(a.dtype)
    return tl.dot(a_hi, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["M"])  # rows vary by step: not a compile key
def _dot_kernel(
    x_ptr, perm_ptr, norm_ptr, q_ptr, s_ptr, z_ptr, add_ptr, out_ptr,
    M, N, K, G,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_am, stride_om,
    eps,
    BITS: tl.constexpr, PERM: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
    ADD: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """The same projection over [BLOCK_M, BLOCK_N] output tiles on the tensor cores."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < M
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    byte = tl.arange(0, BLOCK_K * BITS // 8)
    if BITS == 4:
        col = byte // 16 * 32 + byte % 16
    else:
        col = byte
    x_rows = x_ptr + offs_m[:, None] * stride_xm

    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(0, tl.cdiv(K, BLOCK_K)):  # in tiles: see _few_rows_kernel
        k0 = tile * BLOCK_K
        kb = tile * (BLOCK_K * BITS // 8)
        cols = k0 + col
        kmask = cols < K
        xmask = mask_m[:, None]
        if not EVEN_K:
            xmask = xmask & kmask[None, :]
        x, sq = _load_x(x_rows, perm_ptr, norm_ptr, cols, xmask, kmask, PERM, NORM)
        a = x.to(x_ptr.dtype.element_ty)
        a_hi = a
        if BITS == 4:
            x_hi, sq_hi = _load_x(x_rows, perm_ptr, norm_ptr, cols + 16, xmask, kmask, PERM,
                                  NORM)
            sq += sq_hi
            a_hi = x_hi.to(x_ptr.dtype.element_ty)
        if NORM:
            sumsq += tl.sum(sq, axis=1)
        acc = _dot_tile(acc, a, a_hi, q_ptr, s_ptr, z_ptr, rows, mask_n, k0, kb, G, byte, kmask,
                        stride_qn, stride_sn, stride_zn, BITS, SPLIT, EVEN_K, PRECISION)
        if SILU:
            acc_u = _dot_tile(acc_u, a, a_hi, q_ptr, s_ptr, z_ptr, rows + N, mask_n, k0, kb, G,
                              byte, kmask, stride_qn, stride_sn, stride_zn, BITS, SPLIT, EVEN_K,
                              PRECISION)
    rstd = 1.0 / tl.sqrt(sumsq / K + eps)
    _store_rows(acc, acc_u, rstd, offs_m, rows, mask_m, N, add_ptr, out_ptr, stride_am,
                stride_om, NORM, SILU, ADD)


@dataclass(frozen=True, slots=True)
class _Tiling:
    """How a config's K-step meets the weight's groups."""

    block_k: int  # columns per loop step
    sub_k: int  # columns of a sub-tile, which lies inside one group
    split: bool  # 4 bits, G % 32 == 16: a run's two nibble halves may sit in different groups


def _tiling(cfg: IntLinearConfig, bits: int, group: int, k: int) -> _Tiling:
    if bits == 4 and cfg.block_k < 32:
        raise ValueError(f"4-bit tiles hold whole runs of 32 columns: block_k {cfg.block_k}")
    if group == k:  # one group per row: any step lies inside it
        sub = cfg.block_k
    elif group % 16:
        raise ValueError(f"group size {group} must be K ({k}) or a multiple of 16")
    else:  # the largest power of two dividing G, so sub-tiles never straddle a group
        sub = max(min(cfg.block_k, group & -group), 32 if bits == 4 else 16)
    split = bits == 4 and group != k and group % 32 != 0
    return _Tiling(sub if cfg.dot else cfg.block_k, sub, split)


def _check(name: str, t: torch.Tensor, device: torch.device, shape: tuple[int, ...],
           dtypes: tuple[torch.dtype, ...]) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported (takes {dtypes})")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _check_inputs(x: torch.Tensor, weight: IntWeight, norm_weight: torch.Tensor | None,
                  silu: bool, add: torch.Tensor | None) -> int:
    """Raise ValueError for anything the kernels cannot take; return the output width."""
    if not isinstance(weight, IntWeight):
        raise ValueError(f"weight must be an IntWeight, got {type(weight).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    n_rows, k = weight.shape
    if weight.bits not in BITS:
        raise ValueError(f"{weight.bits}-bit weights are not supported (bits: {BITS})")
    if k == 0:
        raise ValueError("the weight has no columns")
    m = x.shape[0]
    _check("x", x, x.device, (m, k), SUPPORTED_DTYPES)
    groups = k // weight.group_size
    _check("qweight", weight.qweight, x.device, (n_rows, k * weight.bits // 8), (torch.uint8,))
    _check("scales", weight.scales, x.device, (n_rows, groups), (torch.float32,))
    _check("zeros", weight.zeros, x.device, (n_rows, groups), (torch.uint8,))
    if weight.perm is not None:
        _check("perm", weight.perm, x.device, (k,), (torch.int64,))
    if silu and n_rows % 2:
        raise ValueError(f"silu needs gate and up rows: weight has an odd {n_rows} rows")
    n = n_rows // 2 if silu else n_rows
    if norm_weight is not None:
        _check("norm_weight", norm_weight, x.device, (k,), SUPPORTED_DTYPES)
    if add is not None:
        _check("add", add, x.device, (m, n), SUPPORTED_DTYPES)
    return n


def int_linear_triton(
    x: torch.Tensor,
    weight: IntWeight,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    silu: bool = False,
    add: torch.Tensor | None = None,
    config: IntLinearConfig | IntGemvConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (any M; last dim contiguous), weight an ``IntWeight`` [N, K] -> out [M, N] =
    x @ weight.dequantize().T, where
    * ``norm_weight`` [K] given: x is RMS-normalized first (``rms_norm_ref`` without residual);
    * ``silu``: the weight is [2I, K] (gate rows, then up rows), out = silu(gate) * up, [M, I];
    * ``add`` [M, N] given: out += add (the residual stream's add, rounded once).
    Out is a new contiguous tensor in x's dtype. No host synchronization (graph-capturable).
    One or two rows take the integer-dot GEMV (``tidegate.kernels.gpu.int_gemv_triton``: activations
    rounded to int8 per run of 32) where the groups hold whole runs, unless ``config`` is an
    ``IntLinearConfig`` (its FMA path keeps the activations as they are).
    """
    n = _check_inputs(x, weight, norm_weight, silu, add)
    m, k = x.shape
    if isinstance(config, IntGemvConfig) or (config is None and gemv_applies(weight, m)):
        return int_gemv_triton(x, weight, n, norm_weight=norm_weight, eps=eps, silu=silu,
                               add=add, config=config)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(m, n, k, weight.group_size, weight.bits)
    if not cfg.dot and m > MAX_FMA_ROWS:
        raise ValueError(f"x has {m} rows; the FMA path takes at most {MAX_FMA_ROWS}")
    tiling = _tiling(cfg, weight.bits, weight.group_size, k)
    args = (x, x if weight.perm is None else weight.perm, x if norm_weight is None else norm_weight,
            weight.qweight, weight.scales, weight.zeros, out if add is None else add, out,
            m, n, k, weight.group_size,
            x.stride(0), weight.qweight.stride(0), weight.scales.stride(0),
            weight.zeros.stride(0), 0 if add is None else add.stride(0), out.stride(0), eps)
    common = dict(BITS=weight.bits, PERM=weight.perm is not None, NORM=norm_weight is not None,
                  SILU=silu, ADD=add is not None, SPLIT=tiling.split, BLOCK_N=cfg.block_n,
                  BLOCK_K=tiling.block_k, EVEN_K=k % tiling.block_k == 0,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.dot:
        block_m = min(cfg.block_m, max(16, triton.next_power_of_2(m)))
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, cfg.block_n),)
        _dot_kernel[grid](*args, BLOCK_M=block_m, GROUP_M=cfg.group_m,
                          # float32 x: exact products, not TF32's 10-bit mantissas.
                          PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common)
    else:
        _few_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
            *args, BLOCK_M=triton.next_power_of_2(m), SUB_TILES=tiling.block_k // tiling.sub_k,
            SUB_K=tiling.sub_k, SUB_BYTES=tiling.sub_k * weight.bits // 8,
            ONE_GROUP=weight.group_size == k, **common)
    return out
