"""Llama weights from a llama.cpp GGUF file: config from its metadata, tensors renamed to
Hugging Face's names, with llama.cpp's q/k row permutation undone. Each matrix comes either
packed, in its own block format (``packed``: what the CPU's packed kernels read), or dequantized
to float32 (``__getitem__``: accelerators, and anything the packed kernels do not implement).

llama.cpp's converter reorders the rows of q_proj and k_proj within each head so that its
interleaved rotary (pairs 0-1, 2-3, ...) equals HF's rotate-half (pairs i, i + D/2); our model
rotates halves like HF, so the rows go back to HF's order here, as transformers' GGUF loader does.
"""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kernels.packed_weight import PACKED_TYPES, PackedWeight
from kernels.rotary import Llama3Scaling, inv_frequencies
from tidegate.model_files.gguf_file import GGUFHeader, GGUFTensorInfo
from tidegate.model_files.model_source import ModelLoadError, gguf_header
from worker.models.llama import LlamaConfig

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    if m := _BLOCK.match(gguf_name):
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}" if part in _LAYER_NAMES else None
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[stem]}.{kind}" if stem in _GLOBAL_NAMES else None


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
        self._infos: dict[str, GGUFTensorInfo] = {}
        for info in self.header.tensors:
            if (name := hf_name(info.name)) is not None:
                self._infos[name] = info
            if info.name.endswith(".bias"):
                raise ModelLoadError(f"{path}: tensor {info.name}: biases are not supported")
        self._raw = {info.name: info for info in self.header.tensors}
        # A plain read-only array over an mmap: np.memmap's per-slice bookkeeping costs ~0.4 s
        # over the thousands of row groups gguf's dequantizer slices.
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._map, dtype=np.uint8)
        self.config = self._config()

    def __getitem__(self, name: str) -> torch.Tensor:
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
        """The head count whose rows llama.cpp interleaved in ``name`` (q or k), else None."""
        if ".self_attn.q_proj." in name:
            return self.config.num_heads
        if ".self_attn.k_proj." in name:
            return self.config.num_kv_heads
        return None

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read (dequantize) the tensor just to answer.
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

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

    def _config(self) -> LlamaConfig:
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
        return LlamaConfig(
            vocab_size=self._infos["model.embed_tokens.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta,
            rope_scaling=self._rope_scaling(head_dim, theta),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="lm_head.weight" not in self._infos,
        )

    def _rope_scaling(self, head_dim: int, theta: float) -> Llama3Scaling | None:
        meta, arch = self.header.metadata, self.header.architecture
        kind = meta.get(f"{arch}.rope.scaling.type", "none")
        if kind not in ("none", "llama3"):
            raise ModelLoadError(f"{self.path}: rope scaling {kind!r} is not supported")
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
