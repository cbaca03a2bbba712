"""The decoder every family runs: GQA attention with RoPE, RMSNorm, a gated MLP or routed experts.

The model works on a flat batch of tokens from many sequences ([T] ids and positions) and hands
attention to a backend that owns the KV cache layout, so the same model serves the contiguous
cache, the paged cache and a plain causal pass for tests. What a family changes is a field of
``ModelConfig`` (biases, q/k norms, sliding windows, soft-capping, GeGLU, sandwich norms,
experts); its file in ``families/`` reads its config and names its tensors (``TensorSource``).

A layer with none of those features (Llama's, Mistral's without a window) keeps the fused fast
paths: few rows on a GPU fold each norm into the projection after it and each residual add
into the one before; the CPU's 8-bit path runs the whole layer in one native call.

A rank of a parallel worker (``tidegate.worker.parallel``) builds the model of its share (``Partition``):
a config with its heads, MLP columns and layers, the embedding and LM head rows of its
vocabulary slice. Row-parallel projections (o, down, the experts' down) then give partial
sums that ``TensorComm.all_reduce`` adds up (the residual added by rank 0 alone), the
embedding is summed over the slices and the logits gathered; a pipeline stage takes the
residual stream from the stage before instead of token ids, and only the last one has the
final norm and the LM head.

A step with LoRA adapters (``LoraBatch``) adds each row's adapter to every projection's output
(``tidegate.kernels.ops.add_lora``): the normed inputs of q/k/v and gate/up, which the fused paths never
write out, are normed inside the adapter's shrink, and SiLU runs after gate/up's adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tidegate.kernels import ops
from tidegate.kernels.cpu.decoder_layer import DecoderWeights
from tidegate.kernels.cpu.paged_attention import PagedLayer, PagedStack
from tidegate.kernels.reference.lora import LoraRows
from tidegate.kernels.reference.rotary import cos_sin_cache
from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.kernels.weights.packed_weight import PackedWeight
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.lora_weights import LayerLora, LoraBatch
from tidegate.worker.models.packed_modules import PackedEmbedding, PackedLinear, PackedMatrix


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What a layer's attention computes besides q, k and v: the score scale, the window
    (None: the whole context) and the tanh soft-cap of the scores (None: none)."""

    scale: float
    window: int | None = None
    softcap: float | None = None


class AttentionBackend(Protocol):
    """Rotates q and k, stores this step's k/v and attends; owns the cache layout and the batch
    structure (so it can fuse the rotary with its KV store)."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        positions: torch.Tensor, rope_cache: torch.Tensor, spec: LayerAttention,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] (not rotated yet; q and k may be rotated in place),
        positions [T] -> attention output [T, Hq, D]."""
        ...

    def paged_layer(self, layer: int) -> PagedLayer | None:
        """Layer ``layer``'s paged cache and the step's metadata, so a whole-layer kernel may
        run the layer; None where there is no paged cache to hand over."""
        ...

    def paged_stack(self) -> PagedStack | None:
        """Every layer's paged cache and the step's metadata, so one kernel may run the layer
        stack; None where there is no paged cache to hand over."""
        ...


class TensorComm(Protocol):
    """The collectives of a tensor-parallel group (``tidegate.worker.parallel.model_group``)."""

    tp_rank: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns it."""
        ...

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, tp * C], rank order."""
        ...


@dataclass(slots=True)
class Partition:
    """The share of the model one rank of a parallel worker holds; ``comm`` is set once the
    process group is up (the model is built on the meta device first)."""

    vocab_rows: range  # the embedding's and LM head's rows (padded past the vocabulary)
    first: bool  # the first pipeline stage: takes token ids, holds the embedding
    last: bool  # the last stage: holds the final norm and the LM head
    comm: TensorComm | None = None  # None: a single shard (no tensor parallelism)


