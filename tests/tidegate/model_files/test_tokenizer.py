from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase, generate_merges

from tests.tidegate.model_files.spm_gguf import PIECES as SPM_PIECES
from tests.tidegate.model_files.spm_gguf import spm_vocab, write_spm_gguf
from tests.worker.hf_oracle import hf_gguf_tokenizer
from tidegate.model_files.chat_template import ChatTemplateError
from tidegate.model_files.model_source import ModelLoadError, ModelSource, resolve_model
from tidegate.model_files.sentencepiece_bpe import merges_from_ranks
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


# ---------------------------------------------------------------- SentencePiece GGUF ("llama")

SPM_PLAIN = [
    "Hello world",
    "hello world and the world",
    "The Hello, the hello.",
    " leading space",
    "   three leading spaces",
    "runs    of     spaces  ",
    "tabs\t\tand\ttabs",
    "lines\nand\n\nmore lines\n\n",
    "\n\nstarts with newlines",
    "naïve ☃ 日本",
    "emoji 😀 and ñ",
    "digits 123 1212 3 2024",
    "<0x41> is text, not a byte token",
    "",
    " ",
    "\n",
]
SPM_SPECIAL = [
    "control <|im_end|> and user <|tool|> tokens",
    "an eos </s> in the middle",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<unk> spelled out, <mask> too",
    "\t\tindented by <|tool|>",
]
# llama: Llama 2 / Mistral layout; gemma3: Gemma's builder (no prefix space, merges by file
# order, space runs respelled); phi3: prefix space from a normalizer; llama-merges: merges listed
# in the file, which then win over the scores.
SPM_VARIANTS = ("llama", "gemma3", "phi3", "llama-merges")
SpmPair = tuple[Tokenizer, PreTrainedTokenizerBase]  # tidegate's and transformers' tokenizer
SPM_WORDS = ("hello", "world", "the", "The", "and", "naïve", "123", "12", " ", "  ", "   ", "\n",
             "\t", "a", "na", "ïve", "日本", "<|tool|>", "<|im_end|>", "☃")


def file_merges() -> list[str]:
    """Every cut of a piece into two pieces, last piece first: far from the scores' order."""
    tokens, _, _ = spm_vocab()
    known = set(tokens)
    return [f"{t[:k]} {t[k:]}" for t, _ in reversed(SPM_PIECES) for k in range(1, len(t))
            if t[:k] in known and t[k:] in known]


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SpmPair]:
    """Per variant: tidegate's tokenizer and transformers' one, both from the same GGUF file."""
    out = {}
    for variant in SPM_VARIANTS:
        folder = tmp_path_factory.mktemp(variant)
        arch = variant.split("-")[0]
        merges = file_merges() if variant.endswith("merges") else None
        path = write_spm_gguf(folder / "model.gguf", arch=arch, merges=merges)
        ours = load_tokenizer(ModelSource(str(path), "gguf", path, None))
        out[variant] = (ours, AutoTokenizer.from_pretrained(folder, gguf_file=path.name))
    return out


@pytest.mark.parametrize("variant", SPM_VARIANTS)
@pytest.mark.parametrize("text", SPM_PLAIN + SPM_SPECIAL)
def test_spm_gguf_tokenizer_gives_hf_ids(
    spm: dict[str, SpmPair], variant: str, text: str
) -> None:
    tok, hf = spm[variant]
    ids = tok.encode(text)
    # Both add BOS (add_bos_token true); HF through its post-processor.
    assert ids == hf.encode(text, add_special_tokens=True)
    assert ids[0] == tok.bos_token_id
    # Decode drops specials and, for Llama and Phi-3, the space put in front.
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    if text in SPM_PLAIN:
        # HF's Llama pre-tokenizer puts no "▁" in front of a text that starts with a space, yet
        # its decoder strips one: that space is lost (SentencePiece itself would keep it).
        lost = variant.startswith("llama") and text.startswith(" ")
        assert tok.decode(ids) == (text[1:] if lost else text)


