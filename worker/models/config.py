"""``ModelConfig``: one decoder's shape and the features its family switches on.

Every family (``tidegate.worker.models.families``) reads its own config.json (or GGUF metadata) into
this one dataclass; the decoder (``tidegate.worker.models.decoder``), the KV cache and the engine read
only the fields, never a family's name. Defaults are Llama's, so a Llama config sets only its
shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidegate.kernels.reference.rotary import Scaling

ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_KINDS = ("full", "sliding")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: Scaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    family: str = "llama"  # for logs and /v1/models only: nothing branches on it
    # Attention: q/k/v biases (Qwen2), the output projection's bias, RMSNorm over each q and
    # k head before the rotary (Qwen3, Gemma 3), the score scale (None: head_dim ** -0.5;
    # Gemma: query_pre_attn_scalar ** -0.5) and tanh soft-capping of the scores (Gemma 2).
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    # Sliding-window attention: a query at position p sees keys p - window < k <= p, on the
    # layers ``layer_kinds`` marks "sliding" (None: every layer, when a window is set).
    sliding_window: int | None = None
    layer_kinds: tuple[str, ...] | None = None
    # The rotary of sliding layers where it differs (Gemma 3: base 10k locally, 1M globally).
    local_rope_theta: float | None = None
    local_rope_scaling: Scaling | None = None
    # MLP: gate activation (silu: SwiGLU; gelu_tanh: GeGLU, Gemma).
    hidden_act: str = "silu"
    # Gemma: norms after attention and after the MLP too, before each residual add
    # ("sandwich"), the embedding multiplied by sqrt(hidden_size), final logits soft-capped.
    sandwich_norms: bool = False
    embed_scale: float | None = None
    final_softcap: float | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): ``num_experts`` > 0 replaces the MLP of the
    # layers ``moe_layers`` marks (None: all) by ``experts_per_token`` routed experts of
    # ``moe_intermediate_size``; the routing weights renormalized over the chosen experts
    # (``norm_topk_prob``) or kept as the softmax over all gave them.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r}: one of {', '.join(ACTIVATIONS)}")
        if self.layer_kinds is not None:
            if len(self.layer_kinds) != self.num_layers:
                raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries for "
                                 f"{self.num_layers} layers")
            if bad := set(self.layer_kinds) - set(LAYER_KINDS):
                raise ValueError(f"layer_kinds: {sorted(bad)} (known: {', '.join(LAYER_KINDS)})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("sliding_window must be positive")
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError("experts_per_token must be in 1..num_experts")
            if self.moe_intermediate_size < 1:
                raise ValueError("moe_intermediate_size must be positive")
            if self.moe_layers is not None and len(self.moe_layers) != self.num_layers:
                raise ValueError("moe_layers needs one entry per layer")

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window in tokens; None: it sees the whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_kinds is None or self.layer_kinds[layer] == "sliding":
            return self.sliding_window
        return None

    def local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with the local rotary (``local_rope_theta``)."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    @property
    def scale(self) -> float:
        """Attention's score scale."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 2 * h
        mlp = 3 * h * i
        moe = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        total = sum(per_layer + (moe if self.is_moe(n) else mlp) for n in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + embed + h

    def active_params(self) -> int:
        """Parameters one token reads (MoE: only its routed experts)."""
        if not self.num_experts:
            return self.num_params()
        unused = (self.num_experts - self.experts_per_token) * 3 * self.hidden_size \
            * self.moe_intermediate_size
        moe_layers = sum(self.is_moe(n) for n in range(self.num_layers))
        return self.num_params() - moe_layers * unused