class CausalAttention:
    """One sequence, no cache: plain causal attention over the whole input (tests, scoring)."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        positions: torch.Tensor, rope_cache: torch.Tensor, spec: LayerAttention,
    ) -> torch.Tensor:
        q, k = ops.rotary(q, k, positions, rope_cache)
        if spec.window is None and spec.softcap is None:
            # 4-D inputs: with 3-D ones the CPU dispatcher takes the math path.
            out = F.scaled_dot_product_attention(
                q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
                is_causal=True, enable_gqa=True, scale=spec.scale,
            )
            return out[0].transpose(0, 1)
        group = q.shape[1] // k.shape[1]
        scores = torch.einsum("qhd,khd->hqk", q.float(),
                              k.float().repeat_interleave(group, dim=1)) * spec.scale
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        pos = positions
        hidden = pos[None, :] > pos[:, None]
        if spec.window is not None:
            hidden |= pos[None, :] <= pos[:, None] - spec.window
        scores = scores.masked_fill(hidden, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1),
                           v.float().repeat_interleave(group, dim=1))
        return out.to(q.dtype)

    def paged_layer(self, layer: int) -> PagedLayer | None:
        return None

    def paged_stack(self) -> PagedStack | None:
        return None


class Experts(nn.Module):
    """Routed experts (Mixtral, Qwen3-MoE): a router, then each token's top-k experts' gated
    MLPs weighed by the router's probabilities (``tidegate.kernels.ops.moe``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.router = nn.Parameter(torch.empty(e, h))
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        return ops.moe(x, self.router, self.w13, self.w2, cfg.experts_per_token,
                       renormalize=cfg.norm_topk_prob, activation=cfg.hidden_act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.spec = LayerAttention(cfg.scale, cfg.window(index), cfg.attn_softcap)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.o_bias)
        self.q_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.experts = Experts(cfg) if cfg.is_moe(index) else None
        if self.experts is None:
            self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_attn_norm = nn.Parameter(torch.ones(h))  # the norm before the MLP
        # Gemma's sandwich: the attention's and the MLP's outputs normed before their adds.
        self.attn_out_norm = nn.Parameter(torch.ones(h)) if cfg.sandwich_norms else None
        self.mlp_out_norm = nn.Parameter(torch.ones(h)) if cfg.sandwich_norms else None
        # Llama's layer exactly: the fused paths (few-row GPU streams, the CPU's whole-layer
        # call) compute only that.
        self.comm: TensorComm | None = None  # set by DecoderModel.connect
        self.plain = (not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm or cfg.sandwich_norms)
                      and self.experts is None and cfg.hidden_act == "silu"
                      and self.spec == LayerAttention(cfg.head_dim ** -0.5))

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,
        positions: torch.Tensor,  # [T]
        rope_cache: torch.Tensor,
        attn: AttentionBackend,
        layer: int,
        lora: tuple[LayerLora, LoraRows] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) -> (hidden, residual); the residual stream is their sum.

        Few rows on a GPU (``ops.fuses_projections``): every projection is a weight stream, so
        each norm goes into the projection after it and each residual add into the one before
        it; ``hidden`` then is the whole stream and ``residual`` stays None. On the CPU with
        8-bit activations a plain layer is one native call (``ops.decoder_layer``).
        Otherwise the residual add goes into the RMSNorm kernel and the projections are plain
        GEMMs (e4m3 weights: the norm and SiLU kernels hand them rows already rounded to
        e4m3)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        if self.plain and lora is None and self.comm is None:
            paged = attn.paged_layer(layer)
            if paged is not None and (done := ops.decoder_layer(
                    hidden, residual, self.weights(), positions, rope_cache, paged)) is not None:
                return done
        stacks, rows = lora if lora is not None else (None, None)
        if residual is None and not cfg.sandwich_norms and ops.fuses_projections(hidden):
            qkv = ops.norm_linear(hidden, self.input_norm, eps, self.qkv_proj.weight)
            if stacks is not None:
                ops.add_lora(qkv, hidden, stacks.qkv, rows, norm=(self.input_norm, eps))
            out = self._attention(self._bias(qkv, self.qkv_proj), positions, rope_cache, attn,
                                  layer)
            stream = ops.linear(out, self.o_proj.weight, add=self._once(hidden))
            stream = self._bias(self._reduce(stream), self.o_proj)
            if stacks is not None:
                ops.add_lora(stream, out, stacks.o, rows)
            if self.experts is not None:
                x = ops.rms_norm(stream, self.post_attn_norm, eps)[0]
                return stream + self._reduce(self.experts(x)), None
            silu = cfg.hidden_act == "silu"
            if stacks is None or stacks.gate_up is None:
                act = ops.norm_linear(stream, self.post_attn_norm, eps,
                                      self.gate_up_proj.weight, silu=silu)
                if not silu:
                    act = ops.gelu_and_mul(act)
            else:  # the adapter adds to gate and up before the activation
                gate_up = ops.norm_linear(stream, self.post_attn_norm, eps,
                                          self.gate_up_proj.weight)
                ops.add_lora(gate_up, stream, stacks.gate_up, rows,
                             norm=(self.post_attn_norm, eps))
                act = ops.silu_and_mul(gate_up) if silu else ops.gelu_and_mul(gate_up)
            hidden = self._reduce(ops.linear(act, self.down_proj.weight, add=self._once(stream)))
            if stacks is not None and stacks.down is not None:
                ops.add_lora(hidden, act, stacks.down, rows)
            return hidden, None
        qkv, residual = ops.norm_project(hidden, self.input_norm, eps, residual,
                                         self.qkv_proj.weight)
        if stacks is not None:
            ops.add_lora(qkv, residual, stacks.qkv, rows, norm=(self.input_norm, eps))
        out = self._attention(self._bias(qkv, self.qkv_proj), positions, rope_cache, attn,
                              layer)
        hidden = self._bias(self._reduce(ops.linear(out, self.o_proj.weight)), self.o_proj)
        if stacks is not None:
            ops.add_lora(hidden, out, stacks.o, rows)
        if self.attn_out_norm is not None:
            hidden = ops.rms_norm(hidden, self.attn_out_norm, eps)[0]
        if self.experts is not None:
            x, residual = ops.rms_norm(hidden, self.post_attn_norm, eps, residual)
            out = self._reduce(self.experts(x))
        else:
            gate_up, residual = ops.norm_project(hidden, self.post_attn_norm, eps, residual,
                                                 self.gate_up_proj.weight)
            if stacks is not None and stacks.gate_up is not None and stacks.down is not None:
                ops.add_lora(gate_up, residual, stacks.gate_up, rows,
                             norm=(self.post_attn_norm, eps))
                act = (ops.silu_and_mul(gate_up) if cfg.hidden_act == "silu"
                       else ops.gelu_and_mul(gate_up))
                out = ops.linear(act, self.down_proj.weight)
                ops.add_lora(out, act, stacks.down, rows)
            else:
                out = (ops.silu_project(gate_up, self.down_proj.weight)
                       if cfg.hidden_act == "silu"
                       else ops.linear(ops.gelu_and_mul(gate_up), self.down_proj.weight))
            out = self._reduce(out)
        if self.mlp_out_norm is not None:
            out = ops.rms_norm(out, self.mlp_out_norm, eps)[0]
        return out, residual

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial output summed over the shards."""
        return x if self.comm is None else self.comm.all_reduce(x)

    def _once(self, residual: torch.Tensor) -> torch.Tensor | None:
        """The residual a row-parallel projection adds: on one shard only, so the sum over
        the shards holds it once."""
        return residual if self.comm is None or self.comm.tp_rank == 0 else None

    @staticmethod
    def _bias(x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        return x if proj.bias is None else x + proj.bias

    def weights(self) -> DecoderWeights:
        """The layer's parameters, as a whole-layer kernel reads them (plain layers only)."""
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
        if self.q_norm is not None and self.k_norm is not None:
            # Each head normed on its own: rows of D.
            eps = cfg.rms_norm_eps
            q = ops.rms_norm(q.reshape(-1, cfg.head_dim), self.q_norm, eps)[0].view_as(q)
            k = ops.rms_norm(k.reshape(-1, cfg.head_dim), self.k_norm, eps)[0].view_as(k)
        return attn.attend(layer, q, k, v, positions, rope_cache, self.spec).reshape(
            t, self.q_size)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, partition: Partition | None = None) -> None:
        """``partition``: the share a rank of a parallel worker holds (``cfg`` is then that
        rank's config, ``tidegate.worker.parallel.layout.RankPlace.local_config``)."""
        super().__init__()
        self.cfg = cfg
        self.partition = partition
        rows = cfg.vocab_size if partition is None else len(partition.vocab_rows)
        first = partition is None or partition.first
        last = partition is None or partition.last
        # A stage holds the embedding if it takes token ids, or its LM head is the embedding.
        # Built on its own weight, so no random init runs: on the meta device (the loaders'
        # empty_model) nn.Embedding's normal_ imports torch._dynamo, 1.7 s of every start.
        self.embed_tokens = (nn.Embedding(rows, cfg.hidden_size,
                                          _weight=torch.empty(rows, cfg.hidden_size))
                             if first or (last and cfg.tie_word_embeddings) else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = (
            None if cfg.tie_word_embeddings or not last
            else nn.Linear(cfg.hidden_size, rows, bias=False)
        )
        # Computed on the CPU even under the meta device (the loaders' empty_model, which
        # moves them to the model's device): meta's arange imports torch._dynamo (seconds).
        with torch.device("cpu"):
            self.register_buffer("rope_cache", global_rope(cfg), persistent=False)
            self.register_buffer("rope_cache_local", local_rope(cfg), persistent=False)

    def rope_for(self, layer: int) -> torch.Tensor:
        """The rotary table layer ``layer`` rotates with."""
        local = self.rope_cache_local
        return local if local is not None and self.cfg.local_rope(layer) else self.rope_cache

    def connect(self, comm: TensorComm | None) -> None:
        """Hand the model its tensor-parallel group's collectives (parallel workers)."""
        assert self.partition is not None
        self.partition.comm = comm
        for layer in self.layers:
            layer.comm = comm  # type: ignore[assignment]

    @property
    def is_last_stage(self) -> bool:
        return self.partition is None or self.partition.last

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
        lora: LoraBatch | None = None, stream: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H]; ``lora``: each row's
        adapter, where the step has any. A later pipeline stage takes the residual stream
        [T, H] the stage before returned (``stream``) instead of ids, and a stage before the
        last returns its residual stream."""
        if stream is None:
            hidden = self.embed(input_ids)
            if self.cfg.embed_scale is not None:
                # In the hidden dtype, as the reference rounds it (sqrt(2304) is not exact
                # in bf16).
                hidden = hidden * torch.tensor(self.cfg.embed_scale, dtype=hidden.dtype)
        else:
            hidden = stream
        residual: torch.Tensor | None = None
        if (stack := self._one_call(hidden, positions, attn, lora)) is not None:
            hidden, residual = stack
        else:
            for i, layer in enumerate(self.layers):
                hidden, residual = layer(hidden, residual, positions, self.rope_for(i), attn, i,
                                         None if lora is None else lora.layer(i))
        if not self.is_last_stage:
            # The one tensor the next stage needs; its first layer adds the two itself
            # otherwise, the same float sum.
            return hidden if residual is None else hidden + residual
        return ops.rms_norm(hidden, self.norm, self.cfg.rms_norm_eps, residual)[0]

    def _one_call(self, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                  lora: LoraBatch | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer in one native call (``ops.decoder_layers``), where each would run as
        one call anyway (plain layers, no adapters, no tensor parallelism, one rotary table):
        (hidden, residual) after the last layer; None otherwise."""
        if lora is not None or hidden.device.type != "cpu" or self.rope_cache_local is not None:
            return None
        if not all(layer.plain and layer.comm is None for layer in self.layers):
            return None
        paged = attn.paged_stack()
        if paged is None:
            return None
        return ops.decoder_layers(hidden, [layer.weights() for layer in self.layers],
                                  positions, self.rope_cache, paged)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> embeddings [T, H]; a vocabulary shard looks up the ids in its
        rows, zeros elsewhere, and the shards' sum is every row."""
        assert self.embed_tokens is not None
        part = self.partition
        if part is None or part.comm is None:
            return self.embed_tokens(input_ids)
        rows = part.vocab_rows
        inside = (input_ids >= rows.start) & (input_ids < rows.stop)
        hidden = self.embed_tokens(torch.where(inside, input_ids - rows.start, 0))
        hidden.masked_fill_(~inside[:, None], 0)
        return part.comm.all_reduce(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V] (the last stage's; vocabulary shards
        gathered)."""
        if self.lm_head is not None:
            weight = self.lm_head.weight
        else:
            assert self.embed_tokens is not None
            weight = self.embed_tokens.weight
        logits = ops.linear(hidden, weight)
        part = self.partition
        if part is not None and part.comm is not None:
            logits = part.comm.all_gather_columns(logits)[:, : self.cfg.vocab_size]
        logits = logits.float()
        if (cap := self.cfg.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def adopt_packed(self, packed: Callable[[str], PackedMatrix | None],
                     sources: Sequence[TensorSource] | None = None) -> None:
        """Swap in packed projections and embeddings wherever ``packed(hf_name)`` gives the
        weights packed (every part of a fused matrix must; else it stays float). Called on a
        model still on the meta device, so the float matrices it replaces are never
        allocated; ``load_hf_state_dict`` then loads only what stayed float."""
        sources = hf_tensor_sources(self.cfg) if sources is None else sources
        for src in sources:
            if src.param == "embed_tokens.weight":
                embed = packed(src.names[0])
                if isinstance(embed, PackedWeight):
                    self.embed_tokens = PackedEmbedding(embed)  # type: ignore[assignment]
                elif embed is not None:
                    raise ValueError(f"tensor {src.names[0]}: {'+'.join(embed.types)} "
                                     "embeddings are not implemented (GGUF blocks)")
                continue
            # Projections and the LM head only: experts (3-D) and norms stay float.
            if not src.param.endswith(("_proj.weight", "lm_head.weight")):
                continue
            parts = [packed(name) for name in src.names]
            if any(part is None for part in parts):
                continue
            path = src.param.removesuffix(".weight")
            module = self.get_submodule(path)
            weight = _stack(parts, src.label)  # type: ignore[arg-type]
            expected = tuple(module.weight.shape)
            if weight.shape != expected:
                raise ValueError(f"tensor {src.label}: shape {weight.shape}, expected {expected}")
            linear = PackedLinear(weight)
            if module.bias is not None:
                linear.bias = nn.Parameter(torch.empty_like(module.bias), requires_grad=False)
            parent, _, attr = path.rpartition(".")
            setattr(self.get_submodule(parent) if parent else self, attr, linear)

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor],
                           sources: Sequence[TensorSource] | None = None,
                           shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None
                           ) -> None:
        """Load weights named as ``sources`` say (default: ``hf_tensor_sources``, the names
        transformers' Llama-style models use); raises naming any missing tensor. Modules
        already packed (``adopt_packed``) are skipped. ``shard`` (a parallel worker's rank):
        (parameter, whole tensor) -> the rank's slice, applied as each tensor is read."""
        sources = hf_tensor_sources(self.cfg) if sources is None else sources
        missing: list[str] = []
        with torch.no_grad():
            for src in sources:
                owner, _, attr = src.param.rpartition(".")
                module = self.get_submodule(owner) if owner else self
                if isinstance(module, PackedLinear | PackedEmbedding) and attr == "weight":
                    continue
                param = getattr(module, attr)
                absent = [name for name in src.names if name not in tensors]
                if absent:
                    missing += absent
                    continue
                parts = [tensors[name] for name in src.names]
                value = parts[0] if len(parts) == 1 else torch.cat(parts)
                if shard is not None:
                    value = shard(src.param, value)
                if value.numel() != param.numel() or (
                        len(parts) == 1 and tuple(value.shape) != tuple(param.shape)):
                    raise ValueError(f"tensor {src.label}: shape {tuple(value.shape)}, "
                                     f"expected {tuple(param.shape)}")
                value = value.reshape(param.shape)
                if src.offset:
                    value = value.float() + src.offset
                param.data.copy_(value)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise KeyError(f"{len(missing)} weight tensors missing: {shown}")


def global_rope(cfg: ModelConfig) -> torch.Tensor:
    return cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                         cfg.rope_scaling)


def local_rope(cfg: ModelConfig) -> torch.Tensor | None:
    """The sliding layers' rotary table where it differs from the global one (Gemma 3)."""
    if cfg.local_rope_theta is None:
        return None
    return cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                         cfg.local_rope_scaling)


