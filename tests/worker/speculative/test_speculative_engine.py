"""Speculative decoding in the engine, with each proposer (n-gram drafts; a draft model equal
to the target, which accepts everything; a draft model that disagrees): greedy and seeded
tokens identical to plain decoding across chunked prefill, prefix caching, preemption,
choices, stops and max_tokens, on the default model and a tiny random one; the KV cache block
by block; the opt-out; speculation switched off past a batch size."""

from __future__ import annotations

import pytest
import torch

from tests.worker.engine_runs import run_to_end
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from tidegate.worker.models.decoder import DecoderModel
from tidegate.worker.models.loaders.loader import LoadedModel, load_model
from tidegate.worker.speculative.speculative_engine import speculative_engine

TEXT = ("The committee approved the new budget for the harbour bridge, which will be "
        "repainted in the spring and reopened to traffic in June. Residents asked for a second "
        "footpath on the eastern side, and the council promised to study it before the summer.")
PROPOSERS = ["ngram", "draft-same", "draft-other"]


def run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    return run_to_end(engine, reqs)


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


def speculative(loaded: LoadedModel, proposer: str, **config: object) -> Engine:
    """An engine speculating in every step (the governor's measurements are its own test):
    ``ngram``, or a draft model: the target itself (``draft-same``) or other random weights
    of the same shape and tokenizer (``draft-other``)."""
    config = {"max_model_len": 1024, "num_blocks": 256, "speculative_max_batch": 1024,
              **config}
    if proposer == "ngram":
        return speculative_engine(loaded.model, loaded.tokenizer,
                                  EngineConfig(speculative="ngram", **config))
    draft = loaded.model if proposer == "draft-same" else other_draft(loaded)
    return speculative_engine(loaded.model, loaded.tokenizer,
                              EngineConfig(speculative="draft", **config), draft=draft)


_OTHER: dict[int, DecoderModel] = {}


def other_draft(loaded: LoadedModel) -> DecoderModel:
    """Random weights of the target's shape, another seed (loaded once per target)."""
    if id(loaded) not in _OTHER:
        assert loaded.source.kind == "random"
        _OTHER[id(loaded)] = load_model(loaded.source.spec, seed=1).model
    return _OTHER[id(loaded)]


def both(loaded: LoadedModel, reqs: list[EngineRequest], proposer: str = "ngram",
         **config: object
         ) -> tuple[dict[str, tuple[object, ...]], dict[str, tuple[object, ...]], Engine]:
    config = {"max_model_len": 1024, "num_blocks": 256, **config}
    plain = run(Engine(loaded.model, loaded.tokenizer, EngineConfig(**config)), reqs)
    engine = speculative(loaded, proposer, **config)
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
@pytest.mark.parametrize("proposer", ["ngram", "draft-same"])
def test_default_model_greedy_is_plain_decoding(smollm2: LoadedModel, proposer: str) -> None:
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
    plain, spec, engine = both(smollm2, reqs, proposer)
    assert spec == plain
    assert "spring" not in str(spec["stop#0"][2]) and spec["stop#0"][3] == "stop"
    assert spec["short#0"][4] == 7
    stats = engine.stats
    # A quoting workload. The target as its own draft keeps every draft, but drafts past a
    # stop (the end of the text, the stop string) are dropped, not counted as kept.
    kept = 0.5 if proposer == "ngram" else 0.85
    assert stats.accepted_tokens > kept * stats.draft_tokens > 0
    # Fewer steps than tokens: several tokens came out of one step.
    assert stats.steps < stats.decode_tokens


def assert_drafted(engine: Engine, proposer: str) -> None:
    """Drafts were verified: n-gram ones often kept, the target's own always (less those
    dropped after a stop id), other random weights' seldom."""
    stats = engine.stats
    assert stats.draft_tokens > 0
    if proposer == "ngram":
        assert stats.accepted_tokens > 0
    elif proposer == "draft-same":
        assert stats.accepted_tokens >= 0.95 * stats.draft_tokens
    else:
        assert stats.accepted_tokens < stats.draft_tokens


