"""Greedy decoding of fixed chat prompts through the engine alone, and where two runs' tokens
part: how the benchmarks and the tests compare weight formats token for token."""

from __future__ import annotations

from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.loaders.loader import LoadedModel

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
MAX_TOKENS = 48
def generate(loaded: LoadedModel, max_tokens: int = MAX_TOKENS) -> dict[str, list[int]]:
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


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first output position where a and b differ (a shorter list differs where it ends)."""
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return at if at is not None or len(a) == len(b) else min(len(a), len(b))
