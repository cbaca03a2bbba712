"""The entry points models call; each picks its implementation per call (``tidegate.kernels.dispatch``).

CUDA tensors go to the Triton kernels (``*_triton.py``, each beside its plain-torch reference);
CPU tensors to the reference or, where one exists, a native C kernel. Callers never import an
implementation. The Triton modules are imported on first use, so a CPU-only install never
needs Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidegate.kernels.cpu.decoder_layer import DecoderWeights, LayerCall
from tidegate.kernels.cpu.linear import linear as linear_impl
from tidegate.kernels.cpu.native_cpu import (
    native_kernels,
    rms_norm_applies,
    rotary_store_kv_applies,
    silu_and_mul_applies,
)
from tidegate.kernels.cpu.paged_attention import (
    PagedAttentionMetadata,
    PagedLayer,
    PagedStack,
    paged_decode_attention,
    store_kv_ref,
)
from tidegate.kernels.cpu.paged_attention import paged_attention as paged_attention_cpu
from tidegate.kernels.dispatch import SERVE_ROWS, use_triton
from tidegate.kernels.reference.activation import gelu_and_mul_ref, silu_and_mul_ref
from tidegate.kernels.reference.lora import LoraRows, LoraStack, Norm, add_lora_ref
from tidegate.kernels.reference.moe import moe_ref
from tidegate.kernels.reference.rmsnorm import rms_norm_ref
from tidegate.kernels.reference.rotary import rotary_ref
from tidegate.kernels.reference.token_bitmask import apply_token_bitmask_ref
from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.kernels.weights.packed_weight import PackedWeight

__all__ = ["add_lora", "apply_token_bitmask", "cpu_layout", "decoder_layer", "decoder_layers", "embedding", "fuses_projections",
           "gelu_and_mul", "linear", "lora_rows", "moe", "norm_linear", "norm_project",
           "paged_attention", "paged_decode", "rms_norm", "rotary",
           "rotary_store_kv", "silu_and_mul", "silu_project", "store_kv"]

_layer_call: LayerCall | None = None


def fuses_projections(x: torch.Tensor) -> bool:
    """Whether projections of ``x`` [T, H] run on the fused few-row kernel (decode steps of
    few sequences on a GPU): models then fold their norms and residual adds into
    ``norm_linear`` and ``linear(add=...)`` rather than calling ``rms_norm`` themselves."""
    return x.dim() == 2 and 0 < x.shape[0] <= SERVE_ROWS and use_triton(x)


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight | IntWeight | Fp8Weight,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ add [M, N], the residual stream's add) -> [M, N].
    ``weight`` may be packed GGUF blocks (``tidegate.kernels.weights.packed_weight``; CPU), integers with
    group scales (``tidegate.kernels.weights.int_weight``; CPU and Triton, any number of rows) or e4m3 values
    with row scales (``tidegate.kernels.weights.fp8_weight``; CPU: weight-only, Triton: W8A8 beyond two rows).
    """
    if isinstance(weight, Fp8Weight):
        if use_triton(x):
            return _fp8_linear_triton(x, weight, add=add)
        return linear_impl(x, weight, add)
    if isinstance(weight, IntWeight):
        if use_triton(x):
            from tidegate.kernels.gpu.int_linear_triton import int_linear_triton

            return int_linear_triton(x, weight, add=add)
        return linear_impl(x, weight, add)
    if fuses_projections(x) and not isinstance(weight, PackedWeight):
        from tidegate.kernels.gpu.linear_triton import skinny_linear_triton

        return skinny_linear_triton(x, weight, add=add)
    return linear_impl(x, weight, add)


