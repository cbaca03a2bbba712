"""Byte-level BPE backends (``tokenizers.Tokenizer``) built from raw vocabularies: a GGUF file's
token list and merges, or the 256 bytes alone for random-weight models.

The GGUF build follows transformers' GGUF conversion (``integrations/gguf/
gguf_tokenizer_mapping.py``) so ids match it: GPT-2's byte alphabet, BPE without prefixes,
llama.cpp's pre-tokenizer split picked by ``tokenizer.ggml.pre``, control tokens as specials.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

# llama.cpp's token types (tokenizer.ggml.token_type).
CONTROL, USER_DEFINED = 3, 4

# Pre-tokenizer splits by tokenizer.ggml.pre; any other value uses GPT-2's regex, as transformers
# does. (llama.cpp's "smollm" also isolates digits, which gives the same ids: the vocabulary has
# no merge that joins a digit to anything.)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = dict.fromkeys(
    ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), _LLAMA3_SPLIT
)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def gguf_backend(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    pre: str | None,
    special_ids: Collection[int],
) -> Tokenizer:
    """The backend a GGUF "gpt2" vocabulary describes; ``special_ids`` (bos, eos, ...) are made
    special like its control tokens."""
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    # A token outside the byte alphabet is stored as raw text; spell it in the alphabet (as HF).
    vocab = {
        tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    split = _GGUF_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    # Control tokens are matched whole and skipped in decode; user-defined ones are matched whole
    # but kept. One outside the byte alphabet is a llama.cpp mislabel (HF skips it too): adding
    # it would create an id past the model's vocabulary.
    typed = list(zip(tokens, token_types, strict=False))
    backend.add_special_tokens([
        AddedToken(tok, normalized=False, special=True)
        for i, (tok, kind) in enumerate(typed)
        if (kind == CONTROL or i in special_ids) and set(tok) <= alphabet
    ])
    backend.add_tokens([AddedToken(tok, normalized=False, special=False)
                        for tok, kind in typed if kind == USER_DEFINED and set(tok) <= alphabet])
    return backend


def byte_backend(specials: Sequence[str]) -> Tokenizer:
    """256 byte tokens (id = byte value) then ``specials``: any UTF-8 text round-trips."""
    spell = bytes_to_unicode()
    vocab = {spell[b]: b for b in range(256)}
    vocab.update({tok: 256 + i for i, tok in enumerate(specials)})
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    return backend
