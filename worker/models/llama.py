"""A Llama-family decoder in plain torch: GQA, RoPE (Llama-3 scaling), RMSNorm, SwiGLU.

The model works on a flat batch of tokens from many sequences ([T] ids and positions) and hands
attention to a backend that owns the KV cache layout, so the same model serves the contiguous
cache, the paged cache and a plain causal pass for tests. Weights arrive in Hugging Face's
naming (``load_hf_state_dict``); q/k/v and gate/up are fused at load for fewer, larger matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops
from kernels.decoder_layer import DecoderWeights
from kernels.fp8_weight import Fp8Weight
from kernels.int_weight import IntWeight
from kernels.packed_weight import PackedWeight
from kernels.paged_attention import PagedLayer
from kernels.rotary import Llama3Scaling, cos_sin_cache
from worker.models.packed_modules import PackedEmbedding, PackedLinear, PackedMatrix


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: Llama3Scaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


class AttentionBackend(Protocol):
    """Rotates q and k, stores this step's k/v and attends; owns the cache layout and the batch
    structure (so it can fuse the rotary with its KV store)."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        positions: torch.Tensor, rope_cache: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] (not rotated yet; q and k may be rotated in place),
        positions [T] -> attention output [T, Hq, D]."""
        ...

    def paged_layer(self, layer: int) -> PagedLayer | None:
        """Layer ``layer``'s paged cache and the step's metadata, so a whole-layer kernel may
        run the layer; None where there is no paged cache to hand over."""
        ...


class CausalAttention:
    """One sequence, no cache: plain causal attention over the whole input (tests, scoring)."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        positions: torch.Tensor, rope_cache: torch.Tensor,
    ) -> torch.Tensor:
        q, k = ops.rotary(q, k, positions, rope_cache)
        # 4-D inputs: with 3-D ones the CPU dispatcher takes the math path.
        out = F.scaled_dot_product_attention(
            q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
            is_causal=True, enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def paged_layer(self, layer: int) -> PagedLayer | None:
        return None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_attn_norm = nn.Parameter(torch.ones(h))

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,
        positions: torch.Tensor,  # [T]
        rope_cache: torch.Tensor,
        attn: AttentionBackend,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) -> (hidden, residual); the residual stream is their sum.

        Few rows on a GPU (``ops.fuses_projections``): every projection is a weight stream, so
        each norm goes into the projection after it and each residual add into the one before
        it; ``hidden`` then is the whole stream and ``residual`` stays None. On the CPU with
        8-bit activations the whole layer is one native call (``ops.decoder_layer``).
        Otherwise the residual add goes into the RMSNorm kernel and the projections are plain
        GEMMs (e4m3 weights: the norm and SiLU kernels hand them rows already rounded to
        e4m3)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        paged = attn.paged_layer(layer)
        if paged is not None and (done := ops.decoder_layer(
                hidden, residual, self.weights(), positions, rope_cache, paged)) is not None:
            return done
        if residual is None and ops.fuses_projections(hidden):
            qkv = ops.norm_linear(hidden, self.input_norm, eps, self.qkv_proj.weight)
            out = self._attention(qkv, positions, rope_cache, attn, layer)
            hidden = ops.linear(out, self.o_proj.weight, add=hidden)
            act = ops.norm_linear(hidden, self.post_attn_norm, eps, self.gate_up_proj.weight,
                                  silu=True)
            return ops.linear(act, self.down_proj.weight, add=hidden), None
        qkv, residual = ops.norm_project(hidden, self.input_norm, eps, residual,
                                         self.qkv_proj.weight)
        out = self._attention(qkv, positions, rope_cache, attn, layer)
        hidden = ops.linear(out, self.o_proj.weight)
        gate_up, residual = ops.norm_project(hidden, self.post_attn_norm, eps, residual,
                                             self.gate_up_proj.weight)
        return ops.silu_project(gate_up, self.down_proj.weight), residual

    def weights(self) -> DecoderWeights:
        """The layer's parameters, as a whole-layer kernel reads them."""
        cfg = self.cfg
        return DecoderWeights(self.input_norm, self.post_attn_norm, self.qkv_proj.weight,
                              self.o_proj.weight, self.gate_up_proj.weight,
                              self.down_proj.weight, cfg.num_heads, cfg.num_kv_heads,
                              cfg.head_dim, cfg.rms_norm_eps)

    def _attention(self, qkv: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor,
                   attn: AttentionBackend, layer: int) -> torch.Tensor:
        """Fused q/k/v [T, (Hq + 2 Hk) D] -> attention output [T, Hq D]."""
        cfg = self.cfg
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        return attn.attend(layer, q, k, v, positions, rope_cache).reshape(t, self.q_size)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = (
            None if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.register_buffer(
            "rope_cache",
            cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                          cfg.rope_scaling),
            persistent=False,
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H]."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, positions, self.rope_cache, attn, i)
        return ops.rms_norm(hidden, self.norm, self.cfg.rms_norm_eps, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V]."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return ops.linear(hidden, weight).float()

    def adopt_packed(self, packed: Callable[[str], PackedMatrix | None]) -> None:
        """Swap in packed projections and embeddings wherever ``packed(hf_name)`` gives the
        weights packed (every part of a fused matrix must; else it stays float). Called on a
        model still on the meta device, so the float matrices it replaces are never
        allocated; ``load_hf_state_dict`` then loads only what stayed float."""
        embed = packed("model.embed_tokens.weight")
        if isinstance(embed, PackedWeight):
            self.embed_tokens = PackedEmbedding(embed)  # type: ignore[assignment]
        elif embed is not None:
            raise ValueError(f"tensor model.embed_tokens.weight: {'+'.join(embed.types)} "
                             "embeddings are not implemented (GGUF blocks)")
        if self.lm_head is not None and (head := packed("lm_head.weight")) is not None:
            self.lm_head = PackedLinear(head)  # type: ignore[assignment]
        for i, layer in enumerate(self.layers):
            for attr, label, names in layer_matrices(i):
                parts = [packed(name) for name in names]
                if any(part is None for part in parts):
                    continue
                weight = _stack(parts, label)  # type: ignore[arg-type]
                expected = tuple(getattr(layer, attr).weight.shape)
                if weight.shape != expected:
                    raise ValueError(f"tensor {label}: shape {weight.shape}, "
                                     f"expected {expected}")
                setattr(layer, attr, PackedLinear(weight))

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load weights named as in HF ``LlamaForCausalLM``; raises naming any missing tensor.
        Modules already packed (``adopt_packed``) are skipped."""
        missing: list[str] = []

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                missing.append(name)
                return torch.empty(0)
            return tensors[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if value.numel() == 0:
                return
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"tensor {name}: shape {tuple(value.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(value)

        def packed(module: nn.Module) -> bool:
            return isinstance(module, PackedLinear | PackedEmbedding)

        with torch.no_grad():
            if not packed(self.embed_tokens):
                put(self.embed_tokens.weight, take("model.embed_tokens.weight"), "embed_tokens")
            put(self.norm, take("model.norm.weight"), "model.norm.weight")
            if self.lm_head is not None and not packed(self.lm_head):
                put(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                for attr, label, names in layer_matrices(i):
                    if packed(getattr(layer, attr)):
                        continue
                    parts = [take(name) for name in names]
                    if all(x.numel() for x in parts):
                        put(getattr(layer, attr).weight,
                            parts[0] if len(parts) == 1 else torch.cat(parts), label)
                put(layer.input_norm, take(p + "input_layernorm.weight"), p + "input_layernorm")
                put(layer.post_attn_norm, take(p + "post_attention_layernorm.weight"),
                    p + "post_attention_layernorm")
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise KeyError(f"{len(missing)} weight tensors missing: {shown}")


def _stack(parts: list[PackedMatrix], label: str) -> PackedMatrix:
    """The fused matrix of a layer's parts, all of one kind."""
    try:
        if all(isinstance(p, IntWeight) for p in parts):
            return IntWeight.cat(parts)  # type: ignore[arg-type]
        if all(isinstance(p, Fp8Weight) for p in parts):
            return Fp8Weight.cat(parts)  # type: ignore[arg-type]
        if all(isinstance(p, PackedWeight) for p in parts):
            return PackedWeight.cat(parts)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"tensor {label}: {exc}") from exc
    raise ValueError(f"tensor {label}: its parts mix quantized formats")


def layer_matrices(layer: int) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """Layer ``layer``'s projections: (attribute, name in errors, the HF tensors fused into it,
    stacked row-wise in this order)."""
    p = f"model.layers.{layer}."
    return (
        ("qkv_proj", p + "qkv", tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
        ("o_proj", p + "o_proj", (p + "self_attn.o_proj.weight",)),
        ("gate_up_proj", p + "gate_up", tuple(p + f"mlp.{n}_proj.weight" for n in ("gate", "up"))),
        ("down_proj", p + "down_proj", (p + "mlp.down_proj.weight",)),
    )