def cpu_layout(weight: PackedWeight) -> PackedWeight:
    """``weight`` (multiplied on the CPU) in the layout this CPU's native kernels read fastest:
    the same values, some parts perhaps repacked (``NativeCpuKernels.repack_lanes8``); itself
    where the native kernels are off."""
    native = native_kernels()
    return weight if native is None else native.repack_lanes8(weight)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor | PackedWeight | IntWeight | Fp8Weight, silu: bool = False
                ) -> torch.Tensor:
    """rms_norm(x) @ weight.T, then silu(gate) * up if ``silu`` (weight: gate rows, then up
    rows); one weight stream with the norm and SiLU fused where the few-row kernel serves."""
    if isinstance(weight, Fp8Weight) and fuses_projections(x):
        return _fp8_linear_triton(x, weight, norm_weight=norm_weight, eps=eps, silu=silu)
    if isinstance(weight, IntWeight) and fuses_projections(x):
        from tidegate.kernels.gpu.int_linear_triton import int_linear_triton

        return int_linear_triton(x, weight, norm_weight=norm_weight, eps=eps, silu=silu)
    if fuses_projections(x) and isinstance(weight, torch.Tensor):
        from tidegate.kernels.gpu.linear_triton import skinny_linear_triton

        return skinny_linear_triton(x, weight, norm_weight=norm_weight, eps=eps, silu=silu)
    out = linear(rms_norm(x, norm_weight, eps)[0], weight)
    return silu_and_mul(out) if silu else out


def norm_project(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None,
                 weight: torch.Tensor | PackedWeight | IntWeight | Fp8Weight
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(hidden + residual) @ weight.T, the new residual stream): a step of many rows
    (few rows on a GPU fold the norm into the weight stream instead: ``norm_linear``). e4m3
    weights on Triton get the normed rows rounded to e4m3 by the norm kernel itself."""
    if isinstance(weight, Fp8Weight) and _w8a8(hidden):
        from tidegate.kernels.gpu.fp8_linear_triton import fp8_gemm
        from tidegate.kernels.gpu.rmsnorm_triton import rms_norm_fp8

        rows, residual = rms_norm_fp8(hidden, norm_weight, eps, residual)
        return fp8_gemm(rows, weight), residual
    x, residual = rms_norm(hidden, norm_weight, eps, residual)
    return linear(x, weight), residual


def silu_project(gate_up: torch.Tensor,
                 weight: torch.Tensor | PackedWeight | IntWeight | Fp8Weight) -> torch.Tensor:
    """silu_and_mul(gate_up) @ weight.T (the down projection of a step of many rows); e4m3
    weights on Triton get the activation rounded to e4m3 by the SiLU kernel itself."""
    if isinstance(weight, Fp8Weight) and _w8a8(gate_up):
        from tidegate.kernels.gpu.activation_triton import silu_and_mul_fp8
        from tidegate.kernels.gpu.fp8_linear_triton import fp8_gemm

        return fp8_gemm(silu_and_mul_fp8(gate_up), weight)
    return linear(silu_and_mul(gate_up), weight)


def _w8a8(x: torch.Tensor) -> bool:
    """Whether e4m3 weights meet ``x`` in a W8A8 GEMM (Triton, more than a row or two)."""
    from tidegate.kernels.gpu.linear_triton import MAX_FP8_ROWS

    return x.dim() == 2 and x.shape[0] > MAX_FP8_ROWS and use_triton(x)


def _fp8_linear_triton(x: torch.Tensor, weight: Fp8Weight, *,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
                       silu: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """e4m3 weights on Triton: a weight stream (activations unrounded) for a row or two, the
    W8A8 GEMM beyond (no norm prologue there: many-row steps normalize first)."""
    from tidegate.kernels.gpu.linear_triton import MAX_FP8_ROWS, skinny_linear_triton

    if x.shape[0] <= MAX_FP8_ROWS:
        return skinny_linear_triton(x, weight.weight, weight_scale=weight.scales,
                                    norm_weight=norm_weight, eps=eps, silu=silu, add=add)
    from tidegate.kernels.gpu.fp8_linear_triton import fp8_gemm

    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)[0]
    return fp8_gemm(x, weight, silu=silu, add=add)


def decoder_layer(hidden: torch.Tensor, residual: torch.Tensor | None, weights: DecoderWeights,
                  positions: torch.Tensor, rope_cache: torch.Tensor, paged: PagedLayer
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A whole decoder layer of a step in one native call: (hidden, residual) after it, the
    op-by-op path's bits. None where that call does not serve (it needs the CPU's native
    kernels and every projection on 8-bit activations): the caller goes op by op."""
    call = _layer_call_for(hidden)
    if call is None or not call.applies(hidden, weights, paged):
        return None
    return call(hidden, residual, weights, positions, rope_cache, paged)


