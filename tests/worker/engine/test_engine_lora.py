"""LoRA adapters in the engine: PEFT adapters on a tiny random Llama give HF transformers +
peft's greedy tokens; a batch mixing three adapters and the base model gives each request what
it gets alone (one prompt for all: the prefix cache must not hand one adapter's keys to
another); fewer slots than adapters still serves them all; what cannot be served is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from tests.worker.tiny_checkpoints import tiny_hf_model, write_hf_dir
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest, RequestError
from tidegate.worker.engine.lora_manager import AdapterError
from tidegate.worker.models.loaders.loader import LoadedModel, load_model

# peft calls transformers' deprecated is_gradient_checkpointing: theirs, not ours.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # name -> (rank, targets, seed)
    "all8": (8, ALL, 1),
    "attn4": (4, ("q_proj", "v_proj", "o_proj"), 2),
    "mlp16": (16, ("gate_proj", "up_proj", "down_proj"), 3),
}
PROMPT = [256, *range(40, 80)]  # 41 tokens: two full blocks the prefix cache could share
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base model as an HF directory, and beside it one PEFT directory per adapter."""
    root = tmp_path_factory.mktemp("lora")
    write_hf_dir(tiny_hf_model(tied=False), root / "base")
    for name, (rank, targets, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        peft_model = get_peft_model(tiny_hf_model(tied=False), LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False))
        with torch.no_grad():  # PEFT's random init is small: make the adapters matter
            for pname, param in peft_model.named_parameters():
                if "lora_" in pname:
                    param.normal_(0.0, 0.2)
        peft_model.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def loaded(checkpoints: Path) -> LoadedModel:
    return load_model(str(checkpoints / "base"))


def make_engine(loaded: LoadedModel, checkpoints: Path, adapters: tuple[str, ...] = tuple(ADAPTERS),
                **config: object) -> Engine:
    config = {"max_loras": 4, "max_lora_rank": 16, "num_blocks": 64, **config}
    engine = Engine(loaded.model, loaded.tokenizer,
                    EngineConfig(max_model_len=256, **config))  # type: ignore[arg-type]
    for name in adapters:
        engine.add_adapter(name, str(checkpoints / name))
    return engine


def greedy(engine: Engine, requests: dict[str, str | None], *, stagger: bool = False
           ) -> dict[str, list[int]]:
    """Each request's greedy tokens (request id -> adapter or None); ``stagger``: one joins
    per step, so prefills and decodes of different adapters share steps."""
    pending = [EngineRequest(rid, PROMPT, SamplingParams(max_tokens=NEW_TOKENS,
                                                         ignore_eos=True), adapter=adapter)
               for rid, adapter in requests.items()]
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while pending or engine.has_unfinished():
        for request in pending[:1] if stagger else pending:
            engine.add_request(request)
        pending = pending[1:] if stagger else []
        for o in engine.step():
            if o.token_id is not None:
                out[o.request_id].append(o.token_id)
    return out


def hf_peft_greedy(checkpoints: Path, adapter: str) -> list[int]:
    base = tiny_hf_model(tied=False)
    model = PeftModel.from_pretrained(base, str(checkpoints / adapter)).eval()
    with torch.no_grad():
        ids = model.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    return ids[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_greedy_tokens_equal_hf_transformers_with_peft(checkpoints: Path, loaded: LoadedModel,
                                                       adapter: str) -> None:
    engine = make_engine(loaded, checkpoints)
    ours = greedy(engine, {"r": adapter})["r"]
    assert ours == hf_peft_greedy(checkpoints, adapter)
    base = greedy(engine, {"b": None})["b"]
    assert base != ours  # the adapter changed what the model says


def test_a_batch_mixing_adapters_and_the_base_equals_each_alone(checkpoints: Path,
                                                                 loaded: LoadedModel) -> None:
    alone = {}
    for adapter in [None, *ADAPTERS]:
        engine = make_engine(loaded, checkpoints)
        alone[adapter] = greedy(engine, {"x": adapter})["x"]
    assert len({tuple(t) for t in alone.values()}) == len(alone)  # four different answers
    requests = {f"r{i}": adapter for i, adapter in enumerate([None, *ADAPTERS] * 2)}
    for stagger in (False, True):
        engine = make_engine(loaded, checkpoints)
        mixed = greedy(engine, requests, stagger=stagger)
        for rid, adapter in requests.items():
            assert mixed[rid] == alone[adapter], (rid, adapter, stagger)


def test_fewer_slots_than_adapters_serves_them_all_in_turn(checkpoints: Path,
                                                           loaded: LoadedModel) -> None:
    engine = make_engine(loaded, checkpoints, max_loras=4)
    want = greedy(engine, {name: name for name in ADAPTERS})
    engine = make_engine(loaded, checkpoints, max_loras=1)
    requests = {f"r{i}": name for i, name in enumerate([*ADAPTERS, *ADAPTERS, None])}
    running_adapters: list[int] = []
    pending = [EngineRequest(rid, PROMPT, SamplingParams(max_tokens=NEW_TOKENS,
                                                         ignore_eos=True), adapter=adapter)
               for rid, adapter in requests.items()]
    for request in pending:
        engine.add_request(request)
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_id is not None:
                got[o.request_id].append(o.token_id)
        running_adapters.append(len(engine.scheduler.adapters))
    assert max(running_adapters) == 1  # never two adapters at once with one slot
    for rid, adapter in requests.items():
        if adapter is not None:
            assert got[rid] == want[adapter]
    assert engine.lora is not None and engine.lora.slots.loads >= len(ADAPTERS)


def test_what_cannot_be_served_is_refused_by_name(checkpoints: Path, loaded: LoadedModel,
                                                  tmp_path: Path) -> None:
    engine = make_engine(loaded, checkpoints, ("all8", "attn4"), max_lora_rank=8)
    assert engine.adapter_names() == ["all8", "attn4"]
    with pytest.raises(RequestError, match="adapter 'nope' is not loaded"):
        engine.add_request(EngineRequest("r", PROMPT, SamplingParams(max_tokens=4),
                                         adapter="nope"))
    with pytest.raises(AdapterError, match="rank is 16; this worker serves ranks up to 8"):
        engine.add_adapter("mlp16", str(checkpoints / "mlp16"))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.add_adapter("missing", str(tmp_path))
    engine.add_adapter("all8", str(checkpoints / "all8"))  # the same again: nothing to do
    with pytest.raises(AdapterError, match="already loaded from"):
        engine.add_adapter("all8", str(checkpoints / "attn4"))
    wrong = tmp_path / "wrong"  # an adapter of another model's shape
    wrong.mkdir()
    (wrong / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 2)},
              str(wrong / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"layer 0 q_proj is \(64, 8\); the model's is"):
        engine.add_adapter("wrong", str(wrong))
    off = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_model_len=256, num_blocks=8))
    with pytest.raises(AdapterError, match="max_loras is 0"):
        off.add_adapter("all8", str(checkpoints / "all8"))


def test_the_triton_kernels_give_the_reference_tokens(checkpoints: Path, loaded: LoadedModel,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel on its Triton path (the interpreter here): prefill and decode steps mixing
    an adapter and the base model give the plain-torch engine's tokens."""
    requests = {"base": None, "lora": "all8"}
    want = greedy(make_engine(loaded, checkpoints, ("all8",)), requests, stagger=True)
    monkeypatch.setenv("TIDEGATE_KERNELS", "triton")
    got = greedy(make_engine(loaded, checkpoints, ("all8",)), requests, stagger=True)
    assert got == want
