"""FP8 checkpoints (compressed-tensors ``float-quantized``, vLLM's ``quant_method: "fp8"``) read
into ``Fp8Weight``s: tiny checkpoints written by hand in each variant and by compressed-tensors
itself, compared value for value with ``fp8_dequantize`` (the e4m3 bytes decoded bit by bit, not
by our reader); the model they load against transformers on the same values; what FP8 per tensor
or per channel cannot serve refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests.worker.compressed_tensors_oracle import (
    decompress_with_compressed_tensors,
    needs_compressed_tensors,
    write_with_compressed_tensors,
)
from tests.worker.hf_oracle import causal_logits
from tests.worker.quantized_checkpoints import (
    Tiny,
    edit_config,
    edit_tensors,
    fp8_dequantize,
    linear_names,
    refused,
    stored,
    tiny_checkpoint,
)
from tests.worker.tiny_checkpoints import tiny_hf_model
from tidegate.kernels.weights.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Weight
from tidegate.worker.models.loaders.loader import load_model
from tidegate.worker.models.loaders.quantized.quantized_safetensors import QuantizedSafetensors

IDS = [256, *range(40, 100, 3), 97, 98, 99, 10, 32, 200, 255]
Q_PROJ = "model.layers.0.self_attn.q_proj"
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
               "dynamic": False}
INPUTS = {  # llm-compressor's FP8_DYNAMIC and FP8 (static) activations
    "dynamic": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                "dynamic": True},
    "static": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
               "dynamic": False},
    "none": None,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return tiny_checkpoint(tmp_path_factory.mktemp("float"))


def fp8_tensors(w: torch.Tensor, strategy: str, scale_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, weight_scale) of float ``w`` as a quantizer stores them: the scale rounded
    to ``scale_dtype`` first, so the stored pair is what it means."""
    scale = (w.abs().amax(dim=1, keepdim=True) if strategy == "channel"
             else w.abs().amax().reshape(1)) / FP8_MAX
    scale = scale.to(scale_dtype)
    q = (w / scale.float().reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def write_fp8(path: Path, tiny: Tiny, quantization_config: dict[str, Any], *,
              strategy: str = "channel", scale_dtype: torch.dtype = torch.bfloat16,
              skip: tuple[str, ...] = (), input_scale: bool = False,
              scalar_scales: bool = False) -> None:
    """The tiny model with every projection (but those named in ``skip``) in FP8."""
    t = dict(tiny.tensors)
    for name in linear_names(tiny.tensors):
        module = name.removesuffix(".weight")
        if any(part in module for part in skip):
            continue
        t[name], scale = fp8_tensors(tiny.tensors[name], strategy, scale_dtype)
        t[f"{module}.weight_scale"] = scale.reshape(()) if scalar_scales else scale
        if input_scale:
            t[f"{module}.input_scale"] = torch.tensor([0.02])
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, path / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tiny.dir / name).read_bytes())
    (path / "config.json").write_text(json.dumps(
        {**tiny.config, "quantization_config": quantization_config}))


def compressed_tensors_fp8(strategy: str, inputs: str, ignore: list[str] | None = None
                           ) -> dict[str, Any]:
    fmt = "naive-quantized" if inputs == "none" else "float-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "version": "0.20.0",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": fmt, "output_activations": None,
                "weights": {**FP8_WEIGHTS, "strategy": strategy},
                "input_activations": INPUTS[inputs]}},
            "ignore": ["lm_head"] if ignore is None else ignore, "kv_cache_scheme": None,
            "sparsity_config": {}, "transform_config": {}}


def check_reads_as_definition(path: Path, fmt: str, count: int = 14) -> QuantizedSafetensors:
    reader = QuantizedSafetensors(path)
    assert len(reader.quantized) == count and "lm_head.weight" not in reader.quantized
    t = stored(path)
    for name in reader.quantized:
        got = reader.quantized_weight(name)
        assert isinstance(got, Fp8Weight) and got.format == fmt
        assert got.weight.dtype == FP8_DTYPE and got.scales.dtype == torch.float32
        assert torch.equal(got.dequantize(), fp8_dequantize(t, name.removesuffix(".weight")))
        assert torch.equal(reader[name], got.dequantize())
    return reader


