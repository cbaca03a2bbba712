"""Every family against transformers on the same tiny checkpoint: logits of a causal pass,
greedy tokens of the paged engine (chunked prefill, prefix caching and preemption in the mix)
equal to ``generate``, MoE routing equal to the reference router's on every token."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from transformers import PreTrainedModel

from tests.worker.engine_runs import run_to_end
from tests.worker.hf_oracle import causal_logits, hf_greedy, hf_logits
from tests.worker.models.family_checkpoints import (
    FAMILIES,
    ROPES,
    write_family,
    write_family_gguf,
)
from tidegate.kernels.reference.moe import route
from tidegate.model_files.model_source import HF_MODEL_TYPES, ModelLoadError
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from tidegate.worker.models.decoder import Experts
from tidegate.worker.models.families import MODEL_TYPES
from tidegate.worker.models.loaders.loader import LoadedModel, load_model

LOGITS_ATOL = 2e-4
NEW_TOKENS = 24
# Byte prompts longer than every window and than a cache block; two share a 40-token prefix.
SHARED = b"The tide gate opens at dawn and closes at dusk. "
PROMPTS = [
    [256, *SHARED, *b"Why?"],
    [256, *SHARED, *b"When does it close again?"],
    [256, *b"Short one."],
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, PreTrainedModel, LoadedModel]:
    name = request.param
    hf_model, path = write_family(name, tmp_path_factory.mktemp(name) / "model")
    return name, hf_model, load_model(str(path))


def test_the_config_names_the_family(family: tuple[str, PreTrainedModel, LoadedModel]) -> None:
    name, _, ours = family
    assert ours.config.family == name


def test_logits_match_transformers(family: tuple[str, PreTrainedModel, LoadedModel]) -> None:
    _, hf_model, ours = family
    for ids in PROMPTS:
        diff = (causal_logits(ours.model, ids) - hf_logits(ids, hf_model)).abs().max().item()
        assert diff < LOGITS_ATOL


def run_all(engine: Engine) -> dict[str, list[RequestOutput]]:
    return run_to_end(engine, max_steps=2000)


@pytest.mark.parametrize("num_blocks", [64, 14], ids=["roomy", "preempting"])
def test_paged_engine_greedy_equals_generate(
    family: tuple[str, PreTrainedModel, LoadedModel], num_blocks: int
) -> None:
    _, hf_model, ours = family
    engine = Engine(ours.model, ours.tokenizer, EngineConfig(
        max_model_len=256, num_blocks=num_blocks, block_size=8, max_num_batched_tokens=24,
        max_num_seqs=4))
    for i, ids in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"r{i}", ids, SamplingParams(
            max_tokens=NEW_TOKENS, ignore_eos=True)))
    outs = run_all(engine)
    for i, ids in enumerate(PROMPTS):
        got = [o.token_id for o in outs[f"r{i}"] if o.token_id is not None]
        want = hf_greedy_ignoring_eos(ids, hf_model)
        assert got == want, (i, first_difference(got, want))
    if num_blocks == 14:
        assert engine.stats.preemptions > 0
    else:
        assert engine.stats.prompt_tokens_computed < sum(map(len, PROMPTS))  # a prefix hit


def hf_greedy_ignoring_eos(ids: list[int], model: PreTrainedModel) -> list[int]:
    config = model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = None
    try:
        return hf_greedy(ids, NEW_TOKENS, model)
    finally:
        config.eos_token_id = saved


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_routing_equals_the_reference_router_on_every_token(tmp_path: Path,
                                                                name: str) -> None:
    hf_model, path = write_family(name, tmp_path / "m")
    ours = load_model(str(path))
    ids = PROMPTS[0]
    theirs: list[torch.Tensor] = []
    mine: list[torch.Tensor] = []
    for layer in hf_model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            gate.register_forward_hook(lambda _m, _i, out: theirs.append(out[2]))
    for module in ours.model.modules():
        if isinstance(module, Experts):
            module.register_forward_hook(lambda m, args, _o: mine.append(route(
                args[0] @ m.router.T, m.cfg.experts_per_token, m.cfg.norm_topk_prob).experts))
    hf_logits(ids, hf_model)
    causal_logits(ours.model, ids)
    assert len(mine) == len(theirs) >= 2
    for got, want in zip(mine, theirs, strict=True):
        assert torch.equal(got.sort(-1).values, want.reshape(got.shape).sort(-1).values)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rope_scalings_match_transformers(tmp_path: Path, rope: str) -> None:
    params = {**ROPES[rope], "rope_theta": 10_000.0}
    hf_model, path = write_family("qwen2", tmp_path / "m", rope_parameters=params)
    ours = load_model(str(path))
    original = ROPES[rope].get("original_max_position_embeddings", 256)
    for ids in PROMPTS:
        if rope == "longrope" and len(ids) > original:
            continue  # transformers then rotates every position with the long factors
        diff = (causal_logits(ours.model, ids) - hf_logits(ids, hf_model)).abs().max().item()
        assert diff < LOGITS_ATOL, rope
    if original + 40 > ours.model.rope_cache.shape[0]:
        return
    # Past the original context, positions take what transformers uses for a long sequence.
    positions = torch.arange(original + 40)[None]
    cos, sin = hf_model.model.rotary_emb(torch.zeros(1, 1, 16), positions)
    half = ours.config.head_dim // 2
    table = ours.model.rope_cache[:original + 40]
    torch.testing.assert_close(table[original:, :half], cos[0, original:, :half])
    torch.testing.assert_close(table[original:, half:], sin[0, original:, :half])


def test_the_api_and_the_worker_know_the_same_model_types() -> None:
    assert HF_MODEL_TYPES == MODEL_TYPES


def test_an_unknown_model_type_is_refused_by_name(tmp_path: Path) -> None:
    _, path = write_family("qwen2", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "falcon"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model_type 'falcon' is not supported"):
        load_model(str(path))


def test_an_unsupported_activation_is_refused_by_name(tmp_path: Path) -> None:
    _, path = write_family("qwen2", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["hidden_act"] = "relu2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"hidden_act 'relu2' is not supported"):
        load_model(str(path))


# llama.cpp stores no window for its "llama" architecture (Mistral 7B v0.1 runs without one
# there): the GGUF variant of Mistral is its windowless later version. Nor does it store
# Gemma's query_pre_attn_scalar (it takes the head size, or hidden / heads for the 27B models).
# Qwen3-MoE's GGUF always renormalizes the routing weights (llama.cpp's graph does).
GGUF_OVERRIDES: dict[str, dict[str, object]] = {"mistral": {"sliding_window": None},
                                                "gemma2": {"query_pre_attn_scalar": 16},
                                                "qwen3_moe": {"norm_topk_prob": True}}
# llama.cpp's architecture "llama" holds Mistral as it holds Llama.
GGUF_FAMILY = {"mistral": "llama"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gguf_variant_matches_transformers(tmp_path: Path, name: str) -> None:
    hf_model, hf_dir = write_family(name, tmp_path / "hf", **GGUF_OVERRIDES.get(name, {}))
    path = write_family_gguf(name, hf_model, hf_dir, tmp_path / "m.gguf")
    ours = load_model(str(path))
    assert ours.config.family == GGUF_FAMILY.get(name, name) and ours.source.kind == "gguf"
    for ids in PROMPTS:
        diff = (causal_logits(ours.model, ids) - hf_logits(ids, hf_model)).abs().max().item()
        assert diff < LOGITS_ATOL


@pytest.mark.parametrize("name", ["qwen2", "phi3", "gemma2", "qwen3_moe"])
def test_quantized_gguf_variant_stays_packed_and_computes_its_dequantized_model(
        tmp_path: Path, name: str) -> None:
    hf_model, hf_dir = write_family(name, tmp_path / "hf")
    path = write_family_gguf(name, hf_model, hf_dir, tmp_path / "m.gguf",
                             qtype=gguf.GGMLQuantizationType.Q8_0)
    packed = load_model(str(path), cpu_activations="float")
    float_model = load_model(str(path), packed=False)
    assert "Q8_0" in packed.packed_types() and not float_model.packed_types()
    for ids in PROMPTS:
        diff = (causal_logits(packed.model, ids) - causal_logits(float_model.model, ids))
        assert diff.abs().max().item() < 1e-3


# Chat formats of the families, as their tokenizer_config.json carries them (each written here
# in the family's format; the model's own template is what renders a chat).
TEMPLATES = {
    "qwen2": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% endif %}"),
    "gemma2": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
               "{{ raise_exception('System role not supported') }}{% endif %}"
               "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
               "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n"
               "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "mistral": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                "[INST] {{ m['content'] }} [/INST]{% elif m['role'] == 'assistant' %}"
                "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
    "phi3": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% else %}"
             "{{ eos_token }}{% endif %}"),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_family_renders_chats_with_its_own_template(tmp_path: Path, name: str) -> None:
    from transformers import AutoTokenizer

    _, path = write_family(name, tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATES[name]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_model(str(path)).tokenizer
    hf_tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "Hi there "}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "And the tide?"}]
    want = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(chat) == want
