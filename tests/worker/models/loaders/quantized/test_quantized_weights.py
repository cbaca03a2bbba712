"""The quantized-checkpoint reader against each format's own definition: tiny checkpoints in
every variant (written by our writer, by hand, or by compressed-tensors itself) read back and
compared, value for value, with the dequantization of ``tests/worker/quantized_checkpoints.py``,
which unpacks the int32 words independently of the reader."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.worker.compressed_tensors_oracle import (
    decompress_with_compressed_tensors,
    needs_compressed_tensors,
    write_with_compressed_tensors,
)
from tests.worker.hf_oracle import causal_logits
from tests.worker.quantized_checkpoints import (
    Tiny,
    awq_dequantize,
    compressed_tensors_dequantize,
    edit_config,
    edit_tensors,
    gptq_dequantize,
    linear_names,
    random_int_weights,
    refused,
    stored,
    tiny_checkpoint,
    with_scales_as,
)
from tests.worker.tiny_checkpoints import tiny_hf_model
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.worker.models.decoder import DecoderModel
from tidegate.worker.models.loaders.quantized.quantized_safetensors import (
    QuantizedSafetensors,
    quantization_config,
)
from tidegate.worker.quantization.checkpoint_writer import write_checkpoint

IDS = [256, *range(40, 100, 3), 97, 98, 99, 10, 32, 200, 255]
Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return tiny_checkpoint(tmp_path_factory.mktemp("float"))


def write(path: Path, tiny: Tiny, weights: dict[str, IntWeight], fmt: str,
          **options: Any) -> QuantizedSafetensors:
    write_checkpoint(path, tiny.config, tiny.tensors, weights, tiny.dir, format=fmt, **options)
    return QuantizedSafetensors(path)


def check_all(reader: QuantizedSafetensors, weights: dict[str, IntWeight],
              reference: Callable[[str], torch.Tensor], scale_dtype: torch.dtype) -> None:
    """Every linear reads as the format's definition says and as the integers written."""
    assert set(reader.quantized) == set(weights)
    for name, weight in weights.items():
        got = reader.quantized_weight(name)
        assert got is not None and got.bits == weight.bits
        values = got.dequantize()
        assert torch.equal(values, reference(name.removesuffix(".weight"))), name
        assert torch.equal(values, with_scales_as(weight, scale_dtype).dequantize()), name


GPTQ = [(bits, group, act, sym) for bits in (4, 8) for group in (32, None)
        for act in (False, True) for sym in (True, False)]


@pytest.mark.parametrize(("bits", "group", "act_order", "symmetric"), GPTQ, ids=[
    f"int{b}-g{g or -1}-{'act' if a else 'noact'}-{'sym' if s else 'asym'}" for b, g, a, s in GPTQ])
