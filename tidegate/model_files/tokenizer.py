"""The model's tokenizer: text <-> ids, chat rendering and the ids that end generation.

One ``Tokenizer`` wraps a ``tokenizers.Tokenizer`` built from whatever the model ships: a GGUF
file's vocabulary (byte-level BPE with its merges, or SentencePiece pieces with their scores;
rebuilt the way ``transformers`` rebuilds them, so ids match), a Hugging Face directory's
tokenizer.json, or a byte-level vocabulary for random-weight models.
No torch and no transformers here: the API imports this to count prompt tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from tidegate.model_files.byte_level_bpe import byte_backend, gguf_backend
from tidegate.model_files.chat_template import CHATML_TEMPLATE, ChatTemplate
from tidegate.model_files.model_source import (
    ModelLoadError,
    ModelSource,
    context_length,
    gguf_header,
)
from tidegate.model_files.sentencepiece_bpe import sentencepiece_backend
from tidegate.protocol import ChatMessage, Tool
from tidegate.structured.tool_calls import ToolFormat, tool_format_of

# Specials of the byte-level tokenizer of random-weight models, after the 256 byte tokens.
_BYTE_SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")


class Tokenizer:
    """Encodes prompts and chats to ids, decodes ids to text, knows which ids end generation."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        extra_eos_token_ids: Sequence[int] = (),
        add_bos: bool,
        chat_template: str | None,
        max_context: int,
        template_variables: Mapping[str, str | None] | None = None,
    ) -> None:
        self.backend = backend
        # Kept as given so ``save`` writes back what was read.
        self._saved = {"bos_token": bos_token, "eos_token": eos_token,
                       "add_bos_token": add_bos, "chat_template": chat_template,
                       **(template_variables or {})}
        self.bos_token_id: int | None = _token_id(backend, bos_token)
        self.add_bos = add_bos and self.bos_token_id is not None
        self.max_context = max_context
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        variables = {"bos_token": bos_token, "eos_token": eos_token, **(template_variables or {})}
        self.chat_template = ChatTemplate(chat_template or CHATML_TEMPLATE, variables)
        eos = {i for i in [_token_id(backend, eos_token), *extra_eos_token_ids] if i is not None}
        # Stop at the template's turn terminator too (Llama-3 GGUFs name <|end_of_text|> as eos
        # while a chat turn ends with <|eot_id|>); for SmolLM2 both are <|im_end|>, id 2.
        for token in self.chat_template.turn_end_tokens():
            if (token_id := _special_token_id(backend, token)) is not None:
                eos.add(token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._single: dict[int, str] = {}  # one id's text, as decode([id]) gives it

    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special tokens written in the text are matched as such (as HF)."""
        return self._with_bos(self.backend.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text, leaving out special tokens (eos, chat markers)."""
        if len(ids) == 1:
            # Incremental detokenization decodes each new token alone once (its window's
            # context): at a thousand sequences a step, a lookup instead of a call into the
            # backend. Bounded by the vocabulary (ids past it decode to nothing, once each).
            token = int(ids[0])
            text = self._single.get(token)
            if text is None:
                text = self._single[token] = self.backend.decode([token], skip_special_tokens=True)
            return text
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The conversation as prompt text, ending where the assistant's reply begins."""
        return self.chat_template.render(messages, add_generation_prompt=True, tools=tools)

    @cached_property
    def tool_format(self) -> ToolFormat | None:
        """How this model's chat template writes tool calls; None: it renders no tools."""
        return tool_format_of(self.chat_template.source)

    def encode_prompt(
        self, prompt: str | None, messages: Sequence[ChatMessage | Mapping[str, Any]] | None,
        tools: Sequence[Tool] | None = None,
    ) -> list[int]:
        """Ids for a job: a plain prompt, or messages (and tools) rendered through the chat
        template."""
        if messages is None:
            if prompt is None:
                raise ValueError("give a prompt or messages")
            return self.encode(prompt)
        plain = [m.template_dict() if isinstance(m, ChatMessage) else dict(m) for m in messages]
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        # As apply_chat_template: the template writes its own specials, so the tokenizer's
        # post-processor adds none; BOS is added only if the model wants one and it is missing.
        text = self.render_chat(plain, tool_dicts)
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids)

    def save(self, model_dir: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (and the stop ids into
        generation_config.json) as a Hugging Face directory holds them, so this tokenizer is
        read back the same by tidegate and by transformers (``tidegate quantize`` of a GGUF)."""
        model_dir.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(model_dir / "tokenizer.json"))
        config = {k: v for k, v in self._saved.items() if v is not None}
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config["model_max_length"] = self.max_context
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"eos_token_id": sorted(self.eos_token_ids)}
        if self.bos_token_id is not None:
            generation["bos_token_id"] = self.bos_token_id  # type: ignore[assignment]
        (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    def _with_bos(self, ids: list[int]) -> list[int]:
        bos = self.bos_token_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            return [bos, *ids]
        return ids


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of a resolved model; raises ``ModelLoadError`` when its files are unusable."""
    if source.kind == "random":
        return byte_level_tokenizer(context_length(source))
    assert source.path is not None
    if source.kind == "hf":
        return _hf_dir_tokenizer(source.path, context_length(source))
    return _gguf_tokenizer(source.path)


# ---------------------------------------------------------------- GGUF


def _gguf_tokenizer(path: Path) -> Tokenizer:
    header = gguf_header(path, tensors=False)
    meta = header.metadata
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{path}: tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2', "
            "as in Llama 3 and SmolLM, and SentencePiece, 'llama', as in Llama 2 and Mistral)"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF has no tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if isinstance(token_id, int) and token_id < len(tokens) else None

    special_keys = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    token_types = meta.get("tokenizer.ggml.token_type") or []
    if model == "gpt2":
        special_ids = {meta.get(f"tokenizer.ggml.{k}") for k in special_keys}
        backend = gguf_backend(tokens, meta.get("tokenizer.ggml.merges") or [], token_types,
                               meta.get("tokenizer.ggml.pre"),
                               {i for i in special_ids if isinstance(i, int)})
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    else:
        try:
            # Merges only when the file lists them (an empty list included), as transformers.
            backend = sentencepiece_backend(
                header.architecture, tokens, meta.get("tokenizer.ggml.scores"), token_types,
                meta.get("tokenizer.ggml.merges"),
                [t for t in map(token, special_keys) if t is not None])
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc
        # Files older than the flag want BOS: llama.cpp adds it to SentencePiece vocabularies.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))

    # End-of-turn / end-of-message ids that newer llama.cpp converters record beside eos.
    extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
             if isinstance(meta.get(k), int)]
    return Tokenizer(
        backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        extra_eos_token_ids=extra,
        add_bos=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
        max_context=int(meta.get(f"{header.architecture}.context_length", 2048)),
        template_variables={"unk_token": token("unknown_token_id"),
                            "pad_token": token("padding_token_id")},
    )


