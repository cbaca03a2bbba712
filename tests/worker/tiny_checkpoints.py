"""Tiny Llama checkpoints written to disk by transformers (HF directories) and by a llama.cpp-style
writer (GGUF), so loaders are tested against transformers' own model on the same weights.

``write_gguf`` converts the way llama.cpp's ``convert_hf_to_gguf.py`` does: it permutes q/k rows
for interleaved rotary and stores Llama-3 rope scaling as a ``rope_freqs`` tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from tidegate.model_files.byte_level_bpe import bytes_to_unicode
from tidegate.model_files.tokenizer import byte_level_tokenizer

VOCAB = 260  # the byte-level tokenizer's 256 bytes + 4 specials
SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
LLAMA3_ROPE: dict[str, Any] = {
    # A short original context so that all three frequency bands of the scaling are used.
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny_hf_model(*, tied: bool, llama3_rope: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer GQA Llama in float32 with weights far from init (random norm gains too)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000.0}
    if llama3_rope:
        rope = {**LLAMA3_ROPE, "rope_theta": 10_000.0}
    config = HFLlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=256, tie_word_embeddings=tied, rope_parameters=rope,
        bos_token_id=256, eos_token_id=257,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
            elif "lm_head" not in name or not tied:
                param.normal_(0.0, 0.1)
    return model


def write_hf_dir(model: LlamaForCausalLM, path: Path) -> Path:
    """save_pretrained (safetensors) plus a byte-level tokenizer.json and tokenizer_config.json."""
    model.save_pretrained(path)
    byte_level_tokenizer(256).backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    ))
    return path


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: rows of each head from [2, D/2] (rotate-half) to [D/2, 2] pairs."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_freqs(head_dim: int, theta: float, rope: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp writes as rope_freqs for Llama-3 scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def add_shape(w: gguf.GGUFWriter, cfg: Any) -> None:
    """The model's shape in ``w``'s architecture keys, from a transformers config."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)


def add_byte_vocabulary(w: gguf.GGUFWriter) -> None:
    """The byte-level gpt2 vocabulary of ``VOCAB`` ids (bytes, then ``SPECIALS``), <s> as bos
    and </s> as eos, as the tiny HF directories' tokenizer.json has it."""
    spell = bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([spell[b] for b in range(256)] + list(SPECIALS))
    w.add_token_types([1] * 256 + [3] * len(SPECIALS))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(True)


def write_gguf(model: LlamaForCausalLM, path: Path, *, arch: str = "llama",
               qtype: gguf.GGMLQuantizationType | None = None,
               qtypes: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """Write ``model`` as a llama.cpp GGUF with a byte-level gpt2 tokenizer: F32, or its
    matrices quantized by gguf-py to ``qtype`` (``qtypes``: per GGUF tensor-name part, e.g.
    ``{"attn_v": Q8_0}``, as llama.cpp's mixed files do); norms stay F32."""
    cfg = model.config
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, cfg)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    add_byte_vocabulary(w)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(head_dim, theta, cfg.rope_parameters))
    for name, tensor in model.state_dict().items():
        gguf_name = _gguf_name(name)
        if gguf_name is None or (gguf_name == "output.weight" and cfg.tie_word_embeddings):
            continue
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, kv_heads)
        kind = next((t for part, t in (qtypes or {}).items() if f".{part}." in gguf_name
                     or gguf_name.startswith(f"{part}.")), qtype)
        if kind is None or array.ndim != 2:
            w.add_tensor(gguf_name, np.ascontiguousarray(array))
        else:
            packed = np.ascontiguousarray(gguf.quants.quantize(array, kind)).view(np.uint8)
            w.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_GGUF_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str | None:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")  # model.layers.N.<module...>.weight
    if parts[:2] != ["model", "layers"]:
        return None
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_GGUF_PARTS[module]}.weight" if module in _GGUF_PARTS else None