def test_gptq_v1_reads_as_its_definition(tmp_path: Path, tiny: Tiny, bits: int,
                                         group: int | None, act_order: bool,
                                         symmetric: bool) -> None:
    weights = random_int_weights(tiny.tensors, bits, group, symmetric=symmetric,
                                 act_order=act_order, lowest_zero=1)  # v1 cannot store zero 0
    reader = write(tmp_path, tiny, weights, "gptq")
    t = stored(tmp_path)
    config = reader.quantization
    assert (config["bits"], config["group_size"], config["desc_act"], config["sym"]) == (
        bits, group or -1, act_order, symmetric)
    check_all(reader, weights, lambda m: gptq_dequantize(t, m, bits), torch.float16)
    got = reader.quantized_weight(f"{Q_PROJ}.weight")
    assert got is not None and got.format == "gptq"
    assert got.group_size == (group or 64)
    g_idx = t[f"{Q_PROJ}.g_idx"]
    in_order = torch.equal(g_idx, torch.arange(64, dtype=torch.int32) // (group or 64))
    assert in_order == (not act_order or group is None)  # act-order really reorders groups
    assert (got.perm is not None) == (act_order and group is not None)
    if symmetric:  # v1 stores zero - 1: 7 or 127 in every field
        assert int(t[f"{Q_PROJ}.qzeros"][0, 0]) == (0x77777777 if bits == 4 else 0x7F7F7F7F)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_v2_stores_the_zero_itself(tmp_path: Path, tiny: Tiny, act_order: bool) -> None:
    weights = random_int_weights(tiny.tensors, 4, 32, symmetric=False, act_order=act_order)
    assert any(int(w.zeros.min()) == 0 for w in weights.values())
    reader = write(tmp_path, tiny, weights, "gptq", gptq_format="gptq_v2")
    t = stored(tmp_path)
    assert reader.quantization["checkpoint_format"] == "gptq_v2"
    check_all(reader, weights, lambda m: gptq_dequantize(t, m, 4, v1=False), torch.float16)


def test_gptq_dynamic_rules_override_bits_per_module(tmp_path: Path, tiny: Tiny) -> None:
    """GPTQModel's ``dynamic``: layer 1 in 8 bits, channel-wise, the rest 4-bit g32."""
    four = random_int_weights(tiny.tensors, 4, 32, symmetric=True, lowest_zero=1)
    eight = random_int_weights(tiny.tensors, 8, None, symmetric=False, lowest_zero=1, seed=1)
    layer1 = [n for n in four if n.startswith("model.layers.1.")]
    write_checkpoint(tmp_path / "a", tiny.config, tiny.tensors, four, format="gptq")
    write_checkpoint(tmp_path / "b", tiny.config, tiny.tensors, eight, format="gptq")
    mixed = {**stored(tmp_path / "a"),
             **{k: v for k, v in stored(tmp_path / "b").items() if k.startswith("model.layers.1.")}}
    save_file(mixed, tmp_path / "a" / "model.safetensors")
    edit_config(tmp_path / "a", dynamic={r"+:model\.layers\.1\.": {"bits": 8, "group_size": -1}})
    reader = QuantizedSafetensors(tmp_path / "a")
    for name in layer1:
        got = reader.quantized_weight(name)
        assert got is not None and (got.bits, got.group_size) == (8, tiny.tensors[name].shape[1])
        assert torch.equal(got.dequantize(),
                           gptq_dequantize(mixed, name.removesuffix(".weight"), 8))
    first = reader.quantized_weight(f"{Q_PROJ}.weight")
    assert first is not None and (first.bits, first.group_size) == (4, 32)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("symmetric", [False, True], ids=["zero_point", "no-zero_point"])
def test_awq_gemm_reads_as_its_definition(tmp_path: Path, tiny: Tiny, group: int,
                                          symmetric: bool) -> None:
    weights = random_int_weights(tiny.tensors, 4, group, symmetric=symmetric)
    reader = write(tmp_path, tiny, weights, "awq")
    t = stored(tmp_path)
    assert reader.quantization["zero_point"] is (not symmetric)
    assert reader.quantization["version"] == "gemm"
    check_all(reader, weights, lambda m: awq_dequantize(t, m), torch.float16)
    got = reader.quantized_weight(f"{Q_PROJ}.weight")
    assert got is not None and got.format == "awq" and got.group_size == group


def test_awq_without_zero_point_or_qzeros_has_zero_eight(tmp_path: Path, tiny: Tiny) -> None:
    weights = random_int_weights(tiny.tensors, 4, 32, symmetric=True)
    write(tmp_path, tiny, weights, "awq")
    t = {k: v for k, v in stored(tmp_path).items() if not k.endswith(".qzeros")}
    save_file(t, tmp_path / "model.safetensors")
    got = QuantizedSafetensors(tmp_path).quantized_weight(f"{Q_PROJ}.weight")
    assert got is not None and torch.all(got.zeros == 8)
    assert torch.equal(got.dequantize(),
                       with_scales_as(weights[f"{Q_PROJ}.weight"], torch.float16).dequantize())


CT = [(bits, group, sym) for bits in (4, 8) for group in (32, None) for sym in (True, False)]


@pytest.mark.parametrize(("bits", "group", "symmetric"), CT, ids=[
    f"int{b}-{'g' + str(g) if g else 'channel'}-{'sym' if s else 'asym'}" for b, g, s in CT])
def test_compressed_tensors_pack_quantized_reads_as_its_definition(
        tmp_path: Path, tiny: Tiny, bits: int, group: int | None, symmetric: bool) -> None:
    weights = random_int_weights(tiny.tensors, bits, group, symmetric=symmetric, lm_head=True)
    reader = write(tmp_path, tiny, weights, "compressed-tensors", scale_dtype=torch.bfloat16)
    t = stored(tmp_path)
    scheme = reader.quantization["config_groups"]["group_0"]["weights"]
    assert (scheme["num_bits"], scheme["group_size"], scheme["symmetric"]) == (
        bits, group, symmetric)
    assert reader.quantization["ignore"] == []  # lm_head is quantized too
    check_all(reader, weights, lambda m: compressed_tensors_dequantize(t, m, bits, symmetric),
              torch.bfloat16)
    assert (f"{Q_PROJ}.weight_zero_point" in t) is (not symmetric)


def test_compressed_tensors_older_unpacked_zero_points_and_g_idx(tmp_path: Path,
                                                                 tiny: Tiny) -> None:
    """Files from before 0.20: signed int8 zero points [N, K/G], and actorder 'group' with a
    ``weight_g_idx`` (weights in input column order, groups scattered)."""
    weights = random_int_weights(tiny.tensors, 4, 32, symmetric=False)
    write(tmp_path, tiny, weights, "compressed-tensors")
    t = stored(tmp_path)
    gen = torch.Generator().manual_seed(3)
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        t[f"{module}.weight_zero_point"] = (weight.zeros.to(torch.int32) - 8).to(torch.int8)
        k = weight.shape[1]
        t[f"{module}.weight_g_idx"] = (torch.randperm(k, generator=gen) // 32).to(torch.int32)
    save_file(t, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    edit_config(tmp_path, config_groups=config["config_groups"])
    reader = QuantizedSafetensors(tmp_path)
    for name in weights:
        got = reader.quantized_weight(name)
        assert got is not None and got.perm is not None
        assert torch.equal(got.dequantize(), compressed_tensors_dequantize(
            t, name.removesuffix(".weight"), 4, symmetric=False))


def write_int_quantized(path: Path, tiny: Tiny, *, symmetric: bool) -> dict[str, IntWeight]:
    """A W8A8 INT8 checkpoint as compressed-tensors' int-quantized format stores it: signed
    int8 weights, a scale per output channel, dynamic per-token int8 activations."""
    weights = {n: IntWeight.quantize(tiny.tensors[n], 8, None, symmetric)
               for n in linear_names(tiny.tensors)}
    t = {n: v for n, v in tiny.tensors.items() if n not in weights}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        t[f"{module}.weight"] = (w.ints() - 128).to(torch.int8)
        t[f"{module}.weight_scale"] = w.scales.clone()
        if not symmetric:
            t[f"{module}.weight_zero_point"] = (w.zeros.to(torch.int32) - 128).to(torch.int8)
    path.mkdir()
    save_file(t, path / "model.safetensors")
    scheme = {"targets": ["Linear"], "format": "int-quantized", "output_activations": None,
              "weights": {"num_bits": 8, "type": "int", "symmetric": symmetric,
                          "strategy": "channel", "group_size": None, "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                    "strategy": "token", "dynamic": True}}
    config = {**tiny.config, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "config_groups": {"group_0": scheme},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
        "transform_config": {}}}
    (path / "config.json").write_text(json.dumps(config))
    return weights


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_compressed_tensors_int_quantized_is_served_as_8_bit_weights(
        tmp_path: Path, tiny: Tiny, symmetric: bool) -> None:
    weights = write_int_quantized(tmp_path / "m", tiny, symmetric=symmetric)
    reader = QuantizedSafetensors(tmp_path / "m")
    t = stored(tmp_path / "m")
    check_all(reader, weights, lambda m: compressed_tensors_dequantize(t, m, 8, symmetric),
              torch.float32)
    if symmetric:
        got = reader.quantized_weight(f"{Q_PROJ}.weight")
        assert got is not None and torch.all(got.zeros == 128)


def test_the_mapping_serves_plain_tensors_and_dequantized_linears(tmp_path: Path,
                                                                  tiny: Tiny) -> None:
    weights = random_int_weights(tiny.tensors, 4, 32, symmetric=False)
    reader = write(tmp_path, tiny, weights, "compressed-tensors")
    names = set(reader)
    assert names == set(tiny.tensors) and len(reader) == len(tiny.tensors)
    assert f"{Q_PROJ}.weight" in reader and f"{Q_PROJ}.weight_packed" not in reader
    with pytest.raises(KeyError):
        reader[f"{Q_PROJ}.weight_scale"]
    assert torch.equal(reader[f"{Q_PROJ}.weight"], weights[f"{Q_PROJ}.weight"].dequantize())
    assert reader.quantized_weight("lm_head.weight") is None  # in the ignore list: float
    assert torch.equal(reader["lm_head.weight"], tiny.tensors["lm_head.weight"])
    assert reader.quantized_weight("model.norm.weight") is None
    assert quantization_config(tmp_path) == reader.quantization
    assert quantization_config(tiny.dir) is None


def test_autogptq_quantize_config_json_beside_config_is_read(tmp_path: Path,
                                                            tiny: Tiny) -> None:
    """Older AutoGPTQ checkpoints keep their settings in quantize_config.json only."""
    weights = random_int_weights(tiny.tensors, 8, 32, symmetric=False, lowest_zero=1)
    write(tmp_path, tiny, weights, "gptq")
    config = json.loads((tmp_path / "config.json").read_text())
    gptq = config.pop("quantization_config")
    del gptq["quant_method"]
    (tmp_path / "quantize_config.json").write_text(json.dumps(gptq))
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert quantization_config(tmp_path) == {"quant_method": "gptq", **gptq}
    reader = QuantizedSafetensors(tmp_path)
    t = stored(tmp_path)
    check_all(reader, weights, lambda m: gptq_dequantize(t, m, 8), torch.float16)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_a_model_of_the_dequantized_weights_matches_transformers(tmp_path: Path, tiny: Tiny,
                                                                 fmt: str) -> None:
    """The whole model through ``load_hf_state_dict``, against transformers running the same
    weights as the format's definition dequantizes them."""
    weights = {n: IntWeight.quantize(tiny.tensors[n], 4, 32, symmetric=False)
               for n in linear_names(tiny.tensors)}
    reader = write(tmp_path, tiny, weights, fmt)
    t = stored(tmp_path)
    reference = {"gptq": lambda m: gptq_dequantize(t, m, 4), "awq": lambda m: awq_dequantize(t, m),
                 "compressed-tensors": lambda m: compressed_tensors_dequantize(t, m, 4, False)}
    hf = tiny_hf_model(tied=False)
    with torch.no_grad():
        for name in weights:
            hf.get_parameter(name).copy_(reference[fmt](name.removesuffix(".weight")))
        want = hf(torch.tensor([IDS])).logits[0]
    model = DecoderModel(reader.config).eval()
    model.load_hf_state_dict(reader)
    assert (causal_logits(model, IDS) - want).abs().max().item() < 1e-4


# --- compressed-tensors' own checkpoints --------------------------------------------------

INT8_TOKENS = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
OWN = {
    "w4a16-g32-asym": (dict(num_bits=4, symmetric=False, strategy="group", group_size=32),
                       None, "pack-quantized"),
    "w4a16-channel-sym": (dict(num_bits=4, symmetric=True, strategy="channel"), None,
                          "pack-quantized"),
    "w8a16-g32-sym": (dict(num_bits=8, symmetric=True, strategy="group", group_size=32), None,
                      "pack-quantized"),
    "w8a8-int-quantized": (dict(num_bits=8, symmetric=True, strategy="channel"), INT8_TOKENS,
                           "int-quantized"),
}


@needs_compressed_tensors
@pytest.mark.parametrize("variant", OWN)
def test_a_checkpoint_compressed_tensors_wrote_reads_as_it_decompresses(
        tmp_path: Path, variant: str) -> None:
    weights, inputs, fmt = OWN[variant]
    write_with_compressed_tensors(tmp_path, {"weights": weights, "input_activations": inputs})
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"][
        "format"] == fmt
    reader = QuantizedSafetensors(tmp_path)
    assert len(reader.quantized) == 14 and "lm_head.weight" not in reader.quantized
    t = stored(tmp_path)
    for name in reader.quantized:
        module = name.removesuffix(".weight")
        got = reader.quantized_weight(name)
        assert got is not None
        assert torch.equal(got.dequantize(), decompress_with_compressed_tensors(tmp_path, module))
        assert torch.equal(got.dequantize(), compressed_tensors_dequantize(
            t, module, weights["num_bits"], weights["symmetric"]))


# --- refusals --------------------------------------------------------------------------------

@pytest.fixture
def gptq_dir(tmp_path: Path, tiny: Tiny) -> Path:
    write(tmp_path, tiny, random_int_weights(tiny.tensors, 4, 32, symmetric=True), "gptq")
    return tmp_path


@pytest.fixture
def ct_dir(tmp_path: Path, tiny: Tiny) -> Path:
    write(tmp_path, tiny, random_int_weights(tiny.tensors, 4, 32, symmetric=False),
          "compressed-tensors")
    return tmp_path


@pytest.mark.parametrize("bits", [2, 3, 16])
def test_gptq_bits_other_than_4_and_8_are_refused(gptq_dir: Path, bits: int) -> None:
    edit_config(gptq_dir, bits=bits)
    refused(gptq_dir, rf"config.json: GPTQ quantization_config.bits {bits} is not supported")


@pytest.mark.parametrize("stored_as", ["marlin", "bitblas"])
def test_gptq_checkpoint_formats_we_do_not_read_are_refused(gptq_dir: Path,
                                                            stored_as: str) -> None:
    edit_config(gptq_dir, checkpoint_format=stored_as, format=stored_as)
    refused(gptq_dir, rf"GPTQ checkpoint_format '{stored_as}' is not supported")


@pytest.mark.parametrize("version", ["gemv", "gemv_fast", "marlin", "exllama"])
def test_awq_versions_other_than_gemm_are_refused(tmp_path: Path, tiny: Tiny,
                                                  version: str) -> None:
    write(tmp_path, tiny, random_int_weights(tiny.tensors, 4, 32, symmetric=False), "awq")
    edit_config(tmp_path, version=version)
    refused(tmp_path, rf"AWQ version '{version}' is not supported \(gemm\)")


@pytest.mark.parametrize("fmt", ["nvfp4-pack-quantized", "mxfp4-pack-quantized", "marlin-24",
                                 "mixed-precision"])
def test_compressed_tensors_formats_we_do_not_read_are_refused(ct_dir: Path, fmt: str) -> None:
    config = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    del config["config_groups"]["group_0"]["format"]
    edit_config(ct_dir, format=fmt, config_groups=config["config_groups"])
    refused(ct_dir, rf"config_groups.group_0: format '{fmt}' is not supported")


@pytest.mark.parametrize(("weights", "match"), [
    ({"type": "float", "num_bits": 8}, "float weights in format 'pack-quantized' are not "
     "supported"),
    ({"type": "mx"}, r"type 'mx' is not supported \(int, float\)"),
    ({"dynamic": True}, "dynamic weight quantization is not supported"),
    ({"strategy": "block", "block_structure": [32, 32]}, "strategy 'block' is not supported"),
    ({"num_bits": 2}, r"num_bits 2 is not supported \(4, 8\)"),
    ({"actorder": "sideways"}, "actorder 'sideways' is not supported"),
])
def test_compressed_tensors_weight_schemes_we_cannot_honour_are_refused(
        ct_dir: Path, weights: dict[str, Any], match: str) -> None:
    config = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"]["weights"].update(weights)
    edit_config(ct_dir, config_groups=config["config_groups"])
    refused(ct_dir, rf"config_groups.group_0.weights \(pack-quantized\): {match}")


@pytest.mark.parametrize(("changes", "match"), [
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme is not supported"),
    ({"transform_config": {"config_groups": {"r1": {}}}}, "transform_config"),
    ({"quantization_status": "frozen"}, "quantization_status 'frozen' is not supported"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity format"),
])
def test_compressed_tensors_extras_we_cannot_honour_are_refused(
        ct_dir: Path, changes: dict[str, Any], match: str) -> None:
    edit_config(ct_dir, **changes)
    refused(ct_dir, match)


def test_compressed_tensors_fp8_activations_are_refused(ct_dir: Path) -> None:
    config = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    edit_config(ct_dir, config_groups=config["config_groups"])
    refused(ct_dir, r"float input_activations with int weights \(W4AFP8\) are not supported")


@pytest.mark.parametrize("method", ["bitsandbytes", "fbgemm_fp8", "hqq"])
def test_other_quant_methods_are_refused(ct_dir: Path, method: str) -> None:
    edit_config(ct_dir, quant_method=method)
    refused(ct_dir, rf"quant_method '{method}' is not supported \(gptq, awq, compressed-tensors, "
                    r"fp8\)")


def test_a_tensor_of_the_wrong_shape_is_named(gptq_dir: Path) -> None:
    name = f"{Q_PROJ}.qweight"
    edit_tensors(gptq_dir, lambda t: t.update({name: t[name][:4]}))
    refused(gptq_dir, rf"tensor {name} \(gptq\) has shape \[4, 64\], expected \[8, 64\]")


def test_a_tensor_of_the_wrong_dtype_is_named(ct_dir: Path) -> None:
    name = f"{Q_PROJ}.weight_scale"
    edit_tensors(ct_dir, lambda t: t.update({name: t[name].to(torch.int32)}))
    refused(ct_dir, rf"tensor {name} \(compressed-tensors\) is int32, expected float16")


def test_a_missing_tensor_is_named(gptq_dir: Path) -> None:
    name = "model.layers.1.mlp.down_proj.qzeros"
    edit_tensors(gptq_dir, lambda t: t.pop(name))
    refused(gptq_dir, rf"tensor {name} \(gptq\) is missing")


def test_a_weight_shape_that_disagrees_is_named(ct_dir: Path) -> None:
    name = f"{Q_PROJ}.weight_shape"
    edit_tensors(ct_dir, lambda t: t.update({name: torch.tensor([64, 32])}))
    refused(ct_dir, r"q_proj \(pack-quantized\): weight_shape \[64, 32\], expected \[64, 64\]")


def test_a_gptq_v1_zero_point_of_zero_is_refused(gptq_dir: Path) -> None:
    name = f"{Q_PROJ}.qzeros"
    edit_tensors(gptq_dir, lambda t: t[name].__setitem__((0, 0), 0x7777777F))
    refused(gptq_dir, rf"tensor {name} \(gptq v1\) holds a zero point of 0")


def test_a_g_idx_with_uneven_groups_is_refused(gptq_dir: Path) -> None:
    name = f"{Q_PROJ}.g_idx"
    edit_tensors(gptq_dir, lambda t: t[name].__setitem__(0, 1))
    refused(gptq_dir, rf"tensor {name} \(gptq\) does not put 32 columns in each group")


def test_a_quantized_module_that_is_no_linear_is_named(gptq_dir: Path) -> None:
    edit_tensors(gptq_dir, lambda t: t.update({
        "model.embed_tokens.qweight": torch.zeros(8, 260, dtype=torch.int32)}))
    refused(gptq_dir, r"tensor model.embed_tokens.qweight \(gptq\) is not a linear")


def test_a_linear_the_config_quantizes_but_the_file_keeps_float_is_named(ct_dir: Path) -> None:
    edit_config(ct_dir, ignore=[])
    refused(ct_dir, r"tensor lm_head.weight_packed \(pack-quantized\) is missing: the config "
                    "quantizes lm_head")