def repetitive(i: int) -> list[int]:
    """A prompt that repeats itself, so drafts find matches."""
    unit = [(7 * i + 3 * j) % 400 + 5 for j in range(6 + i % 3)]
    return unit * 5


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 12, "max_num_seqs": 4},  # chunked prompts, drafts cut to fit
    {"num_blocks": 24, "block_size": 8},  # preemption
    {"prefix_caching": False},
], ids=["default", "chunked", "preempting", "no-prefix-cache"])
def test_tiny_greedy_is_plain_decoding(tiny: LoadedModel, config: dict[str, object],
                                       proposer: str) -> None:
    reqs = [EngineRequest(f"r{i}", repetitive(i), SamplingParams(
        max_tokens=30 + 5 * i, ignore_eos=True)) for i in range(6)]
    reqs.append(EngineRequest("choices", repetitive(9), SamplingParams(
        max_tokens=20, ignore_eos=True, n=2, temperature=0.0)))
    reqs.append(EngineRequest("stop-id", repetitive(2), SamplingParams(
        max_tokens=40, stop_token_ids=[repetitive(2)[3]])))
    plain, spec, engine = both(tiny, reqs, proposer, **config)
    assert spec == plain
    assert_drafted(engine, proposer)
    if config.get("num_blocks") == 24:
        assert engine.stats.preemptions > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft-other"])
def test_kv_cache_holds_only_kept_tokens_block_by_block(tiny: LoadedModel,
                                                        proposer: str) -> None:
    """Mid-run, every computed position's keys and values equal plain decoding's, and the
    prefix cache registered the same blocks: rejected drafts left nothing behind."""
    req = EngineRequest("kv", repetitive(4), SamplingParams(max_tokens=200, ignore_eos=True))
    engines = []
    for engine in (Engine(tiny.model, tiny.tokenizer, EngineConfig(
                       max_model_len=1024, num_blocks=64, block_size=4)),
                   speculative(tiny, proposer, num_blocks=64, block_size=4)):
        engine.add_request(req)
        while len(engine._seqs["kv"].output_ids) < 40:
            engine.step()
        engines.append(engine)
    plain, spec = engines
    assert spec.stats.draft_tokens > spec.stats.accepted_tokens  # some were rejected
    assert_drafted(spec, proposer)
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


@pytest.mark.parametrize("proposer", ["draft-same", "draft-other"])
def test_seeded_sampling_gives_plain_sampling_tokens(tiny: LoadedModel, proposer: str) -> None:
    """Each position's token is drawn as plain sampling draws it: a seeded request gives
    plain sampling's tokens with speculation, whatever was drafted and kept, and again.
    (The tiny model's samples never repeat themselves, so n-gram drafts would be none.)"""
    reqs = [EngineRequest(f"s{i}", repetitive(i), SamplingParams(
        max_tokens=40, temperature=t, top_k=k, seed=5 + i, ignore_eos=True))
        for i, (t, k) in enumerate([(0.8, 0), (0.3, 0), (1.0, 20)])]
    plain, spec, engine = both(tiny, reqs, proposer, num_blocks=64)
    assert spec == plain
    assert engine.stats.draft_tokens > 0
    if proposer == "draft-same":  # its argmax drafts: kept with the target's probability
        assert 0 < engine.stats.accepted_tokens < engine.stats.draft_tokens
    assert summary(run(speculative(tiny, proposer, num_blocks=64), reqs)) == plain


def test_the_target_as_its_own_draft_keeps_every_draft(tiny: LoadedModel) -> None:
    reqs = [EngineRequest(f"r{i}", repetitive(i), SamplingParams(max_tokens=40, ignore_eos=True))
            for i in range(4)]
    plain, spec, engine = both(tiny, reqs, "draft-same", num_speculative_tokens=3)
    assert spec == plain
    stats = engine.stats
    assert stats.accepted_tokens == stats.draft_tokens > 0
    # Every verify chunk gave its 3 drafts and one more, except where max_tokens cut it.
    assert stats.decode_tokens >= 3.5 * stats.verify_chunks


def test_a_draft_cache_without_room_drafts_nothing_and_stays_right(tiny: LoadedModel) -> None:
    """The draft cache holds as many blocks as the target's: with the target's prefix
    cache sharing one long prompt between requests, the draft's (which shares it too) is
    what runs short first, and requests it has no room for decode plainly."""
    prompt = repetitive(3) * 6
    reqs = [EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
            for i in range(6)]
    plain, spec, engine = both(tiny, reqs, "draft-other", num_blocks=40, block_size=8)
    assert spec == plain
    assert engine.stats.draft_tokens > 0


def test_the_opt_out_drafts_nothing(tiny: LoadedModel) -> None:
    off = EngineRequest("off", repetitive(1), SamplingParams(
        max_tokens=40, ignore_eos=True, speculative=False))
    for proposer in ("ngram", "draft-same"):
        engine = speculative(tiny, proposer, num_blocks=64)
        run(engine, [off])
        assert engine.stats.draft_tokens == engine.stats.draft_passes == 0


