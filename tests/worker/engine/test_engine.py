"""The paged engine on the real default model: fidelity to HF transformers under chunked prefill,
prefix caching and preemption; continuous batching; stops; aborts; seeds; logprobs."""

from __future__ import annotations

import pytest
import torch

from tests.worker.hf_oracle import causal_greedy, hf_greedy
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    RequestError,
    RequestOutput,
)
from tidegate.worker.models.loaders.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "What is 12 plus 30?",
]
SYSTEM = ("You are a meticulous assistant for a shipping company. Answer in one short sentence, "
          "never invent tracking numbers, and always mention the depot name if it is known.")


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    # Float activations: these tests hold the engine to transformers' tokens (8-bit
    # activations are held to the float engine's in test_packed_engine.py).
    return load_model("smollm2", cpu_activations="float")


def make_engine(loaded: LoadedModel, **config: object) -> Engine:
    config.setdefault("num_blocks", 256)
    return Engine(loaded.model, loaded.tokenizer, EngineConfig(max_model_len=2048, **config))


def chat_ids(loaded: LoadedModel, text: str, system: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    return loaded.tokenizer.encode_prompt(None, [*messages, {"role": "user", "content": text}])


def run_all(engine: Engine, max_steps: int = 10_000, join: dict[int, list[EngineRequest]] | None = None
            ) -> dict[str, list[RequestOutput]]:
    """Step until idle; ``join`` adds requests at given step numbers (continuous batching)."""
    outs: dict[str, list[RequestOutput]] = {}
    join = dict(join or {})
    for step in range(max_steps):
        for req in join.pop(step, []):
            engine.add_request(req)
        if not engine.has_unfinished() and not join:
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def test_greedy_output_equals_hf_transformers(smollm2: LoadedModel) -> None:
    engine = make_engine(smollm2)
    prompts = {f"c{i}": chat_ids(smollm2, text) for i, text in enumerate(CHATS)}
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=40)))
    outs = run_all(engine)
    for rid, ids in prompts.items():
        assert tokens(outs[rid]) == hf_greedy(ids, 40), rid
    assert "Paris" in outs["c0"][-1].output_text


def test_mixed_lengths_chunked_and_joining_late_match_the_uncached_model(
    smollm2: LoadedModel,
) -> None:
    # Prompts from 1 to 6 blocks, a step budget of 48 tokens so long prompts are chunked over
    # several steps while earlier requests decode; requests join at different steps.
    texts = ["Hi!", "Explain photosynthesis to a child in detail, covering light, water, "
             "carbon dioxide, sugar, oxygen and why leaves are green. " * 4,
             CHATS[1], "Name three rivers in Europe and the countries they flow through."]
    ids = [chat_ids(smollm2, t) for t in texts]
    assert max(len(i) for i in ids) > 2 * 48
    engine = make_engine(smollm2, max_num_batched_tokens=48, max_num_seqs=8)
    reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=16)) for i, p in enumerate(ids)]
    outs = run_all(engine, join={0: reqs[:1], 2: reqs[1:3], 5: reqs[3:]})
    eos = smollm2.tokenizer.eos_token_ids
    for i, p in enumerate(ids):
        expected = causal_greedy(smollm2.model, p, 16, eos, guess=tokens(outs[f"r{i}"]))
        assert tokens(outs[f"r{i}"]) == expected, i
    assert engine.stats.steps > len(ids)  # chunking really happened


