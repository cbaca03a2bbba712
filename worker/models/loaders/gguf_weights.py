"""Weights from a llama.cpp GGUF file: the family and its config from the metadata, tensors
renamed to Hugging Face's names, with llama.cpp's q/k row permutation undone. Each matrix comes
either packed, in its own block format (``packed``: what the CPU's packed kernels read), or
dequantized to float32 (``__getitem__``: accelerators, 3-D expert tensors, and anything the
packed kernels do not implement).

The metadata is read into the fields a config.json would hold and handed to the family's own
reader (``tidegate.worker.models.families``), so a GGUF and a Hugging Face directory of one model give
the same ``ModelConfig``. llama.cpp's converters differ per architecture in ways that matter
here: for "llama" (and Mixtral, which is "llama" with experts) they reorder the rows of q_proj
and k_proj within each head so that its interleaved rotary (pairs 0-1, 2-3, ...) equals HF's
rotate-half (pairs i, i + D/2), which is undone here as transformers' GGUF loader does; Gemma's
norm gains are stored with the 1 already added; Phi-3 keeps q/k/v and gate/up fused; experts
are one 3-D tensor per projection, read here one expert at a time.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tidegate.kernels.reference.rotary import Llama3Scaling, inv_frequencies
from tidegate.kernels.weights.packed_weight import PACKED_TYPES, PackedWeight
from tidegate.model_files.gguf_file import GGUFHeader, GGUFTensorInfo
from tidegate.model_files.model_source import ModelLoadError, gguf_header
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import TensorNames, TensorSource
from tidegate.worker.models.families import Family, family_of

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj",
}
# Where an architecture names a part otherwise (HF's names for Gemma's four norms, Phi-3's
# fused gate/up).
_ARCH_NAMES: dict[str, dict[str, str]] = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_ARCH_NAMES["gemma3"] = _ARCH_NAMES["gemma2"]
# The family (config.json model_type) of each architecture; "llama" with experts is Mixtral.
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # one 3-D tensor per projection
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str = "llama",
            names: TensorNames | None = None) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown
    (and for 3-D expert tensors, which ``expert_names`` spells). ``names``: the family's."""
    if m := _BLOCK.match(gguf_name):
        layer, part, kind = m.groups()
        if part == "ffn_gate_inp":  # the router
            return f"model.layers.{layer}.{(names or TensorNames()).router}.{kind}"
        hf_part = _ARCH_NAMES.get(arch, {}).get(part) or _LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{hf_part}.{kind}" if hf_part else None
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[stem]}.{kind}" if stem in _GLOBAL_NAMES else None


def expert_names(gguf_name: str, experts: int, names: TensorNames
                 ) -> list[tuple[str, int]] | None:
    """``blk.3.ffn_gate_exps.weight`` -> each expert's HF name and its index in the 3-D
    tensor; None for any other tensor."""
    m = _BLOCK.match(gguf_name)
    if not m or m.group(2) not in _EXPERTS or m.group(3) != "weight":
        return None
    spelled = names.expert[_EXPERTS.index(m.group(2))]
    return [(f"model.layers.{m.group(1)}.{spelled.format(e=e)}.weight", e)
            for e in range(experts)]


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave: rows [h, D/2, 2] -> [h, 2, D/2]."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def unpermute_order(rows: int, n_heads: int) -> torch.Tensor:
    """The row order ``unpermute_qk`` makes, as indices (for packed rows)."""
    return unpermute_qk(torch.arange(rows).view(rows, 1), n_heads).view(rows)


