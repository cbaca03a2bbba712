"""Triton projections for few rows (decode steps): a weight stream with the neighbours fused in.

At a decode step of a few sequences a projection reads a whole weight matrix to produce a few
output rows: it is a stream over the weights, and how close it runs to the memory's bandwidth
sets the step's time. ``skinny_linear_triton`` computes ``x @ weight.T`` for up to
``MAX_ROWS`` rows of ``x``; each program owns ``BLOCK_N`` output features (weight rows) over all
of K, so every weight byte is read once and no partial sums leave a program. Three fusions save
a launch and a round trip through memory each:

* prologue ``norm_weight``: RMSNorm of ``x``, computed by every program from ``x`` itself (a few
  KB, served by the L2): the sum of squares builds up beside the products, which 1/rms scales
  at the end;
* epilogue ``silu``: the weight is gate rows then up rows ([2I, K]); a program computes gate
  row j and up row j together and writes ``silu(gate) * up`` ([M, I]) with the rounding of
  ``linear_ref`` -> ``silu_and_mul_ref``;
* epilogue ``add``: the residual stream's add (o_proj and down_proj write ``h + proj``), so
  the next norm needs no residual of its own.

``pdl`` (Hopper and later): the kernel is launched with programmatic dependent launch, so it is
resident while the kernel before it drains; it prefetches the first weight tiles of its rows
into the L2 (they do not depend on that kernel), then waits for the previous grid
(``griddepcontrol.wait``) before it reads ``x``. That hides the launch gap and ramp of each of
the step's ~130 projections. Reference: ``tidegate.kernels.cpu.linear.linear_ref``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The most rows the kernel takes (its tensor-core variant pads rows to 16).
MAX_ROWS = 16
# e4m3 weights take the FMA tiles only (more rows go to tidegate.kernels.gpu.fp8_linear_triton's W8A8 GEMM).
MAX_FP8_ROWS = 2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    """Tile shape and launch options of one projection."""

    block_n: int = 4  # output features per program
    block_k: int = 4096  # reduction step (elements of K per loop iteration)
    num_warps: int = 4
    num_stages: int = 1
    dot: bool = False  # tensor-core tl.dot (rows padded to 16) rather than FMA + reduce
    acc3: bool = False  # FMA: keep [rows, block_n, block_k] partial sums, reduce once at the end
    prefetch: int = 0  # weight tiles per program prefetched into L2 before waiting (pdl only)
    # > 0: that many programs per SM, each looping over blocks of rows (FMA, <= 2 rows)
    persistent: int = 0


@triton.jit
def _prefetch_l2(ptrs):
    # One L2 prefetch per pointer: the loaded value is unused, so it cannot be a plain load
    # (the compiler would drop it).
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_M: tl.constexpr):
    """Program pid's output tile (pid_m, pid_n) of a GEMM. Programs in launch order walk
    GROUP_M row blocks down each weight column block, so a weight tile is read from memory
    once per GROUP_M row blocks, not once per row block."""
    blocks_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    height = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % height, (pid % per_group) // height


@triton.jit
def _store_rows(out, out_u, rstd, offs_m, rows, mask_m, N, add_ptr, out_ptr, stride_am,
                stride_om, SCALE: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr):
    """Epilogue of a [BLOCK_M, BLOCK_N] block of float32 sums: 1/rms, SiLU-and-mul, the add."""
    if SCALE:
        out = out * rstd[:, None]
        out_u = out_u * rstd[:, None]
    mask = mask_m[:, None] & (rows < N)[None, :]
    if SILU:
        # Round the projections first, as the unfused reference's silu_and_mul sees them.
        g = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = out_u.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32) * u
    if ADD:
        # The residual stream: one rounding of projection + residual.
        out += tl.load(add_ptr + offs_m[:, None] * stride_am + rows[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + rows[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_scaled(out, out_u, s_ptr, rows, N, WSCALE: tl.constexpr, SILU: tl.constexpr):
    """WSCALE (e4m3 weights): the finished sums times their weight row's scale (gate row j's
    and, for the SiLU pair, up row N + j's); a row's scale factors out of its sum over K."""
    if WSCALE:
        mask = rows < N
        out = out * tl.load(s_ptr + rows, mask=mask, other=0.0)[None, :]
        if SILU:
            out_u = out_u * tl.load(s_ptr + N + rows, mask=mask, other=0.0)[None, :]
    return out, out_u


@triton.jit
def _skinny_linear_kernel(
    x_ptr, norm_ptr, w_ptr, s_ptr, add_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_am, stride_om, up_offset,
    eps,
    NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC3: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, LINE: tl.constexpr, EVEN_K: tl.constexpr, WSCALE: tl.constexpr,
):
    """out[M, N] = prologue(x)[M, K] @ w[N, K].T (+ add) (SILU: N = I, w holds 2I rows)."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int64: rows x stride passes 2**31 for large LM heads (256k x 8192).
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_rows = w_rows + up_offset  # SILU: the up row paired with each gate row
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]

    if PDL:
        # The weights do not depend on the kernel before this one: pull this program's first
        # tiles towards the L2, let the next kernel launch, then wait for this one's input.
        if PREFETCH > 0:
            lines = (offs_n.to(tl.int64)[:, None] * stride_wn
                     + tl.arange(0, PREFETCH * BLOCK_K // LINE)[None, :] * LINE)
            _prefetch_l2(w_ptr + lines)
            if SILU:
                _prefetch_l2(w_ptr + up_offset + lines)
        gdc_launch_dependents()
        gdc_wait()

    # NORM: the sum of squares builds up beside the products and 1/rms scales the finished
    # sums (each row is normalized by one scalar), so x is read once.
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    if DOT or not ACC3:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xm = mask_m[:, None]
            wm = mask_n[:, None]
        else:
            xm = mask_m[:, None] & ((offs_k[None, :] + k0) < K)
            wm = mask_n[:, None] & ((offs_k[None, :] + k0) < K)
        # Weights are read once: keep them from evicting x and the norm weight in the L2.
        w = tl.load(w_rows + k0, mask=wm, other=0.0, eviction_policy="evict_first")
        a = tl.load(x_rows + k0, mask=xm, other=0.0)
        if NORM:
            a32 = a.to(tl.float32)
            sumsq += tl.sum(a32 * a32, axis=1)
            nw = tl.load(norm_ptr + k0 + offs_k, mask=(offs_k + k0) < K, other=0.0)
            a = (a32 * nw.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
        else:
            a = a.to(out_ptr.dtype.element_ty)
        if DOT:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        elif ACC3:
            acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        else:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if SILU:
            u = tl.load(u_rows + k0, mask=wm, other=0.0, eviction_policy="evict_first")
            if DOT:
                acc_u = tl.dot(a, tl.trans(u), acc_u, input_precision=DOT_PRECISION)
            elif ACC3:
                acc_u += a.to(tl.float32)[:, None, :] * u.to(tl.float32)[None, :, :]
            else:
                acc_u += tl.sum(a.to(tl.float32)[:, None, :] * u.to(tl.float32)[None, :, :],
                                axis=2)

    if DOT or not ACC3:
        out = acc
        out_u = acc_u
    else:
        out = tl.sum(acc, axis=2)
        out_u = tl.sum(acc_u, axis=2)
    rstd = 1.0 / tl.sqrt(sumsq / K + eps)
    out, out_u = _row_scaled(out, out_u, s_ptr, offs_n, N, WSCALE, SILU)
    _store_rows(out, out_u, rstd, offs_m, offs_n, mask_m, N, add_ptr, out_ptr, stride_am,
                stride_om, NORM, SILU, ADD)


@triton.jit
def _persistent_gemv_kernel(
    x_ptr, norm_ptr, w_ptr, s_ptr, add_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_am, stride_om, up_offset,
    eps,
    NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, ONE_SHOT: tl.constexpr,
    WSCALE: tl.constexpr,
):
    """The same projection with one program per resident slot, each looping over blocks of
    BLOCK_N weight rows (pid, pid + programs, ...).

    ONE_SHOT (K <= BLOCK_K): a program normalizes x once for all its blocks, and loads the next
    block's weights before it reduces the current one (two blocks in flight). With PDL its
    first block's weights are loaded *before* it waits for the previous kernel: the programs
    of consecutive projections are resident together, so this kernel's weight stream starts
    while the previous one drains, instead of after it."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    if ONE_SHOT:
        mask_k = offs_k < K
        rows = pid * BLOCK_N + offs_n
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        wm = (rows < N)[:, None] & mask_k[None, :]
        w = tl.load(w_ptrs, mask=wm, other=0.0, eviction_policy="evict_first")
        if SILU:
            u = tl.load(w_ptrs + up_offset, mask=wm, other=0.0, eviction_policy="evict_first")
        else:
            u = w
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        a = tl.load(x_rows, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:  # rms_norm_ref's roundings: normed in x's dtype, times the weight
            a32 = a.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(a32 * a32, axis=1) / K + eps)
            normed = (a32 * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            nw = tl.load(norm_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            a = (normed * nw[None, :]).to(out_ptr.dtype.element_ty)
        a32 = a.to(out_ptr.dtype.element_ty).to(tl.float32)
        for blk in range(pid, n_blocks, nprog):
            nxt = (blk + nprog) * BLOCK_N + offs_n
            nm = (nxt < N)[:, None] & mask_k[None, :]
            nptrs = w_ptr + nxt.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
            w_next = tl.load(nptrs, mask=nm, other=0.0, eviction_policy="evict_first")
            if SILU:
                u_next = tl.load(nptrs + up_offset, mask=nm, other=0.0,
                                 eviction_policy="evict_first")
                out_u = tl.sum(a32[:, None, :] * u.to(tl.float32)[None, :, :], axis=2)
            else:
                u_next = w_next
                out_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            out = tl.sum(a32[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            out, out_u = _row_scaled(out, out_u, s_ptr, blk * BLOCK_N + offs_n, N, WSCALE, SILU)
            _store_rows(out, out_u, rstd, offs_m, blk * BLOCK_N + offs_n, mask_m, N, add_ptr,
                        out_ptr, stride_am, stride_om, False, SILU, ADD)
            w = w_next
            u = u_next
    else:
        if PDL:
            if PREFETCH > 0:  # the first block's first tiles, towards the L2
                lines = ((pid * BLOCK_N + offs_n).to(tl.int64)[:, None] * stride_wn
                         + tl.arange(0, PREFETCH * BLOCK_K // LINE)[None, :] * LINE)
                _prefetch_l2(w_ptr + lines)
                if SILU:
                    _prefetch_l2(w_ptr + up_offset + lines)
            gdc_launch_dependents()
            gdc_wait()
        for blk in range(pid, n_blocks, nprog):
            rows = blk * BLOCK_N + offs_n
            w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                km = (offs_k + k0) < K
                wm = (rows < N)[:, None] & km[None, :]
                w = tl.load(w_rows + k0, mask=wm, other=0.0, eviction_policy="evict_first")
                a = tl.load(x_rows + k0, mask=mask_m[:, None] & km[None, :], other=0.0)
                a32 = a.to(tl.float32)
                if NORM:
                    sumsq += tl.sum(a32 * a32, axis=1)
                    nw = tl.load(norm_ptr + k0 + offs_k, mask=km, other=0.0).to(tl.float32)
                    a32 = a32 * nw[None, :]
                a32 = a32.to(out_ptr.dtype.element_ty).to(tl.float32)
                acc += tl.sum(a32[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
                if SILU:
                    u = tl.load(w_rows + up_offset + k0, mask=wm, other=0.0,
                                eviction_policy="evict_first")
                    acc_u += tl.sum(a32[:, None, :] * u.to(tl.float32)[None, :, :], axis=2)
            rstd = 1.0 / tl.sqrt(sumsq / K + eps)
            acc, acc_u = _row_scaled(acc, acc_u, s_ptr, rows, N, WSCALE, SILU)
            _store_rows(acc, acc_u, rstd, offs_m, rows, mask_m, N, add_ptr, out_ptr, stride_am,
                        stride_om, NORM, SILU, ADD)


def _check(name: str, t: torch.Tensor, ref: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref.device}, got {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def default_config(m: int, n: int, k: int, silu: bool = False) -> SkinnyConfig:
    """The tile per shape, from ``benchmarks/kernels/gemv_sweep.py`` on an H200 at one row with PDL
    (Llama-3-8B shapes; ``benchmarks/results/engine/gpu.md``):

    * rows of K <= 4096 in one tile: persistent programs, 4 per SM, over blocks of 2 weight
      rows (qkv 3.8, o_proj 3.7 TB/s; 1 row for gate_up with its SiLU pair, 4.2 TB/s), except
      a very wide matrix (the LM head, 128k rows) where one program per block of 4 rows
      streams at 4.6 TB/s;
    * longer rows (down_proj, K = 14336): one program per 8 rows, steps of 2048 (3.65 TB/s);
    * more than 2 rows: the tensor cores (rows padded to 16)."""
    if m > 2:
        return SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=True)
    if k > 4096:
        return SkinnyConfig(block_n=8, block_k=2048, num_warps=4, num_stages=1, dot=False)
    whole_row = triton.next_power_of_2(k)
    if n > 32768:
        return SkinnyConfig(block_n=4, block_k=whole_row, num_warps=4, num_stages=1, dot=False)
    return SkinnyConfig(block_n=1 if silu else 2, block_k=whole_row, num_warps=4, num_stages=1,
                        dot=False, persistent=4)


# Triton's interpreter (CPU tensors) runs each loop iteration of a program as NumPy calls on
# tiny tiles: over the GPU's blocks of 1-2 rows, one decode step of the 2-layer test model took
# about a second. The same kernel over blocks of 16 rows gives every row the same sums (a row's
# K is reduced the same way whatever the block) in an eighth to a sixteenth of the iterations.
INTERPRETER_BLOCK_N = 16


@functools.cache
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (a persistent grid's unit); 4 in the interpreter."""
    return _num_sms_of(device.index or 0) if device.type == "cuda" else 4


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper (sm_90) and later, never in the interpreter."""
    return (device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    silu: bool = False,
    add: torch.Tensor | None = None,
    pdl: bool | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] -> out [M, N] = x @ weight.T, where
    * ``weight_scale`` [N] float32: the weight is e4m3 (``Fp8Weight``'s values, at most
      ``MAX_FP8_ROWS`` rows of x) and row n's products are scaled by ``weight_scale[n]``;
    * ``norm_weight`` given: x is RMS-normalized first (``rms_norm_ref`` without a residual);
    * ``silu``: weight is [2I, K] (gate rows, then up rows) and out = silu(gate) * up, [M, I];
    * ``add`` [M, N] given: out += add (the residual stream's add, rounded once);
    * ``pdl``: launch with programmatic dependent launch (default: where supported).
    Out is a new contiguous tensor in the weight's dtype (x's over e4m3 weights).
    """
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    n_rows = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"x has {m} rows; the skinny kernel takes at most {MAX_ROWS}")
    _check("x", x, x, (m, k))
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (weight_scale is not None):
        raise ValueError("e4m3 weights need their weight_scale, and only they take one")
    if fp8:
        _check_fp8(weight, weight_scale, x, m, k)  # type: ignore[arg-type]
    else:
        _check("weight", weight, x, (n_rows, k))
    if silu and n_rows % 2:
        raise ValueError(f"silu needs gate and up rows: weight has an odd {n_rows} rows")
    n = n_rows // 2 if silu else n_rows
    if norm_weight is not None:
        _check("norm_weight", norm_weight, x, (k,))
    if add is not None:
        _check("add", add, x, (m, n))
    out = torch.empty((m, n), dtype=x.dtype if fp8 else weight.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(m, n, k, silu)
    if config is None and not cfg.dot and x.device.type != "cuda":
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n, INTERPRETER_BLOCK_N))
    if fp8 and cfg.dot:
        raise ValueError("e4m3 weights take the FMA tiles (dot=False)")
    use_pdl = pdl_supported(x.device) if pdl is None else pdl
    block_m = max(16, triton.next_power_of_2(m)) if cfg.dot else triton.next_power_of_2(m)
    # Both kernels take the same tensors, sizes, strides, fusions and tile.
    args = (x, x if norm_weight is None else norm_weight, weight,
            x if weight_scale is None else weight_scale, out if add is None else add,
            out, m, n, k,
            x.stride(0), weight.stride(0), 0 if add is None else add.stride(0), out.stride(0),
            n * weight.stride(0), eps)
    common = dict(
        NORM=norm_weight is not None, SILU=silu, ADD=add is not None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PDL=use_pdl, PREFETCH=cfg.prefetch if use_pdl else 0, LINE=128 // weight.element_size(),
        WSCALE=fp8, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if use_pdl else {}))
    blocks = triton.cdiv(n, cfg.block_n)
    if cfg.persistent and not cfg.dot:
        grid = (min(blocks, cfg.persistent * _num_sms(x.device)),)
        _persistent_gemv_kernel[grid](*args, ONE_SHOT=k <= cfg.block_k, **common)
    else:
        _skinny_linear_kernel[(blocks,)](
            *args, DOT=cfg.dot, ACC3=cfg.acc3, EVEN_K=k % cfg.block_k == 0,
            # float32 weights: exact products, not TF32's 10-bit mantissas.
            DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", **common)
    return out


def _check_fp8(weight: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, m: int, k: int
               ) -> None:
    n = weight.shape[0]
    if m > MAX_FP8_ROWS:
        raise ValueError(f"x has {m} rows; e4m3 weights stream for at most {MAX_FP8_ROWS}")
    for name, t, shape in (("weight", weight, (n, k)), ("weight_scale", scale, (n,))):
        if t.device != x.device:
            raise ValueError(f"{name} must be on {x.device}, got {t.device}")
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {shape}, got {tuple(t.shape)}")
    if scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32, got {scale.dtype}")
