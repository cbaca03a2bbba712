"""PEFT LoRA adapters (``tidegate.worker.models.loaders.lora_adapter``): an adapter made by ``peft`` on a
tiny random Llama is read back so that every targeted projection's ``W + scale * B @ A`` equals
PEFT's own merged weight (plain and rsLoRA scaling); stacked with another adapter of a smaller
rank, the batched kernel gives each row its own adapter's merged output; what PEFT can save but
tidegate does not serve is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from tidegate.kernels import ops
from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.loaders.lora_adapter import (
    PROJECTIONS,
    load_lora_adapter,
    stack_adapters,
)

# peft (0.21) calls transformers' deprecated is_gradient_checkpointing: theirs, not ours.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def make_adapter(tmp: Path, rank: int, *, rslora: bool = False, seed: int = 1,
                 targets: tuple[str, ...] = PROJECTIONS) -> tuple[LlamaForCausalLM, Path]:
    """A PEFT adapter with random A and B (PEFT starts B at zero: a no-op), saved to ``tmp``;
    and the base model with that adapter merged, as PEFT merges it."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                        init_lora_weights=False, use_rslora=rslora)
    peft_model = get_peft_model(tiny_llama(), config)
    peft_model.save_pretrained(tmp)
    return peft_model.merge_and_unload(), tmp


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_weights_equal_peft_s(tmp_path: Path, rslora: bool) -> None:
    merged, folder = make_adapter(tmp_path, 8, rslora=rslora)
    adapter = load_lora_adapter(folder, "support")
    base = tiny_llama()
    assert adapter.name == "support" and adapter.rank == 8
    assert adapter.scale == pytest.approx(16 / 8 ** 0.5 if rslora else 2.0)
    for layer in range(2):
        for projection in PROJECTIONS:
            part = "self_attn" if projection.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            w = getattr(getattr(base.model.layers[layer], part), projection).weight
            want = getattr(getattr(merged.model.layers[layer], part), projection).weight
            delta = adapter.delta(layer, projection)
            assert delta is not None
            torch.testing.assert_close(w + delta, want, rtol=1e-5, atol=1e-6)


def test_rows_of_two_adapters_and_none_get_their_own_merged_output(tmp_path: Path) -> None:
    merged_a, dir_a = make_adapter(tmp_path / "a", 8, seed=1)
    merged_b, dir_b = make_adapter(tmp_path / "b", 4, seed=2, targets=("q_proj", "v_proj"))
    adapters = [load_lora_adapter(dir_a), load_lora_adapter(dir_b)]
    base = tiny_llama()
    q = base.model.layers[1].self_attn.q_proj.weight.detach()
    stack = stack_adapters(adapters, 1, "q_proj", q.shape[1], q.shape[0])
    assert stack.a.shape == (2, 8, 32)  # rank 4 zero-padded to 8
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    index = torch.tensor([0, 1, -1, 1, 0])
    y = x @ q.T
    ops.add_lora(y, x, stack, ops.lora_rows(index, stack.num_adapters))
    wants = {0: merged_a.model.layers[1].self_attn.q_proj.weight,
             1: merged_b.model.layers[1].self_attn.q_proj.weight, -1: q}
    for t, i in enumerate(index.tolist()):
        torch.testing.assert_close(y[t], x[t] @ wants[i].detach().T, rtol=1e-5, atol=1e-5)
    # B does not target o_proj: it adds nothing there.
    o = stack_adapters(adapters, 0, "o_proj", 32, 32)
    assert o.scale.tolist() == [pytest.approx(2.0), 0.0]


@pytest.mark.parametrize(("change", "named"), [
    ({"use_dora": True}, "use_dora"), ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"r": 128}, "r=128"),
    ({"peft_type": "IA3"}, "peft_type")])
def test_what_is_not_served_is_refused_by_name(tmp_path: Path, change: dict,
                                               named: str) -> None:
    _, folder = make_adapter(tmp_path, 4)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelLoadError, match=named):
        load_lora_adapter(folder)


def test_a_directory_that_is_no_adapter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="adapter_config.json"):
        load_lora_adapter(tmp_path)