VARIANTS = [(s, i, d) for s in ("channel", "tensor") for i in ("dynamic", "static", "none")
            for d in (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize(("strategy", "inputs", "scale_dtype"), VARIANTS, ids=[
    f"{s}-{i}-{str(d).removeprefix('torch.')}" for s, i, d in VARIANTS])
def test_compressed_tensors_fp8_reads_as_its_definition(
        tmp_path: Path, tiny: Tiny, strategy: str, inputs: str,
        scale_dtype: torch.dtype) -> None:
    write_fp8(tmp_path, tiny, compressed_tensors_fp8(strategy, inputs), strategy=strategy,
              scale_dtype=scale_dtype, input_scale=inputs == "static")
    reader = check_reads_as_definition(tmp_path, "compressed-tensors")
    got = reader.quantized_weight(f"{Q_PROJ}.weight")
    assert got is not None and got.types == ("fp8-e4m3-channel",)
    if strategy == "tensor":  # one scale, repeated on every row
        assert torch.all(got.scales == got.scales[0])
    assert f"{Q_PROJ}.input_scale" not in reader and f"{Q_PROJ}.weight_scale" not in reader


@pytest.mark.parametrize("activation_scheme", ["dynamic", "static"])
def test_vllm_fp8_configs_read_as_their_definition(tmp_path: Path, tiny: Tiny,
                                                   activation_scheme: str) -> None:
    """AutoFP8's layout: a scalar per-tensor weight_scale (and input_scale when static)."""
    write_fp8(tmp_path, tiny, {"quant_method": "fp8", "activation_scheme": activation_scheme,
                               "ignored_layers": ["lm_head"]}, strategy="tensor",
              scale_dtype=torch.float32, scalar_scales=True,
              input_scale=activation_scheme == "static")
    check_reads_as_definition(tmp_path, "fp8")


@pytest.mark.parametrize("key", ["ignored_layers", "modules_to_not_convert"])
def test_layers_left_float_by_the_config_read_as_stored(tmp_path: Path, tiny: Tiny,
                                                        key: str) -> None:
    write_fp8(tmp_path, tiny, {"quant_method": "fp8", "activation_scheme": "dynamic",
                               key: ["lm_head", "mlp.down_proj", "model.layers.1.self_attn.v_proj"]},
              strategy="tensor", skip=("down_proj", "layers.1.self_attn.v_proj"))
    reader = check_reads_as_definition(tmp_path, "fp8", count=11)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.v_proj.weight"):
        assert reader.quantized_weight(name) is None
        assert torch.equal(reader[name], tiny.tensors[name])


@needs_compressed_tensors
@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8"])
def test_a_checkpoint_compressed_tensors_wrote_reads_as_it_decompresses(tmp_path: Path,
                                                                       preset: str) -> None:
    write_with_compressed_tensors(tmp_path, preset)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized"
    reader = check_reads_as_definition(tmp_path, "compressed-tensors")
    for name in reader.quantized:
        got = reader.quantized_weight(name)
        assert got is not None
        module = name.removesuffix(".weight")
        assert torch.equal(got.dequantize(), decompress_with_compressed_tensors(tmp_path, module))


def test_a_mixed_model_loads_fp8_and_float_projections_stacked(tmp_path: Path,
                                                               tiny: Tiny) -> None:
    """Per-tensor scales differ between q, k and v: the fused qkv stacks them row by row; an
    ignored projection stays an nn.Linear, the embedding float. Its logits are transformers'
    on the same dequantized values, kept FP8 (native kernel) or dequantized at load."""
    config = compressed_tensors_fp8("tensor", "static", ["lm_head", "re:.*mlp.down_proj$"])
    write_fp8(tmp_path, tiny, config, strategy="tensor", skip=("down_proj",), input_scale=True)
    loaded = load_model(str(tmp_path))
    assert loaded.packed_types() == ["fp8-e4m3-channel"]
    layer = loaded.model.layers[0]
    assert isinstance(loaded.model.embed_tokens, nn.Embedding)
    assert isinstance(layer.down_proj, nn.Linear) and isinstance(loaded.model.lm_head, nn.Linear)
    qkv = layer.qkv_proj.weight
    assert isinstance(qkv, Fp8Weight) and len(qkv.scales.unique()) == 3
    t = stored(tmp_path)
    parts = [fp8_dequantize(t, f"model.layers.0.self_attn.{p}_proj") for p in "qkv"]
    assert torch.equal(qkv.dequantize(), torch.cat(parts))
    hf = tiny_hf_model(tied=False)
    reader = QuantizedSafetensors(tmp_path)
    with torch.no_grad():
        for name in reader.quantized:
            hf.get_parameter(name).copy_(fp8_dequantize(t, name.removesuffix(".weight")))
        want = hf(torch.tensor([IDS])).logits[0]
    dequantized = load_model(str(tmp_path), packed=False)
    assert dequantized.packed_types() == []
    for model in (loaded.model, dequantized.model):
        assert (causal_logits(model, IDS) - want).abs().max().item() < 1e-4
    assert loaded.weight_bytes() < dequantized.weight_bytes()


# --- refusals --------------------------------------------------------------------------------

@pytest.fixture
def ct_dir(tmp_path: Path, tiny: Tiny) -> Path:
    write_fp8(tmp_path, tiny, compressed_tensors_fp8("channel", "dynamic"))
    return tmp_path


@pytest.fixture
def vllm_dir(tmp_path: Path, tiny: Tiny) -> Path:
    write_fp8(tmp_path, tiny, {"quant_method": "fp8", "activation_scheme": "dynamic"},
              strategy="tensor", scalar_scales=True)
    return tmp_path


def edit_group(path: Path, **changes: Any) -> None:
    groups = json.loads((path / "config.json").read_text())["quantization_config"][
        "config_groups"]
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(groups["group_0"].get(key), dict):
            groups["group_0"][key].update(value)
        else:
            groups["group_0"][key] = value
    edit_config(path, config_groups=groups)


@pytest.mark.parametrize(("changes", "match"), [
    ({"weights": {"strategy": "block", "block_structure": [128, 128]}},
     r"weights \(float-quantized\): float strategy 'block' \(FP8_BLOCK\) is not supported "
     r"\(tensor, channel\)"),
    ({"weights": {"strategy": "group", "group_size": 32}},
     r"float strategy 'group' is not supported \(tensor, channel\)"),
    ({"weights": {"num_bits": 4, "strategy": "tensor_group"}},
     r"float num_bits 4 \(FP4, NVFP4\) is not supported \(8: FP8 e4m3\)"),
    ({"weights": {"symmetric": False}}, "asymmetric float weights"),
    ({"weights": {"dynamic": True}}, "dynamic weight quantization is not supported"),
    ({"output_activations": INPUTS["dynamic"]}, "output_activations are not supported"),
    ({"input_activations": {"strategy": "group", "group_size": 128}},
     r"input_activations strategy 'group' is not supported \(token, tensor\)"),
    ({"input_activations": {"type": "int"}},
     r"input_activations int 8-bit with FP8 weights are not supported"),
    ({"format": "pack-quantized"}, "float weights in format 'pack-quantized' are not supported"),
    ({"weights": {"type": "int"}, "input_activations": None},
     "int weights in format 'float-quantized' are not supported"),
    ({"format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized' is not supported"),
])
def test_compressed_tensors_fp8_schemes_we_cannot_honour_are_refused(
        ct_dir: Path, changes: dict[str, Any], match: str) -> None:
    edit_group(ct_dir, **changes)
    refused(ct_dir, match)


def test_an_fp8_kv_cache_scheme_is_refused(ct_dir: Path) -> None:
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    edit_config(ct_dir, kv_cache_scheme=kv)
    refused(ct_dir, "compressed-tensors kv_cache_scheme is not supported")


@pytest.mark.parametrize(("changes", "match"), [
    ({"weight_block_size": [128, 128]}, r"fp8 quantization_config.weight_block_size \[128, "
     r"128\] \(block-wise FP8\) is not supported"),
    ({"activation_scheme": "per_group"}, "activation_scheme 'per_group' is not supported"),
    ({"fmt": "e5m2"}, r"fmt 'e5m2' is not supported \(e4m3\)"),
    ({"kv_cache_scheme": "static"}, "fp8 quantization_config.kv_cache_scheme is not supported"),
])
def test_vllm_fp8_configs_we_cannot_honour_are_refused(vllm_dir: Path, changes: dict[str, Any],
                                                       match: str) -> None:
    edit_config(vllm_dir, **changes)
    refused(vllm_dir, match)


@pytest.mark.parametrize(("name", "value", "match"), [
    (f"{Q_PROJ}.weight", lambda w: w.to(torch.bfloat16),
     r"tensor model.layers.0.self_attn.q_proj.weight \(fp8\) is bfloat16, expected "
     r"float8_e4m3fn"),
    (f"{Q_PROJ}.weight", lambda w: w.to(torch.float8_e5m2), "is float8_e5m2, expected"),
    (f"{Q_PROJ}.weight_scale", lambda s: torch.ones(64), r"has shape \[64\], expected \[\] or"),
    (f"{Q_PROJ}.input_scale", lambda s: torch.ones(2), r"input_scale \(fp8\) has shape \[2\]"),
    (f"{Q_PROJ}.weight", lambda w: torch.where(torch.arange(64) == 5, torch.nan, w.float()).to(
        FP8_DTYPE), r"tensor model.layers.0.self_attn.q_proj.weight \(fp8\) holds NaN"),
])
def test_a_bad_tensor_is_named(vllm_dir: Path, name: str, value: Any, match: str) -> None:
    edit_tensors(vllm_dir, lambda t: t.update({name: value(t.get(name))}))
    refused(vllm_dir, match)


def test_a_linear_the_config_quantizes_but_the_file_keeps_float_is_named(vllm_dir: Path) -> None:
    name = "model.layers.1.mlp.up_proj"
    edit_tensors(vllm_dir, lambda t: t.pop(f"{name}.weight_scale"))
    refused(vllm_dir, rf"tensor {name}.weight_scale \(fp8\) is missing: the config quantizes "
                      f"{name}")


def test_a_refused_checkpoint_exits_2_naming_the_field(ct_dir: Path, tmp_path: Path) -> None:
    edit_group(ct_dir, weights={"strategy": "block", "block_structure": [128, 128]})
    text = tmp_path / "text.txt"
    text.write_text("the tide came in " * 20)
    done = subprocess.run([sys.executable, "-m", "tidegate", "eval-ppl", str(ct_dir), "--text",
                           str(text)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "config_groups.group_0.weights (float-quantized): float strategy 'block'" in (
        done.stderr)
    assert "Traceback" not in done.stderr
