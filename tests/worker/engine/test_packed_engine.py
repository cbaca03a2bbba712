"""The engine on the default model with its weights packed (Q4_1 and Q8_0 blocks, read by the
packed kernels) against the same engine on the dequantized float32 weights: the same tokens on
a prompt set, greedy, batched together. A divergence names its prompt and first position."""

from __future__ import annotations

import pytest

from tidegate.protocol import SamplingParams
from worker.engine.engine import Engine, EngineConfig, EngineRequest
from worker.models.loaders.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does HTTP stand for?",
]


def generate(loaded: LoadedModel, max_tokens: int = 48) -> dict[str, list[int]]:
    engine = Engine(loaded.model, loaded.tokenizer,
                    EngineConfig(max_model_len=2048, num_blocks=512, max_num_seqs=8))
    for i, prompt in enumerate(PROMPTS):
        ids = loaded.tokenizer.encode_prompt(None, [{"role": "user", "content": prompt}])
        engine.add_request(EngineRequest(str(i), ids, SamplingParams(
            max_tokens=max_tokens, temperature=0.0)))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    return tokens


def test_packed_default_model_gives_the_dequantized_float32_tokens() -> None:
    packed = load_model("smollm2")
    dequantized = load_model("smollm2", packed=False)
    assert packed.packed_types() == ["Q4_1", "Q8_0"] and dequantized.packed_types() == []
    assert packed.weight_bytes() < dequantized.weight_bytes() / 5
    want, got = generate(dequantized), generate(packed)
    for key, prompt in enumerate(PROMPTS):
        a, b = want[str(key)], got[str(key)]
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        assert a == b, f"{prompt!r}: diverges at output token {first} ({a[first:]} vs {b[first:]})"