@pytest.mark.parametrize("variant", SPM_VARIANTS)
def test_spm_gguf_tokenizer_matches_hf_on_random_text(
    spm: dict[str, SpmPair], variant: str
) -> None:
    tok, hf = spm[variant]
    rng = random.Random(3)
    texts = [random_text(rng, rng.randint(0, 30)) for _ in range(100)]
    texts += ["".join(rng.choice(SPM_WORDS) for _ in range(rng.randint(1, 12)))
              for _ in range(300)]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_spm_merges_are_transformers_merges() -> None:
    """Merges derived from ranks, in transformers' order: many equal ranks and cuts."""
    rng = random.Random(5)
    words = ["".join(rng.choice("▁abcd") for _ in range(rng.randint(1, 6))) for _ in range(600)]
    pieces = list(dict.fromkeys(words))
    vocab = {piece: i for i, piece in enumerate(pieces)}
    ranks = {piece: float(rng.randint(-5, 0)) for piece in pieces}
    merges = merges_from_ranks(vocab, ranks)
    assert len(merges) > 500
    assert merges == generate_merges(vocab, ranks)


@pytest.mark.parametrize("variant", SPM_VARIANTS)
def test_spm_gguf_backend_is_hf_backend(
    spm: dict[str, SpmPair], variant: str
) -> None:
    """Model (vocabulary, merges, byte fallback, unk), normalizer, pre-tokenizer, decoder and
    added tokens all equal; only HF's post-processor (BOS) is left to ``Tokenizer``."""
    tok, hf = spm[variant]
    ours, theirs = json.loads(tok.backend.to_str()), json.loads(hf.backend_tokenizer.to_str())
    assert theirs.pop("post_processor")["type"] == "TemplateProcessing"
    assert ours.pop("post_processor") is None
    assert ours == theirs


@pytest.mark.parametrize("variant", SPM_VARIANTS)
def test_spm_gguf_single_ids_decode_as_hf(
    spm: dict[str, SpmPair], variant: str
) -> None:
    tok, hf = spm[variant]
    for i in range(tok.vocab_size):
        assert tok.decode([i]) == hf.decode([i], skip_special_tokens=True), i


@pytest.mark.parametrize("variant", SPM_VARIANTS)
def test_spm_gguf_special_ids(spm: dict[str, SpmPair], variant: str) -> None:
    tok, hf = spm[variant]
    assert tok.bos_token_id == hf.bos_token_id == (2 if variant == "gemma3" else 1)
    assert tok.vocab_size == len(hf)
    assert tok.add_bos and tok.max_context == 512
    if variant == "gemma3":
        assert tok.eos_token_ids == frozenset({hf.eos_token_id})
    else:
        # Without a chat template the ChatML one is used, whose <|im_end|> also stops.
        assert tok.eos_token_ids == frozenset({hf.eos_token_id,
                                               hf.convert_tokens_to_ids("<|im_end|>")})


def test_spm_gguf_text_starting_with_bos(spm: dict[str, SpmPair]) -> None:
    """A text that already starts with <s> gets no second one (``Tokenizer._with_bos``), where
    HF's post-processor would add it: as HF without its specials."""
    tok, hf = spm["llama"]
    assert tok.encode("<s>hello") == hf.encode("<s>hello", add_special_tokens=False)
    assert hf.encode("<s>hello")[:2] == [1, 1]


@pytest.mark.parametrize(("flags", "first"), [
    ({"add_bos": None}, [1]),  # no flag: BOS, as llama.cpp and transformers do for SentencePiece
    ({"add_bos": False}, []),
    ({"add_space_prefix": False}, [1]),  # transformers prepends "▁" whatever this flag says
])
def test_spm_gguf_flags_as_hf(tmp_path: Path, flags: dict[str, Any], first: list[int]) -> None:
    path = write_spm_gguf(tmp_path / "model.gguf", **flags)
    tok = load_tokenizer(ModelSource(str(path), "gguf", path, None))
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("hello world", " hello", ""):
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text)[:len(first)] == first


def test_gguf_tokenizer_of_unknown_model_is_refused(tmp_path: Path) -> None:
    path = write_spm_gguf(tmp_path / "model.gguf", tokenizer_model="t5")
    with pytest.raises(ModelLoadError, match=r"tokenizer model 't5' is not supported .*'gpt2'"
                                             r".*'llama'"):
        load_tokenizer(ModelSource(str(path), "gguf", path, None))


def test_spm_gguf_without_scores_is_refused(tmp_path: Path) -> None:
    path = write_spm_gguf(tmp_path / "model.gguf", with_scores=False)
    with pytest.raises(ModelLoadError, match="score"):
        load_tokenizer(ModelSource(str(path), "gguf", path, None))
