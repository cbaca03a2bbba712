"""Speculative decoding on a GPU: verify chunks replay the captured decode graphs (a row per
token), with n-gram drafts and with a draft model (the target itself, whose catch-ups and
decodes replay its own graphs); greedy gives plain decoding's tokens, seeded sampling plain
sampling's. Float32 on the default model, so only a true near-tie could move a token.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_engine import PROMPTS, default_model
from tests.worker.speculative.test_speculative_engine import Alternating
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.loaders.loader import LoadedModel
from tidegate.worker.speculative.speculative_engine import speculative_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QUOTE = ("The lighthouse keeper climbed the narrow stairs every evening at dusk, carrying a "
         "small brass lamp and a notebook filled with careful observations about the weather.")
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def fp32() -> LoadedModel:
    return default_model("cuda", torch.float32)


def generate(loaded: LoadedModel, speculative: str | None, *, seeded: bool = False,
             overlapped: bool = False) -> tuple[list[list[int]], Engine, dict[str, int]]:
    """``overlapped``: async output (a GPU worker's default), speculating every third step,
    plain steps overlapped in between."""
    engine = speculative_engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=2048, max_num_seqs=8, kv_cache_gb=1.0, speculative=speculative,
        speculative_max_batch=8 if speculative else None,
        async_output=None if overlapped else False),
        draft=loaded.model if speculative == "draft" else None)
    if overlapped:
        engine.governor = Alternating()  # type: ignore[assignment]
    calls = {"graph_steps": 0, "verify_graph_steps": 0}
    runner = engine.runner
    assert runner.graphs is not None
    graph_forward = runner._graph_forward

    def counted(sched, *args):  # noqa: ANN001, ANN002, ANN202
        calls["graph_steps"] += 1
        calls["verify_graph_steps"] += any(c.seq.draft for c in sched.chunks)
        return graph_forward(sched, *args)

    runner._graph_forward = counted  # type: ignore[method-assign]
    prompts = [f"Repeat this exactly: {QUOTE}", *PROMPTS[:3]]
    for i, text in enumerate(prompts):
        ids = loaded.tokenizer.encode_prompt(None, [{"role": "user", "content": text}])
        temperature = 0.7 if seeded and i % 2 == 0 else 0.0
        engine.add_request(EngineRequest(f"p{i}", ids, SamplingParams(
            max_tokens=NEW_TOKENS, temperature=temperature, seed=i, ignore_eos=True)))
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    return [tokens[f"p{i}"] for i in range(len(prompts))], engine, calls


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
@pytest.mark.parametrize(("seeded", "overlapped"), [(False, False), (True, False), (True, True)],
                         ids=["greedy", "seeded", "seeded-overlapped"])
def test_verify_chunks_replay_graphs_and_give_plain_tokens(
        fp32: LoadedModel, speculative: str, seeded: bool, overlapped: bool) -> None:
    plain, _, _ = generate(fp32, None, seeded=seeded)
    spec, engine, calls = generate(fp32, speculative, seeded=seeded, overlapped=overlapped)
    same = sum(a == b for p, s in zip(plain, spec, strict=True)
               for a, b in zip(p, s, strict=True))
    assert same >= 0.97 * NEW_TOKENS * len(plain), (plain, spec)
    assert all(p[:8] == s[:8] for p, s in zip(plain, spec, strict=True))
    stats = engine.stats
    assert stats.accepted_tokens > 0 and stats.verify_chunks > 0
    # Verify steps went through the graphs (a chunk's tokens as rows of their own).
    assert calls["verify_graph_steps"] > 0, calls
    if speculative == "draft":
        draft_graphs = engine.speculator.runner.graphs  # type: ignore[union-attr]
        assert draft_graphs is not None and stats.draft_passes > 0
