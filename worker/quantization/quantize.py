"""``tidegate quantize``: a float model (HF directory or GGUF) -> a quantized HF checkpoint.

Every linear layer of the decoder (q/k/v/o, gate/up/down) becomes integers with a scale and
zero point per group, or FP8; embeddings, norms and the LM head stay float (as the W4A16/W8A16
and FP8_DYNAMIC schemes of compressed-tensors, GPTQ and AWQ checkpoints leave them). Methods:

* ``rtn-int8`` / ``rtn-int4``: round to nearest, no data needed;
* ``gptq-int4`` / ``gptq-int8``: GPTQ (``gptq.py``) on calibration text, layer by layer: each
  layer's projections see the inputs the already quantized layers before them produce, and
  q/k/v (and gate/up) share their inputs' Hessian;
* ``awq-int4``: AWQ (``awq.py``) on calibration text, layer by layer likewise: input channels
  scaled by their activations' magnitude before rounding, the inverse folded into the RMSNorm
  weights (q/k/v, gate/up) and the up projection (down), then round to nearest;
* ``fp8``: round to nearest e4m3 with a scale per output channel (max|w| / 448), no data
  needed; activations are quantized per token at run time (llm-compressor's FP8_DYNAMIC).

The checkpoint is written by ``checkpoint_writer`` in compressed-tensors' pack-quantized
format (default; float-quantized for fp8), GPTQ's or AWQ's, with config.json and the
tokenizer, so tidegate, transformers and vLLM read it.
"""

from __future__ import annotations

import time
from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tidegate.kernels import ops
from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.model_files.model_source import ModelLoadError, ModelSource, hf_config, resolve_model
from tidegate.model_files.tokenizer import Tokenizer, load_tokenizer
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import CausalAttention, DecoderLayer, layer_matrices
from tidegate.worker.models.loaders.gguf_weights import GGUFWeights
from tidegate.worker.models.loaders.hf_weights import SafetensorsWeights
from tidegate.worker.models.loaders.loader import load_model
from tidegate.worker.models.online_quantization import auto_group
from tidegate.worker.quantization.awq import awq_scales
from tidegate.worker.quantization.gptq import HessianStats, gptq_quantize
from tidegate.worker.quantization.quantize_options import (
    QuantizeError,
    QuantizeOptions,
    check_options,
)

# Families whose projections carry Llama's names (q/k/v/o, gate/up/down), which quantize rounds;
# AWQ also folds scales into the norms before them, plain RMSNorm gains only.
QUANTIZABLE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
AWQ_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# Calibration rows each projection's AWQ scale search sees (evenly spaced over the windows).
AWQ_TOKENS = 2048

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass
class QuantizeReport:
    source: str
    out: Path
    method: str
    bits: int
    group_size: int  # -1: one group per row
    symmetric: bool
    act_order: bool
    format: str
    linears: int
    calibration_tokens: int
    seconds: float
    bytes_written: int
    kinds: list[str] = field(default_factory=list)


