"""A small GGUF with a SentencePiece ("llama") vocabulary, as llama.cpp writes Llama 2 / Mistral
files (<unk>, <s>, </s>, the 256 byte tokens, then scored pieces) or Gemma files (pad, eos, bos,
unk and mask first; runs of spaces spelled as spaces). Its weights are one tiny embedding, enough
for transformers to read the file's config and build its tokenizer from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

# Pieces after the byte tokens, with scores. Equal scores are on purpose: transformers breaks
# ties between merges by the lengths of their halves, then by file order.
PIECES: tuple[tuple[str, float], ...] = (
    ("▁", -1.0), ("e", -2.0), ("t", -2.5), ("a", -2.6), ("o", -2.7), ("h", -3.0), ("l", -3.0),
    ("n", -3.1), ("r", -3.2), ("d", -3.3), ("w", -3.4), ("i", -3.5), ("s", -3.5), ("c", -3.6),
    ("v", -3.7), ("ï", -3.8), ("1", -4.0), ("2", -4.0), ("3", -4.0), ("T", -4.1), ("H", -4.2),
    ("he", -5.0), ("▁t", -5.0), ("▁a", -5.5), ("ll", -5.6), ("or", -5.7), ("ld", -5.8),
    ("llo", -6.0), ("▁w", -6.0), ("▁the", -6.5), ("▁th", -7.0), ("th", -7.0), ("el", -7.1),
    ("▁he", -7.2), ("▁hello", -7.5), ("hello", -7.5), ("ello", -8.0), ("▁wor", -8.0),
    ("▁world", -8.0), ("orld", -8.0), ("▁▁", -8.5), ("▁▁▁▁", -9.0), ("na", -9.0),
    ("▁na", -9.1), ("ve", -9.2), ("ïve", -9.3), ("12", -9.5), ("123", -9.6), ("an", -9.7),
    ("▁an", -9.8), ("▁and", -9.9), ("nd", -9.9), ("▁H", -10.0), ("▁He", -10.1), ("<0x", -10.5),
    ("▁T", -10.6), ("▁The", -10.7), ("\n", -11.0), ("\n\n", -11.5),
)
# Tokens at the end, as chat-tuned files append them.
EXTRA: tuple[tuple[str, int], ...] = (("<|im_end|>", CONTROL), ("<|tool|>", USER_DEFINED))
# Gemma files put pad, eos, bos, unk and mask first and store runs of spaces as real spaces.
GEMMA_SPECIALS: tuple[tuple[str, int], ...] = (
    ("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
    ("<mask>", USER_DEFINED),
)
GEMMA_EXTRA: tuple[tuple[str, float, int], ...] = (
    ("  ", -8.6, NORMAL), ("   ", -8.7, NORMAL), ("\t\t", -8.8, USER_DEFINED),
    ("<start_of_turn>", 0.0, CONTROL), ("<end_of_turn>", 0.0, CONTROL),
)


def spm_vocab(*, gemma: bool = False) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the test vocabulary (Llama's layout, or Gemma's)."""
    if gemma:
        tokens = [t for t, _ in GEMMA_SPECIALS]
        types = [kind for _, kind in GEMMA_SPECIALS]
    else:
        tokens = ["<unk>", "<s>", "</s>"]
        types = [UNKNOWN, CONTROL, CONTROL]
    scores = [0.0] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [BYTE] * 256
    pieces = [(p, s, NORMAL) for p, s in PIECES]
    pieces += list(GEMMA_EXTRA) if gemma else [(t, 0.0, kind) for t, kind in EXTRA]
    for piece, score, kind in pieces:
        tokens.append(piece)
        scores.append(score)
        types.append(kind)
    return tokens, scores, types


def write_spm_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tokenizer_model: str = "llama",
    with_scores: bool = True,
    merges: Sequence[str] | None = None,
    add_bos: bool | None = True,
    add_space_prefix: bool = True,
) -> Path:
    """Write a one-tensor GGUF of architecture ``arch`` with the test SentencePiece vocabulary
    (Gemma's layout for a gemma architecture); ``add_bos=None`` leaves the flag out."""
    gemma = arch.startswith("gemma")
    tokens, scores, types = spm_vocab(gemma=gemma)
    bos, eos, unk = (2, 1, 3) if gemma else (1, 2, 0)
    hidden = 8
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10_000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // 2)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    if with_scores:
        w.add_token_scores(scores)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(list(merges))
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    if gemma:
        w.add_pad_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    embedding = np.random.default_rng(0).normal(size=(len(tokens), hidden)).astype(np.float32)
    w.add_tensor("token_embd.weight", embedding)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