def test_prefix_cache_hits_keep_output_and_cut_prefill_work(smollm2: LoadedModel) -> None:
    questions = ["Where is parcel 1?", "Where is parcel 2?", "When does the depot open?",
                 "Can I change my address?"]
    ids = [chat_ids(smollm2, q, SYSTEM) for q in questions]
    params = SamplingParams(max_tokens=12)

    def run(prefix_caching: bool) -> tuple[dict[str, list[RequestOutput]], Engine]:
        engine = make_engine(smollm2, prefix_caching=prefix_caching)
        first = [EngineRequest("q0", ids[0], params)]
        rest = [EngineRequest(f"q{i}", p, params) for i, p in enumerate(ids) if i]
        return run_all(engine, join={0: first, 3: rest}), engine

    cached, with_cache = run(True)
    plain, without = run(False)
    for i, p in enumerate(ids):
        assert tokens(cached[f"q{i}"]) == tokens(plain[f"q{i}"]) == hf_greedy(p, 12)
    common = next(n for n, xs in enumerate(zip(*ids, strict=False)) if len(set(xs)) > 1)
    shared = with_cache.blocks.stats.hit_tokens
    # Each later request reuses every full block of the shared system-prompt prefix.
    assert common >= 32 and shared == 3 * (common // 16) * 16
    assert (without.stats.prompt_tokens_computed - with_cache.stats.prompt_tokens_computed
            == shared)
    assert with_cache.blocks.stats.hit_rate > 0.5 * (len(ids) - 1) / len(ids)


def test_tiny_cache_preempts_and_output_is_unchanged(smollm2: LoadedModel) -> None:
    ids = [chat_ids(smollm2, t) for t in CHATS + ["List the planets of the solar system."]]
    params = SamplingParams(max_tokens=40)
    roomy = make_engine(smollm2)
    tight = make_engine(smollm2, num_blocks=max(len(i) for i in ids) // 16 + 8)
    for engine in (roomy, tight):
        for n, p in enumerate(ids):
            engine.add_request(EngineRequest(f"p{n}", p, params, deadline_ms=1000 + n))
    expected, got = run_all(roomy), run_all(tight)
    assert tight.stats.preemptions > 0 and roomy.stats.preemptions == 0
    for rid in expected:
        assert tokens(got[rid]) == tokens(expected[rid]), rid


def test_streamed_text_equals_final_text_and_stops_apply(smollm2: LoadedModel) -> None:
    engine = make_engine(smollm2)
    ids = chat_ids(smollm2, "Count from 1 to 20, separated by commas.")
    engine.add_request(EngineRequest("len", ids, SamplingParams(max_tokens=7)))
    engine.add_request(EngineRequest("stop", ids, SamplingParams(max_tokens=60, stop=["5"])))
    outs = run_all(engine)
    assert outs["len"][-1].finish_reason == "length" and len(tokens(outs["len"])) == 7
    assert outs["stop"][-1].finish_reason == "stop"
    for rid in ("len", "stop"):
        assert "".join(o.text for o in outs[rid]) == outs[rid][-1].output_text
    assert "5" not in outs["stop"][-1].output_text and "4" in outs["stop"][-1].output_text


def test_stop_token_ids_ignore_eos_and_logprobs(smollm2: LoadedModel) -> None:
    ids = chat_ids(smollm2, CHATS[0])
    greedy = hf_greedy(ids, 40)
    assert greedy[-1] in smollm2.tokenizer.eos_token_ids and len(greedy) < 40
    engine = make_engine(smollm2)
    engine.add_request(EngineRequest("tok", ids, SamplingParams(max_tokens=40,
                                                                 stop_token_ids=[greedy[3]])))
    engine.add_request(EngineRequest("noeos", ids, SamplingParams(max_tokens=len(greedy) + 5,
                                                                   ignore_eos=True)))
    engine.add_request(EngineRequest("lp", ids, SamplingParams(max_tokens=3, logprobs=2)))
    outs = run_all(engine)
    assert tokens(outs["tok"]) == greedy[:4] and outs["tok"][-1].finish_reason == "stop"
    assert len(tokens(outs["noeos"])) == len(greedy) + 5
    assert outs["noeos"][-1].finish_reason == "length"
    first = outs["lp"][0].logprobs
    assert first is not None and len(first.top) == 2 and first.top[0][0] == greedy[0]
    assert first.logprob == pytest.approx(first.top[0][1]) and first.logprob < 0


def test_abort_finishes_a_running_request_as_cancelled(smollm2: LoadedModel) -> None:
    engine = make_engine(smollm2)
    engine.add_request(EngineRequest("a", chat_ids(smollm2, CHATS[0]), SamplingParams(max_tokens=100)))
    engine.step()
    engine.abort("a")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "cancelled")]
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.kv_spec.num_blocks


