"""Turn a model spec into a ready ``DecoderModel`` with its config and tokenizer.

The format-specific readers live beside this file (``gguf_weights``, ``hf_weights``,
``random_weights``); each yields a ``ModelConfig`` and, for real weights, a lazy mapping of
HF-named tensors, so a checkpoint is copied into the model one tensor at a time and never held
twice in memory.

A GGUF file served on the CPU keeps its quantized matrices packed (``packed``): the model's
projections and embedding hold the file's blocks and the native kernels read them, so the
default model (Q4_1, 98 MB) stays 98 MB instead of 540 MB of float32. On accelerators, or where
the native kernels do not build, the matrices are dequantized to ``dtype`` as before.

A Hugging Face directory with a ``quantization_config`` (GPTQ, AWQ, compressed-tensors, FP8;
``quantized/``) keeps its integer matrices as ``IntWeight``s and its FP8 ones as ``Fp8Weight``s,
on the CPU (native kernel, float32) and on CUDA (Triton); elsewhere, or with ``packed=False``,
they are dequantized.

On the CPU, packed matrices multiply activations rounded to 8-bit blocks (``cpu_activations``
"int8", the default: integer dot products, as llama.cpp computes the same file) or float32 ones
("float": exactly the dequantized model's outputs; ``tidegate.kernels.reference.q8_activations``). FP8 matrices
always take float32 ones there.

A rank of a parallel worker loads only its share of the model: the caller hands ``load_model``
the share (``model_share.ModelShare``, implemented by ``tidegate.worker.parallel``), which this
module never imports. ``quantize`` rounds a float model's projections at load
(``tidegate.worker.models.online_quantization``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tidegate.kernels.cpu.native_cpu import native_kernels
from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.model_files.model_source import ModelLoadError, ModelSource, resolve_model
from tidegate.model_files.tokenizer import Tokenizer, load_tokenizer
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import (
    DecoderModel,
    Partition,
    TensorSource,
)
from tidegate.worker.models.loaders.gguf_weights import GGUFWeights
from tidegate.worker.models.loaders.hf_weights import SafetensorsWeights
from tidegate.worker.models.loaders.model_share import ModelShare, ModelSplit
from tidegate.worker.models.loaders.quantized.quantized_safetensors import (
    QuantizedSafetensors,
    quantization_config,
)
from tidegate.worker.models.loaders.random_weights import init_random_weights, preset_llama_config
from tidegate.worker.models.online_quantization import METHODS, quantize_model_at_load
from tidegate.worker.models.packed_modules import PackedMatrix, use_activations


@dataclass
class LoadedModel:
    model: DecoderModel  # in eval mode, on the requested device and dtype
    config: ModelConfig
    tokenizer: Tokenizer
    source: ModelSource
    load_s: float  # wall time of load_model, tokenizer included

    def weight_bytes(self) -> int:
        """Bytes the weights take in memory, packed matrices as stored."""
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return total + sum(w.nbytes for w in self._packed())

    def packed_types(self) -> list[str]:
        """The types of the packed matrices (GGML types, int4-g128, fp8-e4m3-channel), most
        common first ([] if none is packed)."""
        counts = Counter(name for w in self._packed() for name in w.types)
        return [name for name, _ in counts.most_common()]

    def activations(self) -> str | None:
        """What the CPU multiplies the packed matrices with ("float" or "int8"); None if
        nothing is packed."""
        modes = {w.activations for w in self._packed()}
        return "+".join(sorted(modes)) or None

    def _packed(self) -> Iterator[PackedMatrix]:
        for module in self.model.modules():
            if isinstance(weight := getattr(module, "weight", None), PackedMatrix):
                yield weight


# What packed matrices on the CPU multiply. auto is int8: what a llama.cpp user gets from the
# same file, 2-3x faster projections (benchmarks/results/engine/quantized_cpu.md), a perplexity
# within 0.1% of float's; float keeps the dequantized model's outputs exactly.
CPU_ACTIVATIONS = ("auto", "float", "int8")


def default_dtype(device: str | torch.device) -> torch.dtype:
    """float32 on the CPU (bfloat16 matmuls there are slow), bfloat16 on accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def load_model(
    spec_or_source: str | ModelSource,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    packed: bool | None = None,
    quantize: str | None = None,
    cpu_activations: str = "auto",
    share: ModelShare | None = None,
) -> LoadedModel:
    """Load a model by spec ("smollm2", a directory, a .gguf file, "random:<preset>").

    ``seed`` only matters for random weights. ``packed``: keep a GGUF file's quantized
    matrices packed (None: wherever the packed kernels serve, i.e. float32 on the CPU with the
    native kernels built; False: dequantize everything). ``quantize`` (``fp8``, ``rtn-int8``,
    ``rtn-int4``; ``tidegate.worker.models.online_quantization``): round a float model's
    projections at load. ``cpu_activations``: what packed matrices on the CPU multiply, "int8"
    or "float" (``CPU_ACTIVATIONS``; "auto": int8). ``share``: load only this share of the
    model (a rank of a parallel worker: ``tidegate.worker.parallel.rank_share.RankShare``;
    quantized files are dequantized then).
    Raises ``ModelLoadError`` naming what is wrong.
    """
    if cpu_activations not in CPU_ACTIVATIONS:
        raise ModelLoadError(f"cpu_activations must be one of {', '.join(CPU_ACTIVATIONS)}, "
                             f"got {cpu_activations!r}")
    start = time.perf_counter()
    source = (resolve_model(spec_or_source) if isinstance(spec_or_source, str)
              else spec_or_source)
    dtype = dtype or default_dtype(device)
    tokenizer = load_tokenizer(source)
    if share is not None:
        model, config = _load_share(source, share, device, dtype, seed)
    elif source.kind == "random":
        assert source.preset is not None
        config = preset_llama_config(source.preset)
        model = empty_model(config, device, dtype)
        init_random_weights(model, seed)
    else:
        assert source.path is not None
        quantized = source.kind == "hf" and quantization_config(source.path) is not None
        weights: GGUFWeights | SafetensorsWeights | QuantizedSafetensors = (
            GGUFWeights(source.path) if source.kind == "gguf"
            else QuantizedSafetensors(source.path) if quantized
            else SafetensorsWeights(source.path))
        config = weights.config
        serves = int_serves(device, dtype) if quantized else packed_serves(device, dtype)
        if packed is None:
            packed = serves
        elif packed and not serves:
            raise ModelLoadError(
                f"{source.path}: packed weights run on the CPU in float32 with the native "
                "kernels (TIDEGATE_KERNELS auto or native)" + (", or on CUDA" if quantized
                                                              else ""))
        sources = weights.sources
        try:
            if packed and isinstance(weights, GGUFWeights):
                model = empty_model(config, device, dtype, packed=weights.packed, sources=sources)
            elif packed and isinstance(weights, QuantizedSafetensors):
                model = empty_model(config, device, dtype, packed=weights.quantized_weight,
                                    sources=sources)
            else:
                model = empty_model(config, device, dtype)
            model.load_hf_state_dict(
                DequantizedView(weights) if isinstance(weights, QuantizedSafetensors)
                else weights, sources)
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"{source.path}: {exc}") from exc
    loaded = LoadedModel(model, config, tokenizer, source, 0.0)
    if quantize not in (None, "none"):
        _quantize_at_load(loaded, quantize, device, dtype)
    if torch.device(device).type == "cpu":
        use_activations(model, "int8" if cpu_activations == "auto" else cpu_activations)
    loaded.load_s = time.perf_counter() - start
    return loaded