# ---------------------------------------------------------------- Hugging Face directory


def _hf_dir_tokenizer(model_dir: Path, max_context: int) -> Tokenizer:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"model directory {model_dir} has no tokenizer.json")
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"{path}: cannot load tokenizer.json: {exc}") from exc
    config = _read_json(model_dir / "tokenizer_config.json")
    return Tokenizer(
        backend,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        extra_eos_token_ids=_hf_eos_ids(model_dir),
        add_bos=bool(config.get("add_bos_token", False)),
        chat_template=_hf_chat_template(model_dir, config),
        max_context=max_context,
        template_variables={"unk_token": _token_text(config.get("unk_token")),
                            "pad_token": _token_text(config.get("pad_token"))},
    )


def _hf_eos_ids(model_dir: Path) -> list[int]:
    """What HF's generate stops on: generation_config.json's eos, else config.json's."""
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(model_dir / name).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else [int(i) for i in eos]
    return []


def _hf_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    # Newer transformers save the template beside the config as chat_template.jinja.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- random-weight models


def byte_level_tokenizer(max_context: int) -> Tokenizer:
    """256 byte tokens (id = byte value) plus <s>, </s> and ChatML markers: any UTF-8 round-trips."""
    return Tokenizer(byte_backend(_BYTE_SPECIALS), bos_token="<s>", eos_token="</s>",
                     add_bos=True, chat_template=None, max_context=max_context)


# ---------------------------------------------------------------- helpers


def _token_id(backend: Backend, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def _special_token_id(backend: Backend, token: str) -> int | None:
    token_id = backend.token_to_id(token)
    if token_id is None:
        return None
    added = backend.get_added_tokens_decoder().get(token_id)
    return token_id if added is not None and added.special else None