def test_speculation_switches_off_past_the_max_batch(tiny: LoadedModel) -> None:
    """speculative_max_batch 2: four requests decode plainly, the last two speculate."""
    reqs = [EngineRequest(f"r{i}", repetitive(i), SamplingParams(
        max_tokens=10 + 30 * (i // 2), ignore_eos=True)) for i in range(4)]
    engine = speculative(tiny, "ngram", speculative_max_batch=2)
    seen: list[tuple[int, int]] = []
    engine_reqs = list(reqs)
    for r in engine_reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        before = engine.stats.draft_tokens
        batch = engine.num_running
        engine.step()
        seen.append((batch, engine.stats.draft_tokens - before))
    assert all(drafted == 0 for batch, drafted in seen if batch > 2)
    assert sum(drafted for batch, drafted in seen if batch <= 2) > 0


def test_an_unknown_proposer_is_refused() -> None:
    with pytest.raises(ValueError, match="ngram, draft"):
        EngineConfig(max_model_len=64, speculative="eagle")
    with pytest.raises(ValueError, match="speculative_max_batch"):
        EngineConfig(max_model_len=64, speculative="ngram", speculative_max_batch=0)


def test_the_engine_is_handed_its_speculation(tiny: LoadedModel) -> None:
    """The engine imports no proposer: a config that speculates needs its parts handed in."""
    with pytest.raises(ValueError, match="speculative_engine builds one"):
        Engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=64, num_blocks=8,
                                                        speculative="ngram"))


class Alternating:
    """A governor that speculates every third step: the engine switches between overlapped
    plain steps (two in a row, so the second is launched ahead) and speculative ones all the
    time."""

    def __init__(self) -> None:
        self.calls = 0

    def speculate(self, batch: int) -> bool:
        self.calls += 1
        return self.calls % 3 == 0

    def record(self, batch: int, speculative: bool, tokens: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize("scheduling", [False, True], ids=["async-output", "async-scheduling"])
@pytest.mark.parametrize("proposer", ["ngram", "draft-same"])
def test_overlapped_plain_steps_and_speculative_steps_mix(
        tiny: LoadedModel, proposer: str, scheduling: bool) -> None:
    """With async_output (a GPU worker's default) a step that speculates reads the step in
    flight back first, and plain steps overlap as usual: greedy and seeded tokens stay plain
    decoding's, through every switch."""
    reqs = [EngineRequest(f"r{i}", repetitive(i), SamplingParams(
        max_tokens=30 + 5 * i, ignore_eos=True, temperature=0.7 if i % 2 else 0.0, seed=i))
        for i in range(5)]
    reqs.append(EngineRequest("stop", repetitive(2), SamplingParams(
        max_tokens=40, stop_token_ids=[repetitive(2)[3]])))
    plain = summary(run(Engine(tiny.model, tiny.tokenizer, EngineConfig(
        max_model_len=1024, num_blocks=256)), reqs))
    engine = speculative(tiny, proposer, async_output=True, async_scheduling=scheduling)
    engine.governor = Alternating()  # type: ignore[assignment]
    assert summary(run(engine, reqs)) == plain
    assert engine.stats.accepted_tokens > 0 and engine.stats.verify_chunks > 0
    assert engine.stats.scheduled_ahead > 0 or not scheduling


@pytest.mark.parametrize("proposer", ["draft-same", "draft-other"])
def test_a_migrated_sampled_request_goes_on_as_the_uninterrupted_one(
        tiny: LoadedModel, proposer: str) -> None:
    """A speculative run draws one number per token, as plain sampling does: a request
    continued elsewhere from its first 17 tokens (a migrated job, its seed given) ends with
    the uninterrupted run's tokens, with speculation on either side."""
    params = SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True)
    whole = run(speculative(tiny, proposer, num_blocks=64),
                [EngineRequest("m", repetitive(5), params, seed=11)])["m"]
    kept = [o for o in whole if o.token_id is not None][:17]
    rest = run(speculative(tiny, proposer, num_blocks=64), [EngineRequest(
        "m", repetitive(5), params, seed=11, output_ids=tuple(o.token_id for o in kept),
        output_text="".join(o.text for o in kept))])["m"]
    tokens = [o.token_id for o in whole if o.token_id is not None]
    assert [o.token_id for o in rest if o.token_id is not None] == tokens[17:]
    plain = run(Engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=1024,
                                                                num_blocks=64)),
                [EngineRequest("m", repetitive(5), params, seed=11)])["m"]
    assert [o.token_id for o in plain if o.token_id is not None] == tokens