def _weights(source: ModelSource
             ) -> tuple[ModelConfig, GGUFWeights | SafetensorsWeights | QuantizedSafetensors | None]:
    """A model's config and its lazy tensors (None: random weights)."""
    if source.kind == "random":
        assert source.preset is not None
        return preset_llama_config(source.preset), None
    assert source.path is not None
    quantized = source.kind == "hf" and quantization_config(source.path) is not None
    weights = (GGUFWeights(source.path) if source.kind == "gguf"
               else QuantizedSafetensors(source.path) if quantized
               else SafetensorsWeights(source.path))
    return weights.config, weights


def check_layout(spec: str, layout: ModelSplit) -> ModelConfig:
    """The model's config, once ``layout`` (a parallel worker's) is known to split it
    (``ModelLoadError`` naming why not); reads no weights."""
    source = resolve_model(spec)
    config, _ = _weights(source)
    _check_split(source, layout, config)
    return config


def _check_split(source: ModelSource, split: ModelSplit, config: ModelConfig) -> None:
    try:
        split.check(config)
    except ValueError as exc:
        raise ModelLoadError(f"{source.name}: {exc}") from None


def _load_share(source: ModelSource, share: ModelShare, device: str | torch.device,
                dtype: torch.dtype, seed: int) -> tuple[DecoderModel, ModelConfig]:
    """The share of the model and the whole model's config."""
    config, weights = _weights(source)
    _check_split(source, share, config)
    model = empty_model(share.local_config(config), device, dtype,
                        partition=share.partition(config))
    if weights is None:
        share.init_random(model, config, seed)
        return model, config
    try:
        share.load(model, config,
                   DequantizedView(weights) if isinstance(weights, QuantizedSafetensors)
                   else weights, weights.sources)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{source.path}: {exc}") from exc
    return model, config


