"""Speculative decoding (n-gram drafts) in the engine: greedy tokens identical to plain
decoding across chunked prefill, prefix caching, preemption, choices, stops and max_tokens, on
the default model and a tiny random one; the KV cache block by block; seeds; the opt-out."""

from __future__ import annotations

import pytest
import torch

from tidegate.protocol import SamplingParams
from worker.engine.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from worker.models.loaders.loader import LoadedModel, load_model

TEXT = ("The committee approved the new budget for the harbour bridge, which will be "
        "repainted in the spring and reopened to traffic in June. Residents asked for a second "
        "footpath on the eastern side, and the council promised to study it before the summer.")


def run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    for r in reqs:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(20_000):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def summary(outs: dict[str, list[RequestOutput]]) -> dict[str, tuple[object, ...]]:
    """Per request and choice: tokens, the final text and finish reason, token indices."""
    out: dict[str, tuple[object, ...]] = {}
    for rid, os in outs.items():
        for choice in sorted({o.choice for o in os}):
            mine = [o for o in os if o.choice == choice]
            out[f"{rid}#{choice}"] = (
                [o.token_id for o in mine if o.token_id is not None],
                [o.index for o in mine if o.token_id is not None],
                mine[-1].output_text, mine[-1].finish_reason, mine[-1].num_output_tokens)
    return out


def both(loaded: LoadedModel, reqs: list[EngineRequest], **config: object
         ) -> tuple[dict[str, tuple[object, ...]], dict[str, tuple[object, ...]], Engine]:
    config = {"max_model_len": 1024, "num_blocks": 256, **config}
    plain = run(Engine(loaded.model, loaded.tokenizer, EngineConfig(**config)), reqs)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(speculative="ngram", **config))
    return summary(plain), summary(run(engine, reqs)), engine


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2", cpu_activations="float")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("random:tiny")


def chat(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode_prompt(None, [{"role": "user", "content": text}])


@pytest.mark.slow
def test_default_model_greedy_is_plain_decoding(smollm2: LoadedModel) -> None:
    reqs = [
        EngineRequest("copy", chat(smollm2, "Repeat this text exactly:\n\n" + TEXT),
                      SamplingParams(max_tokens=80)),
        EngineRequest("stop", chat(smollm2, "Repeat this text exactly:\n\n" + TEXT),
                      SamplingParams(max_tokens=80, stop=["spring"])),
        EngineRequest("short", chat(smollm2, "Quote the first sentence of:\n\n" + TEXT),
                      SamplingParams(max_tokens=7)),
        EngineRequest("free", chat(smollm2, "What is the capital of France?"),
                      SamplingParams(max_tokens=24)),
    ]
    plain, spec, engine = both(smollm2, reqs)
    assert spec == plain
    assert "spring" not in str(spec["stop#0"][2]) and spec["stop#0"][3] == "stop"
    assert spec["short#0"][4] == 7
    stats = engine.stats
    assert stats.accepted_tokens > 0.5 * stats.draft_tokens > 0  # a quoting workload
    # Fewer steps than tokens: several tokens came out of one step.
    assert stats.steps < stats.decode_tokens


def repetitive(i: int) -> list[int]:
    """A prompt that repeats itself, so drafts find matches."""
    unit = [(7 * i + 3 * j) % 400 + 5 for j in range(6 + i % 3)]
    return unit * 5


@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 12, "max_num_seqs": 4},  # chunked prompts, drafts cut to fit
    {"num_blocks": 24, "block_size": 8},  # preemption
    {"prefix_caching": False},
], ids=["default", "chunked", "preempting", "no-prefix-cache"])
def test_tiny_greedy_is_plain_decoding(tiny: LoadedModel, config: dict[str, object]) -> None:
    reqs = [EngineRequest(f"r{i}", repetitive(i), SamplingParams(
        max_tokens=30 + 5 * i, ignore_eos=True)) for i in range(6)]
    reqs.append(EngineRequest("choices", repetitive(9), SamplingParams(
        max_tokens=20, ignore_eos=True, n=2, temperature=0.0)))
    reqs.append(EngineRequest("stop-id", repetitive(2), SamplingParams(
        max_tokens=40, stop_token_ids=[repetitive(2)[3]])))
    plain, spec, engine = both(tiny, reqs, **config)
    assert spec == plain
    assert engine.stats.accepted_tokens > 0
    if config.get("num_blocks") == 24:
        assert engine.stats.preemptions > 0


def test_kv_cache_holds_only_kept_tokens_block_by_block(tiny: LoadedModel) -> None:
    """Mid-run, every computed position's keys and values equal plain decoding's, and the
    prefix cache registered the same blocks: rejected drafts left nothing behind."""
    req = EngineRequest("kv", repetitive(4), SamplingParams(max_tokens=200, ignore_eos=True))
    engines = []
    for spec in (None, "ngram"):
        engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(
            max_model_len=1024, num_blocks=64, block_size=4, speculative=spec))
        engine.add_request(req)
        while len(engine._seqs["kv"].output_ids) < 40:
            engine.step()
        engines.append(engine)
    plain, spec = engines
    assert spec.stats.draft_tokens > spec.stats.accepted_tokens > 0  # some were rejected
    n = min(e._seqs["kv"].num_computed for e in engines)
    bs = 4
    for block in range(n // bs):
        rows = []
        for e in engines:
            table = e.blocks.block_table("kv")
            rows.append(e.runner.kv_cache[:, :, table[block]])
        torch.testing.assert_close(rows[1], rows[0], rtol=1e-5, atol=1e-5)
    # The prefix cache serves every full computed block (a lookup leaves one token to
    # compute) and, on the speculative side, not one block past what was computed.
    for e in engines:
        seq = e._seqs["kv"]
        full = seq.num_computed // bs
        assert len(e.blocks.cached_prefix(seq.all_ids()[: full * bs + 1], None)) == full
        assert len(e.blocks.cached_prefix(seq.all_ids() + [0] * 8, None)) == full


def test_seeded_sampling_repeats_and_the_opt_out_drafts_nothing(tiny: LoadedModel) -> None:
    sampled = EngineRequest("s", repetitive(1), SamplingParams(
        max_tokens=40, temperature=0.8, seed=5, ignore_eos=True))
    config = EngineConfig(max_model_len=1024, num_blocks=64, speculative="ngram")
    first = summary(run(Engine(tiny.model, tiny.tokenizer, config), [sampled]))
    engine = Engine(tiny.model, tiny.tokenizer, config)
    assert summary(run(engine, [sampled])) == first
    off = EngineRequest("off", repetitive(1), SamplingParams(
        max_tokens=40, ignore_eos=True, speculative=False))
    engine = Engine(tiny.model, tiny.tokenizer, config)
    run(engine, [off])
    assert engine.stats.draft_tokens == 0


def test_speculation_needs_steps_read_back() -> None:
    with pytest.raises(ValueError, match="async_output"):
        EngineConfig(max_model_len=64, speculative="ngram", async_output=True)
    with pytest.raises(ValueError, match="ngram"):
        EngineConfig(max_model_len=64, speculative="eagle")
