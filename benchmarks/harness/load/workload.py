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
import math
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


# The chat-like mix (``chat_lengths``): a job is one turn of a conversation and carries the turns
# before it. Averages from LMSYS-Chat-1M's statistics (Zheng et al., 2023, table 1: 2.0 turns a
# conversation, 69.5 tokens a user prompt, 214.5 a response); each drawn lognormal with these
# spreads (ours: a long tail of pasted documents and long answers), the turn index geometric.
CHAT_TURNS_MEAN = 2.0
CHAT_PROMPT_MEAN, CHAT_PROMPT_SIGMA = 69.5, 1.2
CHAT_RESPONSE_MEAN, CHAT_RESPONSE_SIGMA = 214.5, 0.9


def lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw of the given mean (mu = ln(mean) - sigma^2 / 2)."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def chat_lengths(count: int, rng: random.Random, *, input_span: tuple[int, int] | None = None,
                 output_span: tuple[int, int] | None = None, scale: float = 1.0
                 ) -> tuple[list[int], list[int]]:
    """(input, output) lengths of ``count`` chat turns: turn j of a conversation (j geometric,
    mean ``CHAT_TURNS_MEAN``) sends the j - 1 earlier prompts and responses and its own prompt,
    and gets one response. ``scale`` multiplies every prompt and response (longer chats: a
    system prompt, documents pasted in); spans clip the results."""
    ins, outs = [], []
    for _ in range(count):
        turn = 1
        while rng.random() > 1 / CHAT_TURNS_MEAN:
            turn += 1
        history = sum(lognormal(rng, CHAT_PROMPT_MEAN, CHAT_PROMPT_SIGMA)
                      + lognormal(rng, CHAT_RESPONSE_MEAN, CHAT_RESPONSE_SIGMA)
                      for _ in range(turn - 1))
        prompt = history + lognormal(rng, CHAT_PROMPT_MEAN, CHAT_PROMPT_SIGMA)
        ins.append(_clip(round(scale * prompt), input_span))
        outs.append(_clip(round(scale * lognormal(rng, CHAT_RESPONSE_MEAN, CHAT_RESPONSE_SIGMA)),
                          output_span))
    return ins, outs


def _clip(n: int, span: tuple[int, int] | None) -> int:
    lo, hi = span if span is not None else (1, 1 << 30)
    return min(max(n, lo, 1), hi)


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
               output_span: tuple[int, int] | None, seed: int, quote: bool = False,
               chat_scale: float | None = None, shared_share: float = 0.0,
               shared_len: int = 0) -> Work:
    """``quote``: each prompt is ``QUOTE_ASK`` then its random words (the whole still exactly
    its length in tokens). ``chat_scale``: lengths from ``chat_lengths`` (the spans clip them)
    instead of fixed or uniform ones. ``shared_share`` of the jobs (every k-th, evenly spread)
    begin with one system prompt of ``shared_len`` tokens, the same for all of them (a
    deployment's instructions), their random words after it; their lengths are at least
    ``shared_len`` + 1."""
    rng = random.Random(seed)
    n = len(offsets_s)
    if chat_scale is not None:
        ins, outs = chat_lengths(n, rng, input_span=input_span, output_span=output_span,
                                 scale=chat_scale)
    else:
        ins = lengths(n, input_len, input_span, rng)
        outs = lengths(n, output_len, output_span, rng)
    head = QUOTE_ASK if quote else ""
    system = exact_prompt(encode, shared_len, random.Random(seed ^ 0x5157)).text + "\n" \
        if shared_share > 0 and shared_len > 0 else ""
    prompts = []
    for i, k in enumerate(ins):
        shared = bool(system) and int((i + 1) * shared_share) > int(i * shared_share)
        lead = (system if shared else "") + head
        if not lead:
            prompts.append(exact_prompt(encode, k, rng))
            continue
        floor = len(encode(lead)) + 1 if shared else k
        p = exact_prompt(lambda text, lead=lead: encode(lead + text), max(k, floor), rng)
        prompts.append(Prompt(lead + p.text, p.token_ids))
    return Work(prompts, outs, offsets_s)