def quantize_model(spec: str, out: Path, options: QuantizeOptions,
                   progress: Progress | None = None) -> QuantizeReport:
    """Quantize the model ``spec`` (HF directory, .gguf, or a packaged name) into ``out``."""
    start = time.perf_counter()
    bits, algorithm = check_options(options, out)
    source, config, tensors, tokenizer, config_json = _source(spec)
    if algorithm == "awq" and config.family not in AWQ_FAMILIES:
        raise QuantizeError(f"{spec}: AWQ folds its scales into the norms, which {config.family} "
                            f"stores otherwise; AWQ takes {', '.join(AWQ_FAMILIES)} "
                            "(gptq-int4 or rtn-int4 take this model)")
    group = _group_size(config, bits, options.group_size)
    if options.format == "awq" and group is None:  # its bits: check_options
        raise QuantizeError("--format awq holds 4-bit integers in groups (not per channel)")

    weights: Mapping[str, IntWeight | Fp8Weight] = {}
    calibration_tokens = 0
    if algorithm in ("rtn", "fp8"):
        weights = _round_to_nearest(config, tensors, lambda w: (
            Fp8Weight.quantize(w) if algorithm == "fp8"
            else IntWeight.quantize(w, bits, group, options.symmetric)), progress)
    else:
        assert options.calibration is not None
        windows = _windows(tokenizer, options.calibration, options.context, options.max_windows)
        calibration_tokens = sum(w.numel() for w in windows)
        if algorithm == "gptq":
            weights = _gptq_model(source, config, windows, bits, group, options, progress)
        else:
            weights, folded = _awq_model(source, windows, bits, group, options, progress)
            tensors = ChainMap(folded, tensors)  # type: ignore[arg-type]

    from tidegate.worker.quantization.checkpoint_writer import write_checkpoint

    written = write_checkpoint(out, config_json or config, tensors, weights, tokenizer,
                               format=options.format, symmetric=options.symmetric)
    return QuantizeReport(
        source=source.name, out=out, method=options.method, bits=bits,
        group_size=-1 if group is None else group, symmetric=options.symmetric,
        act_order=options.act_order, format=options.format, linears=len(weights),
        calibration_tokens=calibration_tokens, seconds=time.perf_counter() - start,
        bytes_written=written, kinds=sorted({k for w in weights.values() for k in w.types}))


def _round_to_nearest(config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                      rounded: Callable[[torch.Tensor], IntWeight | Fp8Weight],
                      progress: Progress | None) -> dict[str, IntWeight | Fp8Weight]:
    """Every decoder projection of ``tensors`` through ``rounded``, one at a time."""
    names = [n for i in range(config.num_layers) for _, _, ns in layer_matrices(i) for n in ns]
    out = {}
    for done, name in enumerate(names, 1):
        out[name] = rounded(tensors[name])
        if progress is not None:
            progress("quantize", done, len(names))
    return out


def _source(spec: str) -> tuple[ModelSource, ModelConfig, Mapping[str, torch.Tensor], Tokenizer,
                                dict[str, Any] | None]:
    """The model to quantize, its config, tensors, tokenizer and (a directory) its config.json,
    which the checkpoint keeps, so the family and its settings carry over."""
    try:
        source = resolve_model(spec)
    except ModelLoadError as exc:
        raise QuantizeError(str(exc)) from None
    if source.kind == "random" or source.path is None:
        raise QuantizeError(f"{spec}: quantize reads a model file (an HF directory or a .gguf)")
    try:
        if source.kind == "gguf":
            weights: GGUFWeights | SafetensorsWeights = GGUFWeights(source.path)
        else:
            from tidegate.worker.models.loaders.quantized.quantized_safetensors import (
                quantization_config,
            )

            if quantization_config(source.path) is not None:
                raise QuantizeError(f"{source.path} is already quantized "
                                    "(its config.json has a quantization_config)")
            weights = SafetensorsWeights(source.path)
        tokenizer = load_tokenizer(source)
    except ModelLoadError as exc:
        raise QuantizeError(str(exc)) from None
    family = weights.config.family
    if family not in QUANTIZABLE_FAMILIES:
        raise QuantizeError(f"{spec}: quantize rounds the q/k/v/o and gate/up/down projections "
                            f"of {', '.join(QUANTIZABLE_FAMILIES)}; {family} stores them "
                            "otherwise (fused or as experts)")
    if source.kind == "gguf" and family != "llama":
        raise QuantizeError(f"{spec}: a {family} GGUF: quantize its Hugging Face directory "
                            "(a checkpoint written from a GGUF is a Llama config.json)")
    config_json = hf_config(source.path) if source.kind == "hf" else None
    return source, weights.config, weights, tokenizer, config_json


