"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers on the same file."""

from __future__ import annotations

import pytest

from tests.worker.hf_oracle import (
    CHAT_PROMPTS,
    causal_greedy,
    causal_logits,
    hf_eos_ids,
    hf_gguf_model,
    hf_greedy,
    hf_logits,
)
from tidegate.worker.models.loaders.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 40
# Both dequantize the same blocks to float32; what remains is summation order (~1e-4 of logits
# that reach ~40).
LOGITS_ATOL = 5e-4


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model("smollm2", cpu_activations="float")  # transformers' arithmetic


def chat_ids(ours: LoadedModel, prompt: str) -> list[int]:
    return ours.tokenizer.encode_prompt(None, [{"role": "user", "content": prompt}])


def test_config_matches_transformers(ours: LoadedModel) -> None:
    hf = hf_gguf_model().config
    cfg = ours.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta, cfg.tie_word_embeddings) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.rope_parameters["rope_theta"],
        hf.tie_word_embeddings)
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)


def test_eos_matches_generate(ours: LoadedModel) -> None:
    assert ours.tokenizer.eos_token_ids == hf_eos_ids()


def test_logits_match_transformers_on_a_chat_prompt(ours: LoadedModel) -> None:
    ids = chat_ids(ours, "Explain in two sentences why the sky is blue.")
    diff = (causal_logits(ours.model, ids) - hf_logits(ids)).abs().max().item()
    assert diff < LOGITS_ATOL


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_generation_matches_transformers(ours: LoadedModel, prompt: str) -> None:
    ids = chat_ids(ours, prompt)
    expected = hf_greedy(ids, MAX_NEW_TOKENS)
    assert causal_greedy(ours.model, ids, MAX_NEW_TOKENS, ours.tokenizer.eos_token_ids,
                         guess=expected) == expected
