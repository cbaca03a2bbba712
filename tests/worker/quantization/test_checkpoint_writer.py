"""The checkpoint writer as other readers see it: transformers and compressed-tensors 0.20 load
what it writes (integers and FP8) to the values our reader gives, its FP8 config is
llm-compressor's FP8_DYNAMIC preset, its configs parse as transformers' own config classes, and
what no format can hold is refused by name."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AwqConfig, GPTQConfig

from tests.worker.compressed_tensors_oracle import needs_compressed_tensors
from tests.worker.hf_oracle import causal_logits
from tests.worker.quantized_checkpoints import linear_names, random_int_weights
from tests.worker.quantized_checkpoints import load_exact_model as load_model
from tests.worker.tiny_checkpoints import tiny_hf_model, write_hf_dir
from tidegate.kernels.reference.rotary import Llama3Scaling
from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import DecoderModel
from tidegate.worker.models.loaders.hf_weights import hf_model_config
from tidegate.worker.models.loaders.quantized.quantized_safetensors import QuantizedSafetensors
from tidegate.worker.quantization.checkpoint_writer import write_checkpoint

IDS = [256, *range(40, 100, 3), 10, 32, 200, 255]
Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_dir(tiny_hf_model(tied=False), tmp_path_factory.mktemp("float"))


def hf_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def rtn(tensors: dict[str, torch.Tensor], bits: int, group: int | None,
        symmetric: bool) -> dict[str, IntWeight]:
    return {n: IntWeight.quantize(tensors[n], bits, group, symmetric)
            for n in linear_names(tensors)}


def fp8(tensors: dict[str, torch.Tensor]) -> dict[str, Fp8Weight]:
    return {n: Fp8Weight.quantize(tensors[n]) for n in linear_names(tensors)}


VARIANTS = {"w4-g32-asym": (4, 32, False), "w4-channel-sym": (4, None, True),
            "w8-channel-asym": (8, None, False), "w8-g32-sym": (8, 32, True)}


@needs_compressed_tensors
@pytest.mark.parametrize("variant", [*VARIANTS, "fp8"])
def test_transformers_loads_our_compressed_tensors_checkpoint_to_our_values(
        tmp_path: Path, float_dir: Path, variant: str) -> None:
    """transformers' compressed-tensors integration, dequantizing on the CPU (pack-quantized
    integers, float-quantized FP8): the same weights as our reader, and the same logits as our
    model on them, dequantized or kept packed (the native kernels)."""
    from transformers import CompressedTensorsConfig

    source = tensors(float_dir)
    weights = fp8(source) if variant == "fp8" else rtn(source, *VARIANTS[variant])
    write_checkpoint(tmp_path, hf_config(float_dir), source, weights, float_dir)
    with warnings.catch_warnings():  # "quantization_config given twice": dequantize is ours
        warnings.simplefilter("ignore", UserWarning)
        hf = AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(dequantize=True))
    reader = QuantizedSafetensors(tmp_path)
    loaded = hf.state_dict()
    for name in reader.quantized:
        assert torch.equal(loaded[name].float(), reader[name]), name
    model = DecoderModel(reader.config).eval()
    model.load_hf_state_dict(reader)
    packed = load_model(str(tmp_path))
    assert packed.packed_types() == [next(iter(weights.values())).types[0]]
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0]
    for ours in (model, packed.model):
        assert (causal_logits(ours, IDS) - want).abs().max().item() < 1e-4


@needs_compressed_tensors
@pytest.mark.parametrize("variant", VARIANTS)
def test_compressed_tensors_decompresses_our_checkpoint_to_our_values(
        tmp_path: Path, float_dir: Path, variant: str) -> None:
    """Our config parsed by compressed-tensors' own QuantizationConfig, each linear
    decompressed by its own compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    bits, group, symmetric = VARIANTS[variant]
    weights = random_int_weights(tensors(float_dir), bits, group, symmetric=symmetric)
    write_checkpoint(tmp_path, hf_config(float_dir), tensors(float_dir), weights,
                     scale_dtype=torch.float16)
    config = QuantizationConfig.model_validate(hf_config(tmp_path)["quantization_config"])
    scheme = config.config_groups["group_0"]
    assert scheme.format == "pack-quantized" and config.ignore == ["lm_head"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    stored, reader = tensors(tmp_path), QuantizedSafetensors(tmp_path)
    for name in weights:
        module = name.removesuffix(".weight")
        state = {k.removeprefix(f"{module}."): v for k, v in stored.items()
                 if k.startswith(f"{module}.")}
        theirs = compressor.decompress(state, scheme)["weight"]
        # It multiplies in the scales' float16: our exact float32 product, rounded once.
        assert theirs.dtype == torch.float16
        assert torch.equal(theirs, reader[name].half()), name


@needs_compressed_tensors
def test_our_fp8_checkpoint_is_llm_compressors_fp8_dynamic(tmp_path: Path,
                                                          float_dir: Path) -> None:
    """The config group is the FP8_DYNAMIC preset field for field, compressed-tensors' own
    QuantizationConfig parses it, and its float-quantized compressor decompresses each linear
    to our reader's values (float32 scales: to the bit)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    write_checkpoint(tmp_path, hf_config(float_dir), tensors(float_dir), fp8(tensors(float_dir)))
    written = hf_config(tmp_path)["quantization_config"]
    group = written["config_groups"]["group_0"]
    preset = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    assert group["weights"] == preset.weights.model_dump()
    assert group["input_activations"] == preset.input_activations.model_dump()
    assert (written["format"], group["format"], written["ignore"]) == (
        "float-quantized", "float-quantized", ["lm_head"])
    scheme = QuantizationConfig.model_validate(written).config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    stored, reader = tensors(tmp_path), QuantizedSafetensors(tmp_path)
    assert stored[f"{Q_PROJ}.weight"].dtype == torch.float8_e4m3fn
    assert stored[f"{Q_PROJ}.weight_scale"].shape == (64, 1)
    for name in reader.quantized:
        module = name.removesuffix(".weight")
        state = {k.removeprefix(f"{module}."): v for k, v in stored.items()
                 if k.startswith(f"{module}.")}
        assert torch.equal(compressor.decompress(state, scheme)["weight"], reader[name]), name


def test_fp8_weights_go_only_into_float_quantized(tmp_path: Path, float_dir: Path) -> None:
    source = tensors(float_dir)
    weights = fp8(source)
    for options, match in [
        ({"format": "gptq"}, "checkpoint format 'gptq' holds integers; FP8 weights are written "
         r"compressed-tensors \(float-quantized\)"),
        ({"format": "awq"}, "checkpoint format 'awq' holds integers"),
        ({"scale_dtype": torch.bfloat16}, "FP8 weights are symmetric, with the float32 scales"),
        ({"symmetric": False}, "FP8 weights are symmetric"),
    ]:
        with pytest.raises(ValueError, match=match):
            write_checkpoint(tmp_path, hf_config(float_dir), source, weights, **options)
    mixed = {**weights, "model.layers.1.mlp.down_proj.weight": IntWeight.quantize(
        source["model.layers.1.mlp.down_proj.weight"], 8)}
    with pytest.raises(ValueError, match="down_proj.weight: integer and FP8 linears mixed"):
        write_checkpoint(tmp_path, hf_config(float_dir), source, mixed)


def test_gptq_and_awq_configs_parse_as_transformers_configs(tmp_path: Path,
                                                            float_dir: Path) -> None:
    source = tensors(float_dir)
    weights = random_int_weights(source, 4, 32, symmetric=True, act_order=True)
    write_checkpoint(tmp_path / "gptq", hf_config(float_dir), source, weights, format="gptq")
    gptq = GPTQConfig.from_dict(hf_config(tmp_path / "gptq")["quantization_config"])
    assert (gptq.bits, gptq.group_size, gptq.desc_act, gptq.sym, gptq.format) == (
        4, 32, True, True, "gptq")
    partial = {n: w for n, w in random_int_weights(source, 4, 64, symmetric=False).items()
               if ".mlp." in n}
    write_checkpoint(tmp_path / "awq", hf_config(float_dir), source, partial, format="awq")
    awq = AwqConfig.from_dict(hf_config(tmp_path / "awq")["quantization_config"])
    assert (awq.bits, awq.group_size, awq.zero_point, awq.format) == (4, 64, True, "gemm")
    assert sorted(awq.modules_to_not_convert) == [f"model.layers.{i}.self_attn.{p}_proj"
                                                  for i in (0, 1) for p in "koqv"]
    reader = QuantizedSafetensors(tmp_path / "awq")
    assert set(reader.quantized) == set(partial)  # the attention stays float, as given
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(reader[name], source[name])


class SavedTokenizer:
    def __init__(self) -> None:
        self.saved_to: list[Path] = []

    def save(self, model_dir: Path) -> None:
        self.saved_to.append(model_dir)
        (model_dir / "tokenizer.json").write_text("{}")


def test_a_config_of_our_own_shape_reads_back_in_tidegate_and_transformers(
        tmp_path: Path, float_dir: Path) -> None:
    """A source without config.json (a GGUF): config.json is built from the ModelConfig,
    Llama-3 rope scaling included, and the tokenizer saves itself beside it."""
    ours = ModelConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=256,
                       rope_scaling=Llama3Scaling(8.0, 1.0, 4.0, 32))
    source = tensors(float_dir)
    tokenizer = SavedTokenizer()
    written = write_checkpoint(tmp_path, ours, source, rtn(source, 8, None, True), tokenizer)
    assert hf_model_config(tmp_path)[1] == ours
    assert tokenizer.saved_to == [tmp_path]
    assert written == sum(f.stat().st_size for f in tmp_path.iterdir())
    theirs = AutoConfig.from_pretrained(tmp_path)
    assert theirs.rope_parameters["rope_type"] == "llama3"
    assert theirs.rope_parameters["rope_theta"] == 500000.0
    assert (theirs.num_key_value_heads, theirs.head_dim) == (2, 16)


def test_a_tied_model_writes_no_lm_head_and_ignores_it(tmp_path: Path) -> None:
    hf = tiny_hf_model(tied=True)
    source = write_hf_dir(hf, tmp_path / "float")
    state = hf.state_dict()  # holds lm_head.weight, tied to the embedding
    write_checkpoint(tmp_path / "q", hf_config(source), state, rtn(state, 4, 32, False), source)
    assert "lm_head.weight" not in tensors(tmp_path / "q")
    assert hf_config(tmp_path / "q")["quantization_config"]["ignore"] == ["lm_head"]
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    assert QuantizedSafetensors(tmp_path / "q").config.tie_word_embeddings


@pytest.mark.parametrize(("fmt", "weights", "options", "match"), [
    ("gptq", dict(bits=4, group=32, symmetric=False), {},
     "GPTQ v1 stores zero - 1, so a zero point of 0 cannot be written"),
    ("compressed-tensors", dict(bits=4, group=32, symmetric=True, act_order=True), {},
     "compressed-tensors 0.20 stores no act-order column order"),
    ("awq", dict(bits=8, group=32, symmetric=True), {}, "AWQ GEMM stores 4-bit weights"),
    ("awq", dict(bits=4, group=None, symmetric=True), {}, "in groups"),
    ("awq", dict(bits=4, group=32, symmetric=True, act_order=True), {}, "AWQ has no act-order"),
    ("gptq", dict(bits=4, group=32, symmetric=True, act_order=True), {"desc_act": False},
     "act-order weights \\(perm\\) need desc_act"),
    ("compressed-tensors", dict(bits=4, group=32, symmetric=False), {"symmetric": True},
     "symmetric weights have every zero point at 8"),
    ("gptq", dict(bits=4, group=32, symmetric=True), {"gptq_format": "marlin"},
     "GPTQ checkpoint_format 'marlin'"),
    ("exl2", dict(bits=4, group=32, symmetric=True), {}, "checkpoint format 'exl2'"),
])
def test_what_a_format_cannot_hold_is_refused(tmp_path: Path, float_dir: Path, fmt: str,
                                              weights: dict[str, Any], options: dict[str, Any],
                                              match: str) -> None:
    source = tensors(float_dir)
    ints = random_int_weights(source, weights["bits"], weights["group"],
                              symmetric=weights["symmetric"],
                              act_order=weights.get("act_order", False))
    with pytest.raises(ValueError, match=match):
        write_checkpoint(tmp_path, hf_config(float_dir), source, ints, format=fmt, **options)


def test_mixed_layouts_and_partial_gptq_are_refused(tmp_path: Path, float_dir: Path) -> None:
    source = tensors(float_dir)
    four, eight = (random_int_weights(source, b, 32, symmetric=True) for b in (4, 8))
    mixed = {**four, "model.layers.1.mlp.down_proj.weight":
             eight["model.layers.1.mlp.down_proj.weight"]}
    with pytest.raises(ValueError, match=r"linears differ in bits \(\[4, 8\]\)"):
        write_checkpoint(tmp_path, hf_config(float_dir), source, mixed)
    del four["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.0.self_attn.v_proj is not quantized"):
        write_checkpoint(tmp_path, hf_config(float_dir), source, four, format="gptq")
    embed = {"model.embed_tokens.weight": IntWeight.quantize(source["model.embed_tokens.weight"],
                                                             8)}
    with pytest.raises(ValueError, match="model.embed_tokens.weight: only linears"):
        write_checkpoint(tmp_path, hf_config(float_dir), source, embed)