def _layer_call_for(hidden: torch.Tensor) -> LayerCall | None:
    """The process's whole-layer call over the native kernels; None off the CPU or without
    them."""
    global _layer_call
    if hidden.device.type != "cpu" or (native := native_kernels()) is None:
        return None
    if _layer_call is None or _layer_call.native is not native:
        _layer_call = LayerCall(native)
    return _layer_call


def decoder_layers(hidden: torch.Tensor, weights: list[DecoderWeights], positions: torch.Tensor,
                   rope_cache: torch.Tensor, paged: PagedStack
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every decoder layer of a step in one native call: (hidden, residual) after the last,
    the bits ``decoder_layer`` gives layer by layer. None where a layer's call would not serve
    (``decoder_layer``'s conditions): the caller goes layer by layer."""
    call = _layer_call_for(hidden)
    return None if call is None else call.stack(hidden, weights, positions, rope_cache, paged)


def embedding(ids: torch.Tensor, weight: torch.Tensor | PackedWeight) -> torch.Tensor:
    """Rows ``ids`` [T] of the embedding matrix -> [T, H] (packed: only those rows
    dequantized)."""
    if not isinstance(weight, PackedWeight):
        return F.embedding(ids, weight)
    native = native_kernels() if ids.device.type == "cpu" else None
    return (native.dequantize_rows(weight, ids) if native is not None
            else weight.dequantize_rows(ids))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual), new_residual = x + residual (or x); see ``rms_norm_ref``."""
    if use_triton(x):
        from tidegate.kernels.gpu.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    if rms_norm_applies(x, weight, residual):
        return native_kernels().rms_norm(x, weight, eps, residual)  # type: ignore[union-attr]
    return rms_norm_ref(x, weight, eps, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] rotated by their positions. The Triton kernel rotates in place
    and returns its inputs; callers use the returned tensors either way."""
    if use_triton(q):
        from tidegate.kernels.gpu.rotary_triton import rotary_triton

        return rotary_triton(q, k, positions, cache)
    return rotary_ref(q, k, positions, cache)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary`` then ``store_kv`` of the rotated keys and the values: one launch on Triton.
    Returns the rotated (q, k)."""
    if use_triton(q):
        from tidegate.kernels.gpu.rotary_triton import rotary_store_kv_triton

        return rotary_store_kv_triton(q, k, v, positions, cache, key_cache, value_cache,
                                      slot_mapping)
    if rotary_store_kv_applies(q, k, v, cache, key_cache) and value_cache.is_contiguous():
        return native_kernels().rotary_store_kv(  # type: ignore[union-attr]
            q, k, v, positions, cache, key_cache, value_cache, slot_mapping)
    q, k = rotary_ref(q, k, positions, cache)
    store_kv_ref(k, v, key_cache, value_cache, slot_mapping)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
    if use_triton(x):
        from tidegate.kernels.gpu.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    if silu_and_mul_applies(x):
        return native_kernels().silu_and_mul(x)  # type: ignore[union-attr]
    return silu_and_mul_ref(x)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> gelu_tanh(gate) * up [T, I] (GeGLU)."""
    if use_triton(x):
        from tidegate.kernels.gpu.activation_triton import gelu_and_mul_triton

        return gelu_and_mul_triton(x)
    return gelu_and_mul_ref(x)


def lora_rows(index: torch.Tensor, num_adapters: int) -> LoraRows:
    """The step's ``LoraRows`` for index [T] (values in [NO_ADAPTER, num_adapters), unchecked:
    checking would read back to the host). Where Triton serves (``tidegate.kernels.dispatch``: CUDA,
    or ``TIDEGATE_KERNELS=triton``) the rows are also sorted by adapter on the device, once,
    with nothing read back, so a decode step with adapters can be captured in a CUDA graph."""
    if index.dim() != 1 or index.dtype.is_floating_point:
        raise ValueError(f"index {tuple(index.shape)} {index.dtype} must be [T] integers")
    if num_adapters < 1:
        raise ValueError(f"num_adapters {num_adapters} must be at least 1")
    if not use_triton(index):
        return LoraRows(index, num_adapters)
    from tidegate.kernels.gpu.lora_triton import lora_layout

    return LoraRows(index, num_adapters, lora_layout(index, num_adapters))


def add_lora(y: torch.Tensor, x: torch.Tensor, stack: LoraStack, rows: LoraRows,
             norm: Norm | None = None) -> None:
    """Batched LoRA (``tidegate.kernels.reference.lora``), in place: each row of y [T, N] gets its own adapter's
    ``scale * (u @ a.T) @ b.T``, segment by segment, u = x [T, K] or, with ``norm`` = (gain,
    eps), RMSNorm(x) computed on the way. ``rows``: the step's adapters, from ``lora_rows``
    (once per step, shared by every projection)."""
    if use_triton(x):
        from tidegate.kernels.gpu.lora_triton import add_lora_triton

        add_lora_triton(y, x, stack, rows, norm)
        return
    add_lora_ref(y, x, stack, rows, norm)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Grammar masks (``tidegate.kernels.reference.token_bitmask``): -inf, in place, over the logits of tokens
    each constrained row's packed mask disallows. logits [N, V] float32, bitmask [C, W] int32,
    rows [C] int64."""
    if use_triton(logits):
        from tidegate.kernels.gpu.token_bitmask_triton import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, bitmask, rows)
        return
    apply_token_bitmask_ref(logits, bitmask, rows)


def moe(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        top_k: int, *, renormalize: bool = True, activation: str = "silu") -> torch.Tensor:
    """Routed experts: x [T, H] -> the weighted sum of each token's top-k experts' gated MLPs
    (``tidegate.kernels.reference.moe``); one fused grouped-GEMM kernel on Triton."""
    if use_triton(x):
        from tidegate.kernels.gpu.moe_triton import moe_triton

        return moe_triton(x, router, w13, w2, top_k, renormalize=renormalize,
                          activation=activation)
    return moe_ref(x, router, w13, w2, top_k, renormalize=renormalize, activation=activation)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's key and value into its cache slot; slots < 0 are skipped."""
    if use_triton(key):
        from tidegate.kernels.gpu.kv_store_triton import store_kv_triton

        return store_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    return store_kv_ref(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float, *, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """The step's attention over the paged cache: decodes and prefill chunks -> [T, Hq, D];
    ``window`` (sliding-window layers) and ``softcap`` (soft-capped scores) where the model's
    layer has them."""
    if use_triton(q):
        from tidegate.kernels.gpu.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(q, key_cache, value_cache, meta, scale, window=window,
                                      softcap=softcap)
    return paged_attention_cpu(q, key_cache, value_cache, meta, scale, window, softcap)


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 num_splits: int, *, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """Decode attention only (one query per sequence) with no host data at all, so it can be
    captured in a CUDA graph; ``num_splits`` splits each context for the Triton kernel."""
    if use_triton(q):
        from tidegate.kernels.gpu.paged_attention_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(q, key_cache, value_cache, block_tables, seq_lens,
                                             scale, num_splits, window=window, softcap=softcap)
    return paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                  window, softcap)