def _group_size(config: ModelConfig, bits: int, group: int | None | str) -> int | None:
    """The group size every projection takes (None: one group per row)."""
    widths = {config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size}
    if group == "auto":  # 8 bits: W8A16's usual scheme, a scale per output channel
        return None if bits == 8 else auto_group(config)
    if group in (None, -1):
        return None
    if not isinstance(group, int) or group <= 0:
        raise QuantizeError(f"--group-size {group!r}: a positive number, -1 or auto")
    bad = sorted(w for w in widths if w % group)
    if bad:
        raise QuantizeError(f"--group-size {group} does not divide the projections' input "
                            f"widths {bad}")
    if group % 16 or (bits == 4 and group % 32 and group != 16):
        raise QuantizeError(f"--group-size {group}: a multiple of 32 (or 16), or -1")
    return group


def _windows(tokenizer: Tokenizer, text: str, context: int, max_windows: int
             ) -> list[torch.Tensor]:
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise QuantizeError("the calibration text has fewer than 2 tokens")
    context = min(context, len(ids))
    count = min(max_windows, len(ids) // context)
    return [torch.tensor(ids[i * context:(i + 1) * context]) for i in range(count)]


def _gptq_model(source: ModelSource, config: ModelConfig, windows: list[torch.Tensor],
                bits: int, group: int | None, options: QuantizeOptions,
                progress: Progress | None) -> dict[str, IntWeight]:
    """GPTQ layer by layer over the calibration windows (float32 on the CPU)."""
    loaded = load_model(source, device="cpu", dtype=torch.float32, packed=False)
    model = loaded.model
    hidden = [model.embed_tokens(w) for w in windows]
    residual: list[torch.Tensor | None] = [None] * len(windows)
    positions = [torch.arange(w.numel()) for w in windows]
    out: dict[str, IntWeight] = {}
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            stats = {attr: HessianStats(getattr(layer, attr).weight.shape[1])
                     for attr, _, _ in layer_matrices(i)}
            for w in range(len(windows)):
                _run_layer(layer, i, hidden[w], residual[w], positions[w], model.rope_for(i),
                           lambda attr, x, stats=stats: stats[attr].add(x))
            hessians = {attr: st.matrix() for attr, st in stats.items()}
            out.update(_quantize_layer(layer, i, config, lambda attr, w, h=hessians: gptq_quantize(
                w, h[attr], bits, group, options.symmetric, options.act_order, options.damp)))
            _advance(layer, i, hidden, residual, positions, model.rope_for(i))
            if progress is not None:
                progress("gptq layers", i + 1, len(model.layers))
    return out


def _awq_model(source: ModelSource, windows: list[torch.Tensor], bits: int, group: int | None,
               options: QuantizeOptions, progress: Progress | None
               ) -> tuple[dict[str, IntWeight], dict[str, torch.Tensor]]:
    """AWQ layer by layer (float32 on the CPU): the integers, and the norm weights the scales
    were folded into (they replace the source's in the checkpoint)."""
    loaded = load_model(source, device="cpu", dtype=torch.float32, packed=False)
    model, config = loaded.model, loaded.config
    hidden = [model.embed_tokens(w) for w in windows]
    residual: list[torch.Tensor | None] = [None] * len(windows)
    positions = [torch.arange(w.numel()) for w in windows]
    out: dict[str, IntWeight] = {}
    folded: dict[str, torch.Tensor] = {}
    inter = config.intermediate_size
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            seen: dict[str, list[torch.Tensor]] = {attr: [] for attr, _, _ in layer_matrices(i)}
            for w in range(len(windows)):
                _run_layer(layer, i, hidden[w], residual[w], positions[w], model.rope_for(i),
                           lambda attr, x, seen=seen: seen[attr].append(x))
            inputs = {attr: _spaced_rows(torch.cat(xs), AWQ_TOKENS) for attr, xs in seen.items()}
            s_qkv, s_gate_up, s_down = (
                awq_scales([getattr(layer, attr).weight], inputs[attr], bits, group,
                           options.symmetric)
                for attr in ("qkv_proj", "gate_up_proj", "down_proj"))
            # Each scale multiplies its matrix's columns and divides what feeds them: the
            # float layer computes the same function.
            layer.qkv_proj.weight.mul_(s_qkv)
            layer.input_norm.div_(s_qkv)
            layer.gate_up_proj.weight.mul_(s_gate_up)
            layer.post_attn_norm.div_(s_gate_up)
            layer.down_proj.weight.mul_(s_down)
            layer.gate_up_proj.weight[inter:].div_(s_down[:, None])  # the up rows
            prefix = f"model.layers.{i}."
            folded[prefix + "input_layernorm.weight"] = layer.input_norm.detach().clone()
            folded[prefix + "post_attention_layernorm.weight"] = (
                layer.post_attn_norm.detach().clone())
            out.update(_quantize_layer(layer, i, config, lambda attr, w: replace(
                IntWeight.quantize(w, bits, group, options.symmetric), format="awq")))
            _advance(layer, i, hidden, residual, positions, model.rope_for(i))
            if progress is not None:
                progress("awq layers", i + 1, len(model.layers))
    return out, folded


def _quantize_layer(layer: DecoderLayer, index: int, config: ModelConfig,
                    quantize: Callable[[str, torch.Tensor], IntWeight]) -> dict[str, IntWeight]:
    """Each HF matrix of layer ``index`` (the rows of its fused projection) through
    ``quantize`` (attribute, float rows); the fused projections then hold the rounded values,
    so the next layers calibrate on what the quantized layer computes."""
    out: dict[str, IntWeight] = {}
    for attr, _, names in layer_matrices(index):
        fused = getattr(layer, attr).weight
        row = 0
        rounded = []
        for name in names:
            rows = _rows_of(config, name)
            out[name] = quantize(attr, fused[row:row + rows])
            rounded.append(out[name].dequantize())
            row += rows
        fused.copy_(torch.cat(rounded))
    return out


def _advance(layer: DecoderLayer, index: int, hidden: list[torch.Tensor],
             residual: list[torch.Tensor | None], positions: list[torch.Tensor],
             rope: torch.Tensor) -> None:
    """Every window through layer ``index``, in place: its output is the next layer's input."""
    for w in range(len(hidden)):
        hidden[w], residual[w] = _run_layer(layer, index, hidden[w], residual[w], positions[w],
                                            rope, None)


def _spaced_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """At most ``count`` rows of ``x``, evenly spaced."""
    if x.shape[0] <= count:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, count).long()]


