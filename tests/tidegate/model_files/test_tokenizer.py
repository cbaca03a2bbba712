from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.worker.hf_oracle import hf_gguf_tokenizer
from tidegate.model_files.chat_template import ChatTemplateError
from tidegate.model_files.model_source import ModelSource, resolve_model
from tidegate.model_files.tokenizer import Tokenizer, byte_level_tokenizer, load_tokenizer
from tidegate.protocol import ChatMessage

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see.",
    "def square(x: int) -> int:\n    return x ** 2\n\n\nprint(square(12345))",
    "    indented\tand\ttabbed\r\nline  with   runs     of spaces   ",
    "\n\n\nleading newlines and trailing ones\n\n",
    "naïve café, Zürich, São Paulo, Ærøskøbing, İstanbul",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "math: ∑_{i=1}^{n} i² = n(n+1)/2 ≈ ∞ ≠ ∅",
    "numbers 3.14159 1,000,000 0x1F 2024-01-01 007",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n<|endoftext|>",
    "<jupyter_code>import numpy as np<jupyter_output>",
    "",
    " ",
    "a" * 300,
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Write code."},
     {"role": "assistant", "content": "print('hi')"},
     {"role": "user", "content": "Now in Rust, with émojis 🎉 and 中文."}],
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return load_tokenizer(resolve_model("smollm2"))


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_gives_hf_ids(smollm2: Tokenizer, text: str) -> None:
    assert smollm2.encode(text) == hf_gguf_tokenizer().encode(text)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CHATS)
def test_chat_rendering_matches_hf(smollm2: Tokenizer, messages: list[dict[str, str]]) -> None:
    hf = hf_gguf_tokenizer()
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm2.render_chat(messages) == text
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert smollm2.encode_prompt(None, messages) == list(ids)


def test_smollm2_special_ids(smollm2: Tokenizer) -> None:
    # generation_config of SmolLM2-135M-Instruct: bos 1 (<|im_start|>), eos 2 (<|im_end|>).
    assert smollm2.eos_token_ids == frozenset({2})
    assert smollm2.bos_token_id == 1
    assert smollm2.vocab_size == 49152
    assert smollm2.max_context == 8192
    assert smollm2.encode("Hi")[0] != 1  # add_bos_token is false


@pytest.mark.parametrize("text", [t for t in TEXTS if "<" not in t])
def test_decode_round_trips(smollm2: Tokenizer, text: str) -> None:
    assert smollm2.decode(smollm2.encode(text)) == text


def test_decode_skips_special_tokens(smollm2: Tokenizer) -> None:
    ids = smollm2.encode_prompt(None, [ChatMessage(role="user", content="Hi")])
    assert smollm2.decode(ids) == "system\nYou are a helpful AI assistant named SmolLM, " \
        "trained by Hugging Face\nuser\nHi\nassistant\n"
    assert smollm2.decode([2]) == ""


def test_one_token_decodes_as_the_backend_decodes_it(smollm2: Tokenizer) -> None:
    """decode of a single id is looked up after its first call (the detokenizer decodes every
    new token alone): the same text as the backend's, asked twice, specials and ids past the
    vocabulary included."""
    rng = random.Random(7)
    ids = [rng.randrange(smollm2.vocab_size) for _ in range(300)] + [0, 1, 2, 200_000]
    for _ in range(2):
        for i in ids:
            assert smollm2.decode([i]) == smollm2.backend.decode([i], skip_special_tokens=True)
    assert smollm2.decode([200_000]) == "" and smollm2.decode([2]) == ""


def test_encode_prompt_takes_messages_or_a_prompt(smollm2: Tokenizer) -> None:
    as_models = [ChatMessage(**m) for m in CHATS[1]]  # type: ignore[arg-type]
    assert smollm2.encode_prompt(None, as_models) == smollm2.encode_prompt(None, CHATS[1])
    assert smollm2.encode_prompt("Hello", None) == smollm2.encode("Hello")


def test_smollm2_tokenizer_loads_fast() -> None:
    start = time.perf_counter()
    load_tokenizer(resolve_model("smollm2"))
    # ~0.2 s measured on two cores; transformers takes ~8 s for the same file.
    assert time.perf_counter() - start < 2.0


def random_text(rng: random.Random, n: int) -> str:
    planes = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x2FF), (0x370, 0x52F), (0x4E00, 0x9FFF),
              (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x10000, 0x1000F), (0xE000, 0xF8FF)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(planes)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def test_byte_level_tokenizer_round_trips_any_unicode() -> None:
    tok = byte_level_tokenizer(2048)
    rng = random.Random(0)
    for _ in range(200):
        text = random_text(rng, rng.randint(0, 60))
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert len(ids) == 1 + len(text.encode("utf-8"))
        assert max(ids) < 512  # fits the smallest random preset's vocabulary
        assert tok.decode(ids) == text


def test_byte_level_tokenizer_chat_uses_chatml(tmp_path: Path) -> None:
    tok = load_tokenizer(resolve_model("random:tiny"))
    text = tok.render_chat([{"role": "user", "content": "hé"}])
    assert text == "<|im_start|>user\nhé<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_prompt(None, [{"role": "user", "content": "hé"}])
    assert ids[:2] == [256, 258]  # <s>, <|im_start|>
    assert tok.eos_token_ids == frozenset({257, 259})  # </s> and the ChatML turn end
    assert tok.max_context == 2048


def write_hf_tokenizer_dir(path: Path) -> Path:
    path.mkdir()
    byte_level_tokenizer(256).backend.save(str(path / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
                "{{ raise_exception('no system messages') }}{% endif %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}, "add_bos_token": True,
        "chat_template": template,
    }))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 259]}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                  "max_position_embeddings": 1000}))
    return path


def test_hf_directory_tokenizer(tmp_path: Path) -> None:
    path = write_hf_tokenizer_dir(tmp_path / "tok")
    tok = load_tokenizer(ModelSource(str(path), "hf", path, None))
    assert tok.max_context == 1000
    assert tok.bos_token_id == 256
    assert tok.eos_token_ids == frozenset({257, 259})
    assert tok.encode("ab") == [256, 97, 98]
    chat = [{"role": "user", "content": "ab"}]
    # The template writes <s> itself: no second BOS.
    ids = tok.encode_prompt(None, chat)
    assert ids[:2] == [256, 258] and ids.count(256) == 1
    hf = AutoTokenizer.from_pretrained(path)
    assert tok.render_chat(chat) == hf.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="no system messages"):
        tok.render_chat([{"role": "system", "content": "x"}])