def test_seeded_sampling_is_reproducible_across_batches(smollm2: LoadedModel) -> None:
    sampled = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    ids = chat_ids(smollm2, "Tell me a short story about a fox.")
    alone = make_engine(smollm2)
    alone.add_request(EngineRequest("s", ids, sampled))
    expected = tokens(run_all(alone)["s"])

    crowd = make_engine(smollm2)
    others = [EngineRequest(f"o{i}", chat_ids(smollm2, text),
                            SamplingParams(max_tokens=20, temperature=1.0))
              for i, text in enumerate(CHATS)]
    got = run_all(crowd, join={0: others[:2], 1: [EngineRequest("s", ids, sampled)],
                               3: others[2:]})
    assert tokens(got["s"]) == expected
    other_seed = make_engine(smollm2)
    other_seed.add_request(EngineRequest("s", ids, sampled.model_copy(update={"seed": 99})))
    assert tokens(run_all(other_seed)["s"]) != expected


def test_requests_that_can_never_run_are_refused(smollm2: LoadedModel) -> None:
    engine = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(max_model_len=64, num_blocks=2))
    with pytest.raises(RequestError, match="context"):
        engine.add_request(EngineRequest("x", list(range(1, 80)), SamplingParams()))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(EngineRequest("y", [], SamplingParams()))
    with pytest.raises(RequestError, match="KV cache of 32 tokens"):
        engine.add_request(EngineRequest("z", list(range(1, 20)), SamplingParams(max_tokens=20)))
    assert not engine.has_unfinished()


def test_max_num_seqs_caps_the_running_batch(smollm2: LoadedModel) -> None:
    engine = make_engine(smollm2, max_num_seqs=2)
    for i in range(5):
        engine.add_request(EngineRequest(f"r{i}", chat_ids(smollm2, CHATS[i % 3]),
                                         SamplingParams(max_tokens=3)))
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 3
    outs = run_all(engine)
    assert sorted(outs) == [f"r{i}" for i in range(5)]


def test_kv_budget_in_gib_sets_the_number_of_blocks(smollm2: LoadedModel) -> None:
    engine = Engine(smollm2.model, smollm2.tokenizer,
                    EngineConfig(max_model_len=2048, kv_cache_gb=0.25))
    per_token = 30 * 2 * 3 * 64 * torch.finfo(torch.float32).bits // 8
    assert engine.kv_spec.num_tokens == (int(0.25 * 2**30) // (per_token * 16)) * 16
    assert "blocks x 16 tokens" in engine.kv_spec.describe()


def test_an_fp8_kv_cache_is_refused_off_cuda_by_name() -> None:
    loaded = load_model("random:tiny")
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 needs a CUDA device"):
        Engine(loaded.model, loaded.tokenizer, EngineConfig(max_model_len=64,
                                                            kv_cache_dtype="fp8"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, int8"):
        EngineConfig(max_model_len=64, kv_cache_dtype="int4")


def test_an_int8_kv_cache_holds_3_8_times_the_tokens_and_needs_the_native_kernels(
        smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """8-bit heads plus a float32 scale each: 68 bytes a head instead of 256. The greedy text
    of the default model stays the float cache's for its first 16 tokens on every chat here."""
    def engine(kv: str) -> Engine:
        return Engine(smollm2.model, smollm2.tokenizer, EngineConfig(
            max_model_len=2048, kv_cache_gb=0.25, kv_cache_dtype=kv))

    float_cache, int8_cache = engine("auto"), engine("int8")
    assert int8_cache.kv_spec.num_tokens // 16 == float_cache.kv_spec.num_tokens * 256 // 68 // 16
    for text in CHATS:
        ids = chat_ids(smollm2, text)
        got = {}
        for name, e in (("float", float_cache), ("int8", int8_cache)):
            e.add_request(EngineRequest(name, ids, SamplingParams(max_tokens=16,
                                                                  temperature=0.0)))
            outs: list[RequestOutput] = []
            while e.has_unfinished():
                outs += e.step()
            got[name] = tokens(outs)
        assert got["int8"] == got["float"], text
    monkeypatch.setenv("TIDEGATE_KERNELS", "reference")
    with pytest.raises(ValueError, match="kv_cache_dtype int8 needs a float32 model on the CPU"):
        engine("int8")
