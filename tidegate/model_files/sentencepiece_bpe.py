"""SentencePiece vocabularies of GGUF files as ``tokenizers`` backends.

This module owns the files whose ``tokenizer.ggml.model`` is ``"llama"`` (Llama 2, Mistral 7B,
Mixtral, Gemma, Phi-3): their token list, scores and token types become a BPE model with byte
fallback, built the way transformers 5 builds it from the same metadata
(``integrations/gguf/gguf_tokenizer_mapping.py`` handing the vocabulary to its Llama or Gemma
tokenizer class), so that both give the same ids. Byte-level ("gpt2") vocabularies are
``byte_level_bpe``'s.

What such a file holds and what is made of it:

- ``tokens``: pieces spelled with "▁" (U+2581) for a space; bytes that no piece covers are the
  256 tokens ``<0x00>``..``<0xFF>`` (type BYTE), reached through the BPE model's byte fallback.
- ``scores``: one float a piece. The file has no merges, so they are recovered: every way to cut
  a piece into two pieces of the vocabulary is a merge, ranked by the score of the piece it makes
  (Gemma ranks by position in the file instead: its scores do not follow its merge order).
- ``token_type``: CONTROL tokens are matched whole in text and skipped in decode; USER_DEFINED
  ones are matched whole and kept.

Spaces become "▁" before the model sees the text, with one "▁" put in front of the text
(Llama: a Metaspace pre-tokenizer, which prepends only at the start of the input and not when
it already starts with a space; Phi-3: a normalizer, which prepends always, after each special
token too; Gemma: none). Decoding turns "▁" back into spaces, joins
byte tokens back into UTF-8 and, where one was prepended, strips one leading space.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

SPACE = "\u2581"  # how SentencePiece spells a space inside a piece

# Where the "▁" in front of a text comes from: a Metaspace pre-tokenizer (only at the start of
# the input), a normalizer (also after each special token) or nowhere.
Prefix = Literal["metaspace", "normalizer", "none"]

# llama.cpp's token types (tokenizer.ggml.token_type).
CONTROL, USER_DEFINED = 3, 4


@dataclass(frozen=True, slots=True)
class _Family:
    """How one family of SentencePiece models differs from Llama's, as transformers tells them
    apart (by ``general.architecture``)."""

    # Gemma stores runs of spaces as real spaces while its text side looks for "▁▁".
    respell_space_runs: bool = False
    # Gemma's scores do not rank its merges; the order of its tokens in the file does.
    rank_by_position: bool = False
    prefix: Prefix = "metaspace"
    # The unknown token the BPE model is given; Llama's gets none (unknown text is bytes).
    model_unk: str | None = None
    # Specials transformers' tokenizer class adds by name whether or not the file has them:
    # the builder's defaults, then (after the file's specials) the final class's own.
    class_specials: tuple[str, ...] = ("<s>", "</s>", "<unk>")
    final_specials: tuple[str, ...] = ()


_LLAMA = _Family()
_GEMMA = _Family(respell_space_runs=True, rank_by_position=True, prefix="none", model_unk="<unk>",
                 class_specials=("<bos>", "<eos>", "<unk>", "<pad>", "<mask>"),
                 final_specials=("<mask>",))
_PHI3 = _Family(prefix="normalizer")
_FAMILIES: Mapping[str, _Family] = {"gemma": _GEMMA, "gemma2": _GEMMA, "gemma3": _GEMMA,
                                     "phi3": _PHI3}


def sentencepiece_backend(
    architecture: str | None,
    tokens: Sequence[str],
    scores: Sequence[float] | None,
    token_types: Sequence[int],
    merges: Sequence[str] | None,
    special_tokens: Sequence[str],
) -> Tokenizer:
    """The backend a GGUF "llama" vocabulary describes.

    ``merges`` are used when the file lists them (few do); otherwise they are derived from
    ``scores``, which must then be given (one a token). ``special_tokens`` are the file's named
    tokens (bos, eos, unk, pad in that order) that are made special like its control tokens.
    """
    family = _FAMILIES.get(architecture or "", _LLAMA)
    if family.respell_space_runs:
        # Only pieces made of nothing but whitespace with a space in them: "  " -> "▁▁".
        pieces = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    else:
        pieces = list(tokens)
    # A later duplicate of a piece takes its id, as a dict built in file order does in HF.
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if merges is not None:
        pairs = [_split_merge(m) for m in merges]
    else:
        if family.rank_by_position:
            ranks = {piece: float(-i) for i, piece in enumerate(pieces)}
        elif scores is None or len(scores) < len(pieces):
            raise ValueError("a SentencePiece vocabulary needs one score a token to rank merges")
        else:
            ranks = {piece: float(s) for piece, s in zip(pieces, scores, strict=False)}
        pairs = merges_from_ranks(vocab, ranks)

    backend = Tokenizer(BPE(vocab=vocab, merges=pairs, unk_token=family.model_unk, fuse_unk=True,
                            byte_fallback=True, dropout=None))
    _set_text_pipeline(backend, family.prefix)

    # The order tokens are added in decides the id of any that is not in the vocabulary.
    backend.add_special_tokens(_specials(family.class_specials))
    typed = list(zip(tokens, token_types, strict=False))
    # Control tokens keep the file's spelling (transformers adds them from the raw list).
    backend.add_special_tokens(_specials([tok for tok, kind in typed if kind == CONTROL]))
    # A user-defined token is added only when its spelling is a known token: a Gemma run of
    # spaces, respelled above, is left to the model.
    known = backend.get_vocab(with_added_tokens=True)
    backend.add_tokens([AddedToken(tok, normalized=False, special=False)
                        for tok, kind in typed if kind == USER_DEFINED and tok in known])
    # The file's named tokens are made special only if not added already: re-adding would make
    # a user-defined one (Gemma's <mask>) special, which transformers leaves as it is.
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens(_specials([t for t in [*special_tokens, *family.final_specials]
                                          if t not in added]))
    return backend


def merges_from_ranks(
    vocab: Mapping[str, int], ranks: Mapping[str, float]
) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: each cut of a ranked piece into two pieces of
    ``vocab`` merges back into it, best-ranked piece first.

    Equal ranks are ordered as transformers' ``generate_merges`` orders them, since the order
    decides which of two competing merges BPE applies: the longer left half first, then the
    longer right half, then the order of ``ranks``. (Two cuts of one piece always differ in
    their left half's length, so they never tie.)
    """
    found: list[tuple[float, int, int, str, str]] = []
    for piece, rank in ranks.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append((rank, k, len(right), left, right))
    # A stable sort, descending on (rank, lengths): equal keys stay in the order found.
    found.sort(key=lambda merge: merge[:3], reverse=True)
    return [(left, right) for _, _, _, left, right in found]


def _set_text_pipeline(backend: Tokenizer, prefix: Prefix) -> None:
    """Normalizer, pre-tokenizer and decoder: spaces to "▁" and back, bytes joined again."""
    to_text: list[decoders.Decoder] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                       decoders.Fuse()]
    if prefix == "metaspace":
        # "first": only text at the start of the input gets the "▁", not text after a special
        # token. No split: the whole text is one word for BPE, as SentencePiece treats it.
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first", split=False)
    elif prefix == "normalizer":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE),
                                                   normalizers.Replace(" ", SPACE)])
    else:
        backend.normalizer = normalizers.Replace(" ", SPACE)
        # A no-op after the normalizer (no spaces are left), kept so the pipeline is Gemma's.
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    if prefix != "none":
        # Take back the space that was put in front.
        to_text.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(to_text)


def _specials(tokens: Sequence[str]) -> list[AddedToken]:
    # Matched on the raw text, before spaces become "▁".
    return [AddedToken(tok, normalized=False, special=True) for tok in tokens]


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right