class GGUFWeights(Mapping[str, torch.Tensor]):
    """HF-named float32 tensors of a GGUF file, each dequantized when it is looked up."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header: GGUFHeader = gguf_header(path, arrays=False)
        self.arch = self.header.architecture
        self._raw = {info.name: info for info in self.header.tensors}
        self.family: Family = family_of({"model_type": self._model_type()}, path)
        names = self.family.names
        self._infos: dict[str, GGUFTensorInfo] = {}
        self._experts: dict[str, tuple[GGUFTensorInfo, int]] = {}
        self._expert_cache: dict[str, torch.Tensor] = {}
        count = int(self.header.metadata.get(f"{self.arch}.expert_count", 0) or 0)
        for info in self.header.tensors:
            if (split := expert_names(info.name, count, names)) is not None:
                self._experts.update({n: (info, e) for n, e in split})
            elif (name := hf_name(info.name, self.arch, names)) is not None:
                self._infos[name] = info
        # A plain read-only array over an mmap: np.memmap's per-slice bookkeeping costs ~0.4 s
        # over the thousands of row groups gguf's dequantizer slices.
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._map, dtype=np.uint8)
        self.config = self._config()
        # The gains are stored with Gemma's +1 already in: no offset on top.
        self.sources: list[TensorSource] = [
            dataclasses.replace(src, offset=0.0)
            for src in self.family.tensor_sources(self.config)]

    def _model_type(self) -> str:
        if self.arch == "llama" and self.header.metadata.get("llama.expert_count"):
            return "mixtral"
        return _MODEL_TYPES[self.arch]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._experts:
            info, expert = self._experts[name]
            if info.name not in self._expert_cache:
                # Each 3-D tensor is read once while its experts are copied, not once per
                # expert: the model loads a layer's experts one after another.
                if len(self._expert_cache) >= 3:
                    self._expert_cache.pop(next(iter(self._expert_cache)))
                self._expert_cache[info.name] = self._read(info)
            return self._expert_cache[info.name][expert]
        tensor = self._read(self._infos[name])
        heads = self._permuted_heads(name)
        return tensor if heads is None else unpermute_qk(tensor, heads)

    def packed(self, name: str) -> PackedWeight | None:
        """The matrix ``name`` in its file's block format, or None where it is not packed
        (float32 in the file, not a matrix, or a type the packed kernels do not compute)."""
        info = self._infos.get(name)
        if info is None or len(info.shape) != 2 or info.ggml_type == GGMLQuantizationType.F32:
            return None  # F32: float already, the float kernels serve it
        qtype, n_bytes = self._span(info)
        if qtype not in PACKED_TYPES:
            names = ", ".join(sorted(t.name for t in PACKED_TYPES))
            raise ModelLoadError(
                f"{self.path}: tensor {info.name} is {qtype.name}, which the packed kernels do "
                f"not compute ({names}); --weights dequantized loads it as float")
        rows, cols = info.shape
        raw = self._data[info.offset:info.offset + n_bytes]
        weight = PackedWeight.from_bytes(qtype, (rows, cols), np.array(raw))
        heads = self._permuted_heads(name)
        return weight if heads is None else weight.permute_rows(unpermute_order(rows, heads))

    def _permuted_heads(self, name: str) -> int | None:
        """The head count whose rows llama.cpp interleaved in ``name`` (q or k; only its
        "llama" converter does), else None."""
        if self.arch != "llama":
            return None
        if ".self_attn.q_proj." in name:
            return self.config.num_heads
        if ".self_attn.k_proj." in name:
            return self.config.num_kv_heads
        return None

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read (dequantize) the tensor just to answer.
        return name in self._infos or name in self._experts

    def __iter__(self) -> Iterator[str]:
        return iter([*self._infos, *self._experts])

    def __len__(self) -> int:
        return len(self._infos) + len(self._experts)

    def _span(self, info: GGUFTensorInfo) -> tuple[GGMLQuantizationType, int]:
        """The tensor's type and byte length, checked against the file."""
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{self.path}: tensor {info.name} has unknown type "
                                 f"{info.ggml_type}") from exc
        if info.shape[-1] % block_size:
            raise ModelLoadError(f"{self.path}: tensor {info.name}: rows of {info.shape[-1]} "
                                 f"are not whole {qtype.name} blocks of {block_size}")
        n_bytes = math.prod(info.shape) // block_size * type_size
        if info.offset + n_bytes > self._data.size:
            raise ModelLoadError(f"{self.path}: tensor {info.name} runs past the end of the file")
        return qtype, n_bytes

    def _read(self, info: GGUFTensorInfo) -> torch.Tensor:
        qtype, n_bytes = self._span(info)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        *outer, inner = info.shape
        raw = self._data[info.offset:info.offset + n_bytes]
        try:
            values = dequantize(raw.reshape(*outer, inner // block_size * type_size), qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{self.path}: tensor {info.name}: {exc}") from exc
        # F32 comes back as a view of the read-only map; torch wants memory it may write.
        values = values.astype(np.float32, copy=not values.flags.writeable)
        return torch.from_numpy(values)

    def _config(self) -> ModelConfig:
        meta, arch = self.header.metadata, self.header.architecture

        def get(key: str, default: float | int | None = None) -> float | int:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"{self.path}: GGUF metadata has no {arch}.{key}")
            return value

        if "model.embed_tokens.weight" not in self._infos:
            raise ModelLoadError(f"{self.path}: GGUF has no token_embd.weight tensor")
        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        head_dim = int(get("attention.key_length", hidden // heads))
        theta = float(get("rope.freq_base", 10_000.0))
        layers = int(get("block_count"))
        # What config.json would say; the family reads it as it reads config.json.
        hf: dict[str, object] = dict(
            model_type=self.family.model_types[0],
            vocab_size=self._infos["model.embed_tokens.weight"].shape[0],
            hidden_size=hidden, intermediate_size=int(get("feed_forward_length", 0)),
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta, max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="lm_head.weight" not in self._infos,
        )
        kind = meta.get(f"{arch}.rope.scaling.type", "none")
        if kind in ("linear", "yarn"):
            hf["rope_scaling"] = {
                "rope_type": kind, "factor": float(get("rope.scaling.factor")),
                "original_max_position_embeddings": int(
                    get("rope.scaling.original_context_length", hf["max_position_embeddings"]))}
        elif kind not in ("none", "llama3"):
            raise ModelLoadError(f"{self.path}: rope scaling {kind!r} is not supported")
        if (window := meta.get(f"{arch}.attention.sliding_window")) is not None:
            hf["sliding_window"] = int(window)
        if arch in ("gemma2", "gemma3"):
            # llama.cpp's rule for the score scale: hidden / heads for the 27B models (46 and
            # 62 layers), the head size otherwise (Gemma's query_pre_attn_scalar).
            hf["query_pre_attn_scalar"] = hidden // heads if layers in (46, 62) else head_dim
            hf["attn_logit_softcapping"] = meta.get(f"{arch}.attn_logit_softcapping")
            hf["final_logit_softcapping"] = meta.get(f"{arch}.final_logit_softcapping")
            hf["tie_word_embeddings"] = "lm_head.weight" not in self._infos
        if arch == "gemma2":
            hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(layers)]
        if arch == "gemma3":
            hf["rope_local_base_freq"] = 10_000.0
            if (kinds := self._window_pattern(layers)) is not None:
                hf["layer_types"] = kinds
        if arch in ("gemma2", "gemma3"):
            hf["hidden_activation"] = "gelu_pytorch_tanh"  # llama.cpp's Gemma graphs: GELU
        if self.family.name in ("mixtral", "qwen3_moe"):
            hf["num_local_experts"] = int(get("expert_count"))
            hf["num_experts_per_tok"] = int(get("expert_used_count"))
            hf["moe_intermediate_size"] = int(get("expert_feed_forward_length",
                                                  hf["intermediate_size"]))
            hf["norm_topk_prob"] = bool(meta.get(f"{arch}.expert_weights_norm", True))
            # Layers without a router keep a dense MLP (Qwen3-MoE's mlp_only_layers).
            hf["mlp_only_layers"] = [i for i in range(layers)
                                     if f"blk.{i}.ffn_gate_inp.weight" not in self._raw]
        config = self.family.config(hf, self.path)
        if (scaling := self._rope_scaling(head_dim, theta)) is not None:
            config = dataclasses.replace(config, rope_scaling=scaling)
        return config

    def _window_pattern(self, layers: int) -> list[str] | None:
        """Each layer's attention kind from ``attention.sliding_window_pattern``: a period
        (every n-th layer global) or one flag per layer (true: sliding); None if absent."""
        key = f"{self.arch}.attention.sliding_window_pattern"
        value = self.header.metadata.get(key)
        if value is None:  # an array, left out of the light header read
            value = gguf_header(self.path, tensors=False).metadata.get(key)
        if value is None:
            return None
        if isinstance(value, int):
            flags = [bool((i + 1) % value) for i in range(layers)]
        else:
            flags = [bool(v) for v in value]
        if len(flags) != layers:
            raise ModelLoadError(f"{self.path}: {key} has {len(flags)} entries for {layers} "
                                 "layers")
        return ["sliding_attention" if f else "full_attention" for f in flags]

    def _rope_scaling(self, head_dim: int, theta: float) -> Llama3Scaling | None:
        meta, arch = self.header.metadata, self.header.architecture
        kind = meta.get(f"{arch}.rope.scaling.type", "none")
        if kind not in ("none", "llama3"):
            return None  # linear, yarn: in the config already
        if "rope_freqs.weight" not in self._raw:
            return None
        # llama.cpp stores Llama-3 scaling only as per-frequency divisors (rope_freqs, without
        # the original context length); find parameters that give the same frequencies.
        divisors = self._read(self._raw["rope_freqs.weight"]).double()
        base = inv_frequencies(head_dim, theta, None)
        factor = float(divisors.max())
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
            for original in self._original_contexts(divisors, base, factor, low, high):
                scaling = Llama3Scaling(factor, low, high, original)
                expected = base / inv_frequencies(head_dim, theta, scaling)
                if torch.allclose(expected, divisors, rtol=1e-4):
                    return scaling
        raise ModelLoadError(f"{self.path}: rope_freqs do not match Llama-3 rope scaling")

    def _original_contexts(
        self, divisors: torch.Tensor, base: torch.Tensor, factor: float, low: float, high: float
    ) -> list[int]:
        """Candidate original context lengths: metadata, 8192, and any that a blended
        frequency implies (divisor = 1 / ((1 - s) / factor + s), s = (orig / wavelen - low) /
        (high - low))."""
        meta, arch = self.header.metadata, self.header.architecture
        found = [int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192)), 8192]
        wavelen = 2 * math.pi / base
        blended = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
        if factor > 1:
            smooth = (1 / divisors[blended] - 1 / factor) / (1 - 1 / factor)
            found += [round(x) for x in (wavelen[blended] * (low + smooth * (high - low))).tolist()]
        return list(dict.fromkeys(found))
