"""Tiny random checkpoints of every family tidegate loads, written by transformers itself (its
config class, ``save_pretrained``), each with the features that set its family apart switched
on and sized so the tests see them (windows shorter than the prompts, caps the scores reach)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers as hf
from safetensors.torch import load_file
from transformers import PreTrainedModel

from tests.worker.tiny_checkpoints import (
    add_byte_vocabulary,
    add_shape,
    llama_cpp_permute,
    write_hf_dir,
)

COMMON: dict[str, Any] = dict(
    vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    bos_token_id=256, eos_token_id=257, pad_token_id=None, tie_word_embeddings=False,
)
MOE: dict[str, Any] = dict(num_experts_per_tok=2)

# family -> (config class, model class, config fields beyond COMMON)
FAMILIES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, {}),
    "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM, {}),
    "mistral": (hf.MistralConfig, hf.MistralForCausalLM, dict(sliding_window=8)),
    "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM, dict(pad_token_id=0, sliding_window=12)),
    "gemma2": (hf.Gemma2Config, hf.Gemma2ForCausalLM, dict(
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        query_pre_attn_scalar=32, tie_word_embeddings=True)),
    "gemma3": (hf.Gemma3TextConfig, hf.Gemma3ForCausalLM, dict(
        num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1_000_000.0}},
        tie_word_embeddings=True)),
    "mixtral": (hf.MixtralConfig, hf.MixtralForCausalLM, dict(
        **MOE, num_local_experts=4, intermediate_size=48)),
    "qwen3_moe": (hf.Qwen3MoeConfig, hf.Qwen3MoeForCausalLM, dict(
        **MOE, num_experts=6, moe_intermediate_size=32, norm_topk_prob=False,
        num_hidden_layers=3, mlp_only_layers=[1])),
}

# Rotary scalings a config may name, on a Llama-shaped Qwen2 checkpoint.
ROPES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    # Inside the original context (the prompts are shorter): the short factors, and the
    # attention factor of 256 / 64 = 4x extension.
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0],
                 "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0]},
}


def family_model(name: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """The family's tiny model in float32 with weights far from init (norm gains too: Gemma's
    around zero, as it stores gain - 1)."""
    config_cls, model_cls, extra = FAMILIES[name]
    fields = {**COMMON, **extra, **overrides}
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.dim() == 1 and "norm" in pname:
                param.uniform_(-0.5, 0.5) if gemma else param.uniform_(0.5, 1.5)
            elif param.dim() == 1:  # biases
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.1)
    return model


def write_family(name: str, path: Path, **overrides: Any) -> tuple[PreTrainedModel, Path]:
    model = family_model(name, **overrides)
    return model, write_hf_dir(model, path)


# llama.cpp's architecture name for each family, and how its converter spells each part.
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "phi3": "phi3",
             "gemma2": "gemma2", "gemma3": "gemma3", "mixtral": "llama",
             "qwen3_moe": "qwen3moe"}
_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
_GEMMA_PARTS = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
# Experts: (HF spelling of one expert's matrix -> the 3-D tensor it is a slice of).
_EXPERT_PARTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
                 "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "down_proj": "ffn_down_exps"}


def write_family_gguf(name: str, model: PreTrainedModel, hf_dir: Path, path: Path,
                      qtype: gguf.GGMLQuantizationType | None = None) -> Path:
    """The checkpoint in ``hf_dir`` as llama.cpp's converter writes it: its architecture's
    metadata and names, q/k rows permuted for "llama", Gemma's gains plus one, experts stacked
    into 3-D tensors; matrices F32 or ``qtype``; a byte-level gpt2 vocabulary."""
    cfg = model.config
    arch = GGUF_ARCH[name]
    tensors = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters
    theta = (rope.get("full_attention", rope)).get("rope_theta")
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "sliding_window", None) and arch != "llama":
        w.add_sliding_window(cfg.sliding_window)
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    add_byte_vocabulary(w)
    stacked: dict[str, list[tuple[int, np.ndarray]]] = {}
    for hf_name, tensor in tensors.items():
        array = tensor.float().numpy()
        parts = hf_name.split(".")
        if hf_name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            gguf_name = "output.weight"
        elif ".experts." in hf_name:
            layer, expert, kind = parts[2], int(parts[-3]), parts[-2]
            stacked.setdefault(f"blk.{layer}.{_EXPERT_PARTS[kind]}.weight", []).append(
                (expert, array))
            continue
        else:
            module = ".".join(parts[3:-1])
            part = (_GEMMA_PARTS.get(module) if arch.startswith("gemma") else None) \
                or _PARTS[module]
            gguf_name = f"blk.{parts[2]}.{part}.{parts[-1]}"
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            array = array + 1.0
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, kv_heads)
        _add(w, gguf_name, array, qtype)
    for gguf_name, by_expert in stacked.items():
        _add(w, gguf_name, np.stack([a for _, a in sorted(by_expert, key=lambda t: t[0])]),
             None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w: gguf.GGUFWriter, name: str, array: np.ndarray,
         qtype: gguf.GGMLQuantizationType | None) -> None:
    if qtype is None or array.ndim != 2 or name == "token_embd.weight" \
            or "ffn_gate_inp" in name:
        w.add_tensor(name, np.ascontiguousarray(array))
        return
    packed = np.ascontiguousarray(gguf.quants.quantize(array, qtype)).view(np.uint8)
    w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
