"""Hub specs and the files that serve them, decided from a repository's file list alone:
parsing, llama.cpp's choice of GGUF file, the API's tokenizer-only subset and every refusal."""

from __future__ import annotations

import pytest

from tidegate.model_files.hub_spec import (
    HubSpec,
    HubSpecError,
    choose_files,
    parse_hub_spec,
    quant_label,
    shards_of_index,
)

LLAMA = {"config.json": 700, "generation_config.json": 100, "tokenizer.json": 9000,
         "tokenizer_config.json": 400, "special_tokens_map.json": 80, "README.md": 5000,
         ".gitattributes": 1500, "model-00001-of-00002.safetensors": 5 * 10**9,
         "model-00002-of-00002.safetensors": 10**9, "model.safetensors.index.json": 20000,
         "original/consolidated.00.pth": 6 * 10**9, "original/tokenizer.model": 2 * 10**6}
GGUF_REPO = {"README.md": 1, "Qwen2.5-0.5B-Instruct-Q4_0.gguf": 1, "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf": 1,
             "Qwen2.5-0.5B-Instruct-Q8_0.gguf": 1, "Qwen2.5-0.5B-Instruct-IQ4_XS.gguf": 1,
             "mmproj-Qwen2.5-F16.gguf": 1}


@pytest.mark.parametrize(("spec", "parsed"), [
    ("Qwen/Qwen2.5-7B-Instruct", ("Qwen/Qwen2.5-7B-Instruct", None, None, None)),
    ("meta-llama/Llama-3.1-8B@v1.0", ("meta-llama/Llama-3.1-8B", "v1.0", None, None)),
    ("org/name@0123456789abcdef0123456789abcdef01234567",
     ("org/name", "0123456789abcdef0123456789abcdef01234567", None, None)),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1", None, None)),
    ("bartowski/Qwen2.5-GGUF:q4_k_m", ("bartowski/Qwen2.5-GGUF", None, "Q4_K_M", None)),
    ("org/name@v2:Q8_0", ("org/name", "v2", "Q8_0", None)),
    ("org/name/model-Q8_0.gguf", ("org/name", None, None, "model-Q8_0.gguf")),
    ("org/name@v2/sub/model.gguf", ("org/name", "v2", None, "sub/model.gguf")),
])
def test_hub_specs_parse(spec: str, parsed: tuple) -> None:
    hub = parse_hub_spec(spec)
    assert hub is not None and (hub.repo_id, hub.revision, hub.quant, hub.filename) == parsed
    assert hub.text == spec


@pytest.mark.parametrize("spec", [
    "smollm2", "random:tiny", "./models/llama", "/models/llama", "~/llama", "model.gguf",
    "a/b/c", "a/b/c.bin", "C:/models/x", "org/na me", "-org/name", "org//name",
])
def test_what_is_not_a_hub_spec_is_left_to_the_paths(spec: str) -> None:
    assert parse_hub_spec(spec) is None


@pytest.mark.parametrize(("spec", "message"), [
    ("org/name@:Q4_0", "an empty revision"),
    ("org/name:Q4-K", "'Q4-K' is not a quantization label"),
    ("org/name@v1/x.gguf:Q4_0", "not both"),
])
def test_malformed_hub_specs_are_refused(spec: str, message: str) -> None:
    with pytest.raises(HubSpecError, match=message):
        parse_hub_spec(spec)


def test_names_come_from_the_spec_without_a_download() -> None:
    assert _spec("Qwen/Qwen2.5-7B-Instruct").name == "Qwen2.5-7B-Instruct"
    assert _spec("org/X-GGUF:q8_0").name == "X-GGUF-Q8_0"
    assert _spec("org/X-GGUF/sub/x-q4_0.gguf").name == "x-q4_0"


