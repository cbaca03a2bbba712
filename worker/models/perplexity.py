"""Perplexity of a model over a token sequence: the quality check of quantized weights.

The text's tokens are cut into windows of ``context`` tokens; each window runs through the
model once (plain causal attention, no cache) and only its second half is scored, so every
scored token sees at least ``context / 2`` tokens before it (llama.cpp's ``perplexity`` scores
windows the same way, so figures are comparable for equal windows and tokenizer). Perplexity
is ``exp`` of the mean negative log-likelihood over all scored tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tidegate.worker.models.decoder import CausalAttention, DecoderModel


@dataclass(frozen=True, slots=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens_scored: int
    windows: int
    context: int
    seconds: float


def perplexity(model: DecoderModel, ids: Sequence[int], *, context: int = 512,
               progress: Callable[[int, int], None] | None = None) -> Perplexity:
    """Score ``ids`` in windows of ``context`` tokens (see the module docstring).

    A text shorter than one window is one window of its own length. Raises ``ValueError``
    for fewer than 2 tokens or a context below 2."""

    def logits_of(window: torch.Tensor, first: int) -> torch.Tensor:
        hidden = model(window, torch.arange(len(window)), CausalAttention())
        return model.compute_logits(hidden[first:-1])

    return score_windows(ids, logits_of, context=context, progress=progress)


def score_windows(ids: Sequence[int], logits_of: Callable[[torch.Tensor, int], torch.Tensor],
                  *, context: int = 512, progress: Callable[[int, int], None] | None = None
                  ) -> Perplexity:
    """The windows and their scoring, whatever computes the logits: ``logits_of(window,
    first)`` gives the logits at positions ``first`` .. the window's last but one (a
    benchmark scores llama.cpp's logits this way). Raises as ``perplexity`` does."""
    if context < 2:
        raise ValueError("context must be at least 2 tokens")
    if len(ids) < 2:
        raise ValueError("the text has fewer than 2 tokens: nothing to score")
    context = min(context, len(ids))
    windows = len(ids) // context
    start = time.perf_counter()
    total, scored = 0.0, 0
    for w in range(windows):
        window = torch.tensor(ids[w * context:(w + 1) * context])
        first = context // 2  # the first scored position's logits predict token first + 1
        logits = logits_of(window, first).double()
        targets = window[first + 1:]
        nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        total += nll
        scored += targets.numel()
        if progress is not None:
            progress(w + 1, windows)
    mean = total / scored
    return Perplexity(ppl=math.exp(mean), nll=mean, tokens_scored=scored, windows=windows,
                      context=context, seconds=time.perf_counter() - start)