def _quantize_at_load(loaded: LoadedModel, method: str, device: str | torch.device,
                      dtype: torch.dtype) -> None:
    name = loaded.source.name
    if method not in METHODS:
        raise ModelLoadError(f"quantize {method!r}: one of {', '.join(METHODS)}")
    if loaded.packed_types():
        raise ModelLoadError(f"{name} is quantized already ({'+'.join(loaded.packed_types())})"
                             f": --quantize {method} takes a float model")
    if not int_serves(device, dtype):
        raise ModelLoadError(f"--quantize {method}: the quantized kernels run on CUDA, or on the "
                             "CPU in float32 with the native kernels")
    try:
        quantize_model_at_load(loaded.model, method)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: {exc}") from exc


def int_serves(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether the integer and FP8 kernels serve a model on ``device`` in ``dtype``: on CUDA
    (Triton), and on the CPU in float32 (the native kernel)."""
    return torch.device(device).type == "cuda" or packed_serves(device, dtype)


class DequantizedView(Mapping[str, torch.Tensor]):
    """A quantized checkpoint's tensors as float: its integer and FP8 matrices dequantized
    (what a model that keeps nothing packed loads)."""

    def __init__(self, weights: QuantizedSafetensors) -> None:
        self.weights = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        if (weight := self.weights.quantized_weight(name)) is not None:
            return weight.dequantize()
        return self.weights[name]

    def __contains__(self, name: object) -> bool:
        return (isinstance(name, str) and self.weights.quantized_weight(name) is not None
                ) or name in self.weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def packed_serves(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether the packed kernels serve a model on ``device`` in ``dtype``."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and native_kernels() is not None)


def _empty(like: torch.Tensor, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``like``'s shape on ``device``, in ``dtype`` if ``like`` is
    floating point (as ``Module.to(dtype=...)`` casts)."""
    return torch.empty(like.shape, dtype=dtype if like.is_floating_point() else like.dtype,
                       device=device)


def empty_model(config: ModelConfig, device: str | torch.device, dtype: torch.dtype, *,
                packed: Callable[[str], PackedMatrix | None] | None = None,
                sources: Sequence[TensorSource] | None = None,
                partition: Partition | None = None) -> DecoderModel:
    """A model with uninitialised weights allocated once, in ``dtype`` on ``device``.

    Built on the meta device first so an 8B model never exists as a float32 CPU copy; the rope
    tables, computed on the CPU all the same, are kept in float32 (positions need the precision).
    ``packed`` (name -> packed matrix or None) swaps packed modules in before anything is
    allocated.
    """
    with torch.device("meta"):
        model = DecoderModel(config, partition)
    rope, rope_local = model.rope_cache, model.rope_cache_local  # float32, on the CPU
    if packed is not None:
        model.adopt_packed(packed, sources)
    for module in model.modules():
        # Module.to_empty's empty_like of a meta tensor imports sympy (0.5 s of every start).
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(_empty(param, dtype, device),
                                               requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, _empty(buffer, dtype, device))
        # Packed weights are attributes, which Module.to leaves.
        if isinstance(weight := getattr(module, "weight", None), IntWeight | Fp8Weight):
            module.weight = weight.to(device)
    model.rope_cache = rope.to(device)
    if rope_local is not None:
        model.rope_cache_local = rope_local.to(device)
    return model.eval()
