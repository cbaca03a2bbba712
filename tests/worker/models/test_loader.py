from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from tests.worker.hf_oracle import causal_logits
from tests.worker.tiny_checkpoints import (
    LLAMA3_ROPE,
    llama_cpp_permute,
    tiny_hf_model,
    write_gguf,
    write_hf_dir,
)
from tidegate.kernels.reference.rotary import Llama3Scaling
from tidegate.model_files.model_source import ModelLoadError, preset_config
from tidegate.worker.models.loaders.gguf_weights import unpermute_qk
from tidegate.worker.models.loaders.loader import load_model
from tidegate.worker.models.packed_modules import PackedEmbedding, PackedLinear

# A sequence longer than the llama3 variant's original context (32), so scaled bands matter.
IDS = [256, *range(40, 120, 2), 97, 98, 99, 10, 32, 200, 255, 3, 4]
VARIANTS = {
    "untied": dict(tied=False),
    "tied": dict(tied=True),
    "llama3-rope": dict(tied=False, llama3_rope=True),
}


def hf_reference_logits(model: LlamaForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_directory_logits_match_transformers(tmp_path: Path, variant: str) -> None:
    hf = tiny_hf_model(**VARIANTS[variant])
    loaded = load_model(str(write_hf_dir(hf, tmp_path / variant)))
    assert loaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert loaded.source.kind == "hf"
    diff = (causal_logits(loaded.model, IDS) - hf_reference_logits(hf)).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_logits_match_transformers(tmp_path: Path, variant: str) -> None:
    """Through llama.cpp's layout: permuted q/k rows, rope_freqs, reversed dims, no output.weight
    when tied. Our loader must undo all of it."""
    hf = tiny_hf_model(**VARIANTS[variant])
    loaded = load_model(str(write_gguf(hf, tmp_path / f"{variant}.gguf")))
    assert loaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    diff = (causal_logits(loaded.model, IDS) - hf_reference_logits(hf)).abs().max().item()
    assert diff < 1e-4


def test_gguf_llama3_rope_freqs_become_the_scaling(tmp_path: Path) -> None:
    hf = tiny_hf_model(tied=False, llama3_rope=True)
    config = load_model(str(write_gguf(hf, tmp_path / "m.gguf"))).config
    assert config.rope_scaling == Llama3Scaling(
        LLAMA3_ROPE["factor"], LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"],
        LLAMA3_ROPE["original_max_position_embeddings"])


def test_hf_config_fields_are_read(tmp_path: Path) -> None:
    hf = tiny_hf_model(tied=False, llama3_rope=True)
    loaded = load_model(str(write_hf_dir(hf, tmp_path / "m")))
    cfg = loaded.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        260, 64, 128, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert loaded.tokenizer.bos_token_id == 256
    assert loaded.load_s > 0


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (8, 2):
        permuted = torch.from_numpy(llama_cpp_permute(weight, heads))
        assert torch.equal(unpermute_qk(permuted, heads), torch.from_numpy(weight))


def test_random_tiny_model_is_deterministic_and_finite() -> None:
    a = load_model("random:tiny", seed=1)
    b = load_model("random:tiny", seed=1)
    c = load_model("random:tiny", seed=2)
    wa, wb, wc = (m.model.layers[0].qkv_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert abs(wa.std().item() - 0.02) < 0.002
    assert torch.all(a.model.norm == 1)
    assert torch.isfinite(causal_logits(a.model, [1, 2, 3, 4])).all()
    assert a.source.name == "random:tiny" and a.config.vocab_size == 512


def test_random_model_is_built_in_the_requested_dtype() -> None:
    loaded = load_model("random:smollm2-135m", dtype=torch.bfloat16)
    params = list(loaded.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.device.type for p in params} == {"cpu"}
    assert loaded.model.rope_cache.dtype == torch.float32  # positions keep their precision
    assert sum(p.numel() for p in params) == loaded.config.num_params()
    assert loaded.config.num_params() == pytest.approx(134.5e6, rel=0.01)
    assert loaded.config.max_position_embeddings == preset_config("smollm2-135m")[
        "max_position_embeddings"]
    assert not loaded.model.training
    logits = causal_logits(loaded.model, list(range(16)))
    assert torch.isfinite(logits).all() and logits.abs().max() < 50


def test_bad_path_gives_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=rf"{tmp_path / 'missing'}.*does not exist"):
        load_model(str(tmp_path / "missing"))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = write_hf_dir(tiny_hf_model(tied=False), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{path}.*model.layers.1.mlp.down_proj.weight"):
        load_model(str(path))


def test_unsupported_rope_type_is_refused(tmp_path: Path) -> None:
    path = write_hf_dir(tiny_hf_model(tied=False), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "proportional", "factor": 4.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config.json: rope_type 'proportional' is not supported"):
        load_model(str(path))


QUANTIZED = {name: dict(qtype=GGMLQuantizationType[name])
             for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16")}
# As llama.cpp's mixed files (Q4_K_M): v and down in a wider type than q, k, gate, up.
QUANTIZED["mixed"] = dict(qtype=GGMLQuantizationType.Q4_0, qtypes={
    "attn_v": GGMLQuantizationType.Q8_0, "ffn_down": GGMLQuantizationType.Q5_1,
    "token_embd": GGMLQuantizationType.Q8_0})


@pytest.mark.parametrize("kind", QUANTIZED)
def test_quantized_gguf_stays_packed_and_computes_its_dequantized_model(
        tmp_path: Path, kind: str) -> None:
    path = write_gguf(tiny_hf_model(tied=kind == "mixed"), tmp_path / f"{kind}.gguf",
                      **QUANTIZED[kind])
    packed = load_model(str(path), cpu_activations="float")
    dequantized = load_model(str(path), packed=False)
    layer = packed.model.layers[1]
    assert isinstance(layer.qkv_proj, PackedLinear) and isinstance(layer.down_proj, PackedLinear)
    assert isinstance(packed.model.embed_tokens, PackedEmbedding)
    assert not packed.packed_types() == dequantized.packed_types() == []
    if kind == "mixed":
        assert layer.qkv_proj.weight.types == ("Q4_0", "Q8_0")  # q+k, then v
        assert packed.packed_types() == ["Q4_0", "Q8_0", "Q5_1"]
    assert packed.weight_bytes() < dequantized.weight_bytes() * (0.6 if kind != "mixed" else 0.5)
    want = causal_logits(dequantized.model, IDS)
    got = causal_logits(packed.model, IDS)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_a_quantized_gguf_still_matches_transformers_closely(tmp_path: Path) -> None:
    """Q8_0 keeps each weight within half a percent: the packed model is still the HF one."""
    hf = tiny_hf_model(tied=False)
    loaded = load_model(str(write_gguf(hf, tmp_path / "q8.gguf",
                                       qtype=GGMLQuantizationType.Q8_0)))
    want = hf_reference_logits(hf)
    assert (causal_logits(loaded.model, IDS) - want).abs().max().item() < 0.05 * want.abs().max()


def test_a_type_without_a_packed_kernel_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tiny_hf_model(tied=False), tmp_path / "m.gguf",
                      qtype=GGMLQuantizationType.Q4_0,
                      qtypes={"attn_q": GGMLQuantizationType.MXFP4})
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_q\.weight is MXFP4, which "
                                             r"the packed kernels do not compute"):
        load_model(str(path))
    assert load_model(str(path), packed=False).packed_types() == []  # dequantized, as asked


def test_packed_weights_are_refused_off_the_cpu_float32_path(tmp_path: Path) -> None:
    path = write_gguf(tiny_hf_model(tied=False), tmp_path / "m.gguf",
                      qtype=GGMLQuantizationType.Q8_0)
    with pytest.raises(ModelLoadError, match="packed weights run on the CPU in float32"):
        load_model(str(path), dtype=torch.bfloat16, packed=True)
    assert load_model(str(path), dtype=torch.bfloat16).packed_types() == []  # auto: dequantized


@pytest.mark.parametrize(("method", "types"), [("fp8", ["fp8-e4m3-channel"]),
                                               ("rtn-int8", ["int8-channel"]),
                                               ("rtn-int4", ["int4-channel", "int4-g64"])])
def test_quantize_at_load_rounds_every_projection(method: str, types: list[str]) -> None:
    """--quantize: the float model's projections rounded at load, the model still itself (the
    tiny preset's widths of 64 and 128 take 4-bit groups of 64: a whole row of the 64-wide)."""
    floats = load_model("random:tiny")
    loaded = load_model("random:tiny", quantize=method)
    assert loaded.packed_types() == types
    assert all(isinstance(getattr(layer, attr), PackedLinear) for layer in loaded.model.layers
               for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert isinstance(loaded.model.embed_tokens, torch.nn.Embedding)  # embeddings stay float
    assert loaded.weight_bytes() < floats.weight_bytes()
    want = causal_logits(floats.model, IDS)
    got = causal_logits(loaded.model, IDS)
    assert (got - want).norm() < (0.2 if method == "rtn-int4" else 0.05) * want.norm()


def test_quantize_at_load_refuses_what_it_cannot_round(tmp_path: Path) -> None:
    path = write_gguf(tiny_hf_model(tied=False), tmp_path / "m.gguf",
                      qtype=GGMLQuantizationType.Q8_0)
    with pytest.raises(ModelLoadError, match="quantized already .Q8_0.: --quantize fp8 takes a "
                                             "float model"):
        load_model(str(path), quantize="fp8")
    with pytest.raises(ModelLoadError, match="quantize 'int3'"):
        load_model("random:tiny", quantize="int3")
    with pytest.raises(ModelLoadError, match="run on CUDA, or on the CPU in float32"):
        load_model("random:tiny", dtype=torch.bfloat16, quantize="rtn-int8")


def test_an_unknown_cpu_activation_mode_is_refused_by_name() -> None:
    with pytest.raises(ModelLoadError, match="cpu_activations must be one of auto, float, int8"):
        load_model("random:tiny", cpu_activations="int4")


def test_loading_a_model_imports_neither_dynamo_nor_sympy() -> None:
    """A worker's start: building the model on the meta device must not reach torch's Python
    decompositions (meta ``normal_``/``arange``/``empty_like``), which import torch._dynamo and
    sympy, seconds of every worker's start."""
    code = ("import sys\n"
            "from tidegate.worker.models.loaders.loader import load_model\n"
            "for spec in ('random:tiny', 'smollm2'):\n"
            "    load_model(spec)\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