@dataclass(frozen=True, slots=True)
class TensorSource:
    """Where one parameter of ``DecoderModel`` comes from in a checkpoint: ``names``
    concatenated along their first dimension in this order (q, k, v into qkv; experts stacked),
    reshaped to the parameter, plus ``offset`` (Gemma stores its norm gains minus one)."""

    param: str  # the parameter's dotted path, e.g. "layers.3.qkv_proj.weight"
    names: tuple[str, ...]
    label: str  # how errors name it
    offset: float = 0.0


@dataclass(frozen=True, slots=True)
class TensorNames:
    """How a family spells its checkpoint's tensors, where it differs from Llama's."""

    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    # Gemma: post_attention_layernorm is the attention output's norm, pre_feedforward's the
    # MLP's input norm (Llama's post_attention_layernorm).
    pre_mlp_norm: str = "post_attention_layernorm"
    attn_out_norm: str = "post_attention_layernorm"
    mlp_out_norm: str = "post_feedforward_layernorm"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    router: str = "mlp.gate"
    # One expert's gate, up and down matrices, "{e}" its index.
    expert: tuple[str, str, str] = ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                                    "mlp.experts.{e}.down_proj")
    norm_offset: float = 0.0  # added to every RMSNorm gain (Gemma: 1)


def hf_tensor_sources(cfg: ModelConfig, names: TensorNames | None = None) -> list[TensorSource]:
    """Every parameter of ``DecoderModel(cfg)`` and the checkpoint tensors it is read from."""
    n = names or TensorNames()
    off = n.norm_offset
    out = [TensorSource("embed_tokens.weight", ("model.embed_tokens.weight",), "embed_tokens"),
           TensorSource("norm", ("model.norm.weight",), "model.norm.weight", off)]
    if not cfg.tie_word_embeddings:
        out.append(TensorSource("lm_head.weight", ("lm_head.weight",), "lm_head.weight"))
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."

        def src(param: str, parts: Sequence[str], label: str, offset: float = 0.0,
                p: str = p, q: str = q) -> TensorSource:
            return TensorSource(q + param, tuple(p + part for part in parts), p + label, offset)

        out.append(src("qkv_proj.weight", [f"{m}.weight" for m in n.qkv], "qkv"))
        if cfg.qkv_bias:
            out.append(src("qkv_proj.bias", [f"{m}.bias" for m in n.qkv], "qkv.bias"))
        out.append(src("o_proj.weight", [f"{n.o}.weight"], "o_proj"))
        if cfg.o_bias:
            out.append(src("o_proj.bias", [f"{n.o}.bias"], "o_proj.bias"))
        if cfg.qk_norm:
            out.append(src("q_norm", [f"{n.q_norm}.weight"], n.q_norm, off))
            out.append(src("k_norm", [f"{n.k_norm}.weight"], n.k_norm, off))
        if cfg.is_moe(i):
            experts = range(cfg.num_experts)
            gate, up, down = n.expert
            out.append(src("experts.router", [f"{n.router}.weight"], n.router))
            out.append(src("experts.w13", [f"{m.format(e=e)}.weight" for e in experts
                                           for m in (gate, up)], "experts.gate_up"))
            out.append(src("experts.w2", [f"{down.format(e=e)}.weight" for e in experts],
                           "experts.down"))
        else:
            out.append(src("gate_up_proj.weight", [f"{m}.weight" for m in n.gate_up],
                           "gate_up"))
            out.append(src("down_proj.weight", [f"{n.down}.weight"], "down_proj"))
        out.append(src("input_norm", ["input_layernorm.weight"], "input_layernorm", off))
        out.append(src("post_attn_norm", [f"{n.pre_mlp_norm}.weight"], n.pre_mlp_norm, off))
        if cfg.sandwich_norms:
            out.append(src("attn_out_norm", [f"{n.attn_out_norm}.weight"], n.attn_out_norm,
                           off))
            out.append(src("mlp_out_norm", [f"{n.mlp_out_norm}.weight"], n.mlp_out_norm, off))
    return out


def layer_matrices(layer: int) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """Layer ``layer``'s projections in Llama's naming: (attribute, name in errors, the HF
    tensors fused into it, stacked row-wise in this order). The quantization tools read and
    write these."""
    p = f"model.layers.{layer}."
    return (
        ("qkv_proj", p + "qkv", tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
        ("o_proj", p + "o_proj", (p + "self_attn.o_proj.weight",)),
        ("gate_up_proj", p + "gate_up", tuple(p + f"mlp.{n}_proj.weight" for n in ("gate", "up"))),
        ("down_proj", p + "down_proj", (p + "mlp.down_proj.weight",)),
    )


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