@pytest.mark.parametrize(("path", "label"), [
    ("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "Q4_K_M"), ("model.q8_0.gguf", "Q8_0"),
    ("x-IQ4_XS.gguf", "IQ4_XS"), ("x-bf16.gguf", "BF16"), ("x-F16.gguf", "F16"),
    ("Q4_K_M/x-Q4_K_M-00001-of-00002.gguf", "Q4_K_M"), ("tinyllama.gguf", None),
])
def test_quant_labels_are_read_from_file_names(path: str, label: str | None) -> None:
    assert quant_label(path) == label


def test_a_safetensors_repo_fetches_config_tokenizer_and_the_index_s_shards() -> None:
    chosen = choose_files(_spec("meta-llama/Llama-3.1-8B"), LLAMA)
    assert chosen.kind == "hf" and chosen.gguf is None
    assert chosen.files == ("config.json", "generation_config.json", "tokenizer.json",
                            "tokenizer_config.json", "special_tokens_map.json",
                            "model.safetensors.index.json")
    api = choose_files(_spec("meta-llama/Llama-3.1-8B"), LLAMA, "tokenizer")
    assert api.files == chosen.files[:-1]  # no weights for the API
    unsharded = {k: v for k, v in LLAMA.items() if "model" not in k} | {"model.safetensors": 9}
    assert choose_files(_spec("o/n"), unsharded).files[-1] == "model.safetensors"
    index = {"metadata": {}, "weight_map": {"a": "model-00002-of-00002.safetensors",
                                            "b": "model-00001-of-00002.safetensors",
                                            "c": "model-00001-of-00002.safetensors"}}
    assert shards_of_index(index, "idx") == ["model-00001-of-00002.safetensors",
                                             "model-00002-of-00002.safetensors"]
    with pytest.raises(HubSpecError, match="idx: no weight_map"):
        shards_of_index({}, "idx")


def test_a_gguf_repo_gives_the_quantization_asked_else_q4_k_m_else_its_first() -> None:
    repo = "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
    assert choose_files(_spec(f"{repo}:q8_0"), GGUF_REPO).files == (
        "Qwen2.5-0.5B-Instruct-Q8_0.gguf",)
    chosen = choose_files(_spec(repo), GGUF_REPO)
    assert (chosen.kind, chosen.gguf) == ("gguf", "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf")
    without = {k: v for k, v in GGUF_REPO.items() if "Q4_K_M" not in k}
    assert choose_files(_spec(repo), without).gguf == "Qwen2.5-0.5B-Instruct-IQ4_XS.gguf"
    file = f"{repo}/Qwen2.5-0.5B-Instruct-Q4_0.gguf"
    assert choose_files(_spec(file), GGUF_REPO).gguf == "Qwen2.5-0.5B-Instruct-Q4_0.gguf"


@pytest.mark.parametrize(("spec", "files", "message"), [
    ("o/n:Q5_K_M", GGUF_REPO, "o/n has no Q5_K_M file (it has: IQ4_XS, Q4_0, Q4_K_M, Q8_0)"),
    ("o/n:Q4_0", LLAMA, "o/n has no .gguf files, so no Q4_0"),
    ("o/n/absent.gguf", GGUF_REPO, "no file 'absent.gguf' in o/n (its GGUF files: "),
    ("o/n", {"config.json": 1, "pytorch_model.bin": 1, "tokenizer.json": 1},
     "o/n has no weights tidegate can load (found pytorch_model.bin; it loads"),
    ("o/n", {"README.md": 1}, "found no weight files"),
    ("o/n", {"config.json": 1, "model.safetensors": 1}, "no tokenizer.json"),
    ("o/n:Q4_K_M", {"Q4_K_M/x-Q4_K_M-00001-of-00002.gguf": 1,
                    "Q4_K_M/x-Q4_K_M-00002-of-00002.gguf": 1}, "part of a split GGUF"),
])
def test_a_repository_that_cannot_serve_the_spec_is_refused_naming_why(
        spec: str, files: dict[str, int], message: str) -> None:
    with pytest.raises(HubSpecError) as info:
        choose_files(_spec(spec), files)
    assert message in str(info.value) and str(info.value).startswith(f"model {spec!r}: ")
    assert "\n" not in str(info.value)


def _spec(text: str) -> HubSpec:
    spec = parse_hub_spec(text)
    assert spec is not None
    return spec
