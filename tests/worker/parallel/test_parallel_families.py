"""Every family's features split over ranks: tensor- and pipeline-parallel engines (gloo, CPU
processes) give the single process's greedy tokens in float32."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.models.family_checkpoints import write_family
from tests.worker.parallel.test_parallel_engine import run, tokens
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.loaders.loader import load_model
from tidegate.worker.parallel.layout import ParallelLayout
from tidegate.worker.parallel.parallel_engine import start_parallel_engine

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_splits(family: str, tmp_path: Path) -> None:
    """q/k/v biases, q/k norms, fused checkpoints, windows, soft-caps, sandwich norms, tied
    embeddings and experts, under TP=2 and PP=2: the single process's greedy tokens."""
    _, path = write_family(family, tmp_path / family)
    loaded = load_model(str(path))
    config = EngineConfig(max_model_len=256, num_blocks=64, max_num_seqs=4,
                          max_num_batched_tokens=24)
    prompts = [[(5 * i + 3 * j) % 250 + 1 for j in range(12 + 9 * i)] for i in range(3)]
    reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True))
            for i, p in enumerate(prompts)]
    want = tokens(run(Engine(loaded.model, loaded.tokenizer, config), reqs))
    for tp, pp in [(2, 1), (1, 2)]:
        engine = start_parallel_engine(str(path), ParallelLayout(tp, pp), config,
                                       torch_threads=1)
        try:
            assert tokens(run(engine, reqs)) == want, (tp, pp)
        finally:
            engine.close()


def test_the_default_model_splits_three_ways() -> None:
    """SmolLM2 (9 heads, 3 KV heads, 30 layers; its GGUF dequantized on every rank): TP=3 and
    PP=3 answer a chat prompt with the single process's greedy tokens."""
    loaded = load_model("smollm2", packed=False)
    tok = loaded.tokenizer
    config = EngineConfig(max_model_len=512, num_blocks=64)
    chats = ["What is the capital of France?", "Write a haiku about the sea."]
    reqs = [EngineRequest(f"c{i}", tok.encode_prompt(None, [{"role": "user", "content": c}]),
                          SamplingParams(max_tokens=16, temperature=0.0))
            for i, c in enumerate(chats)]
    want = tokens(run(Engine(loaded.model, tok, config), reqs))
    assert "Paris" in tok.decode(want["c0"])
    for tp, pp in [(3, 1), (1, 3)]:
        engine = start_parallel_engine("smollm2", ParallelLayout(tp, pp), config,
                                       torch_threads=1)
        try:
            assert tokens(run(engine, reqs)) == want, (tp, pp)
        finally:
            engine.close()