def _rows_of(config: ModelConfig, name: str) -> int:
    if ".k_proj." in name or ".v_proj." in name:
        return config.num_kv_heads * config.head_dim
    if ".q_proj." in name:
        return config.num_heads * config.head_dim
    if ".gate_proj." in name or ".up_proj." in name:
        return config.intermediate_size
    return config.hidden_size  # o_proj, down_proj


def _run_layer(layer: DecoderLayer, index: int, hidden: torch.Tensor,
               residual: torch.Tensor | None, positions: torch.Tensor, rope: torch.Tensor,
               record: Callable[[str, torch.Tensor], None] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on one window (its unfused CPU path), handing each projection's
    input to ``record`` (the projection's attribute, its input) when given."""
    eps = layer.cfg.rms_norm_eps
    x, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
    if record is not None:
        record("qkv_proj", x)
    out = layer._attention(ops.linear(x, layer.qkv_proj.weight), positions, rope,
                           CausalAttention(), index)
    if record is not None:
        record("o_proj", out)
    x, residual = ops.rms_norm(ops.linear(out, layer.o_proj.weight), layer.post_attn_norm, eps,
                               residual)
    if record is not None:
        record("gate_up_proj", x)
    act = ops.silu_and_mul(ops.linear(x, layer.gate_up_proj.weight))
    if record is not None:
        record("down_proj", act)
    return ops.linear(act, layer.down_proj.weight), residual
