"""The benchmark's work: prompts of exact token lengths, output lengths, arrival times.

Every prompt is a random word sequence (distinct per job, so the prefix cache has nothing to
skip) measured with the served model's own tokenizer until it is exactly the asked number of
tokens as the worker will count them (``encode_prompt``: BOS included where the model adds one).
Jobs are greedy, ``ignore_eos`` and ``max_tokens`` = their output length, so each must produce
exactly that many tokens; a job given a ``response_format`` may also end sooner, where its
grammar is complete.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect use class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone data "
    "picture practice piece land product doctor wall patient worker news test movie north love "
    "support technology step baby computer type attention film tree source organization hair "
    "window evidence population truth song river blue green quiet bright slow swift old new"
).split()
# Appended one at a time to reach the exact length once whole words would overshoot it.
FILLERS = (" a", " I", ".", ",", " x", "!", "a", "-", " 1")


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    token_ids: tuple[int, ...]  # as the worker will tokenize it

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Work:
    """One run's jobs: prompt, output length and arrival offset (seconds from the start)."""

    prompts: list[Prompt]
    output_lens: list[int]
    offsets_s: list[float]
    # Each job's response_format (None: free text); empty: every job free.
    formats: tuple[dict[str, Any] | None, ...] = ()
    # Each job's LoRA adapter (None: the base model); empty: every job the base model's.
    adapters: tuple[str | None, ...] = ()

    def __len__(self) -> int:
        return len(self.prompts)

    def format(self, i: int) -> dict[str, Any] | None:
        return self.formats[i] if self.formats else None

    def body(self, i: int, *, timeout_s: float) -> bytes:
        """The ``POST /v1/jobs`` body of job ``i``."""
        body = {"prompt": self.prompts[i].text, "max_tokens": self.output_lens[i],
                "temperature": 0, "ignore_eos": True, "timeout_s": timeout_s}
        if (fmt := self.format(i)) is not None:
            body["response_format"] = fmt
        if self.adapters and (adapter := self.adapters[i]) is not None:
            body["lora"] = adapter
        return json.dumps(body).encode()


def exact_prompt(encode: Callable[[str], list[int]], n: int, rng: random.Random) -> Prompt:
    """Random words that ``encode`` turns into exactly ``n`` tokens."""
    for _ in range(50):
        text = _words_below(encode, n, rng)
        ids = encode(text)
        while len(ids) < n:
            grown = next(((t, e) for f in FILLERS if len(e := encode(t := text + f)) == len(ids)
                          + 1), None)
            if grown is None:
                break
            text, ids = grown
        if len(ids) == n:
            return Prompt(text, tuple(ids))
    raise ValueError(f"could not build a prompt of exactly {n} tokens for this tokenizer")


def _words_below(encode: Callable[[str], list[int]], n: int, rng: random.Random) -> str:
    """The longest run of random words (added a few at a time, then one by one) that stays
    below ``n`` tokens; may be empty for tiny ``n``."""
    words: list[str] = []
    step = max(1, n // 8)
    while step:
        more = [rng.choice(WORDS) for _ in range(step)]
        if len(encode(" ".join(words + more))) < n:
            words += more
        else:
            step //= 2
    return " ".join(words) or rng.choice(WORDS)[:1]


def lengths(count: int, fixed: int, span: tuple[int, int] | None,
            rng: random.Random) -> list[int]:
    """``count`` lengths: ``fixed``, or uniform over ``span`` (inclusive) when given."""
    if span is None:
        return [fixed] * count
    return [rng.randint(span[0], span[1]) for _ in range(count)]


def poisson_offsets(rate: float, rng: random.Random, *, count: int | None = None,
                    duration_s: float | None = None) -> list[float]:
    """Open-loop arrivals: exponential gaps at ``rate``/s, the first at 0; ``count`` of them,
    or as many as fall within ``duration_s``."""
    offsets, t = [], 0.0
    while (count is None or len(offsets) < count) and (duration_s is None or t < duration_s):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


# The ``quote`` workload's instruction: the words after it are what the model repeats (the
# shape where prompt-lookup speculation finds its drafts: edits and summaries of a given text).
QUOTE_ASK = "Repeat the following words exactly, in the same order:\n\n"


def build_work(encode: Callable[[str], list[int]], offsets_s: list[float], *, input_len: int,
               output_len: int, input_span: tuple[int, int] | None,
               output_span: tuple[int, int] | None, seed: int, quote: bool = False) -> Work:
    """``quote``: each prompt is ``QUOTE_ASK`` then its random words (the whole still exactly
    its length in tokens)."""
    rng = random.Random(seed)
    n = len(offsets_s)
    ins = lengths(n, input_len, input_span, rng)
    outs = lengths(n, output_len, output_span, rng)
    if not quote:
        return Work([exact_prompt(encode, k, rng) for k in ins], outs, offsets_s)
    prompts = [exact_prompt(lambda text: encode(QUOTE_ASK + text), k, rng) for k in ins]
    return Work([Prompt(QUOTE_ASK + p.text, p.token_ids) for p in prompts], outs, offsets_s)
