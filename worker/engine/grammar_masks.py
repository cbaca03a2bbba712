"""Each constrained request's grammar matcher, and a step's token masks.

``response_format`` compiles (``tidegate.structured.grammar``) to an llguidance grammar; here
it meets the model's tokenizer. A grammar seen before is not compiled again: a fresh matcher is
kept per grammar (least recently used dropped past ``cache_size``) and each request starts
from a copy of it. After every token a request's matcher advances; before every sampling the
masks of the step's constrained rows are computed in parallel (llguidance's thread pool, the
GIL released) into a pinned host buffer of packed bits, which the sampler uploads and applies
on the device (``tidegate.kernels.ops.apply_token_bitmask``). The engine computes them while the device
runs the step's forward pass, so they cost the step nothing while they take less time.
A matcher is never used by two threads at once: while ``fill_async`` runs, the engine touches
only the dict of matchers, never a matcher.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from tidegate.model_files.tokenizer import Tokenizer

log = logging.getLogger("tidegate.engine")

# From this many rows on, matchers advance in parallel (below, the pool's hand-off costs more).
PARALLEL_CONSUME_ROWS = 16


class GrammarUnavailable(ValueError):
    """This model's tokenizer cannot drive the grammar engine, or a grammar does not compile."""


@dataclass(frozen=True, slots=True)
class TokenMask:
    """The step's masks: row ``rows[i]`` of the sampled batch may pick only the tokens whose
    bit is set in ``bits[i]`` (packed int32 words, bit t % 32 of word t // 32)."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), words] int32 on the host (pinned where CUDA is)


@dataclass(slots=True)
class MaskStats:
    fills: int = 0  # steps that computed masks
    rows: int = 0  # masks computed
    seconds: float = 0.0  # wall time computing them


class GrammarMasks:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, max_rows: int,
                 pin: bool = False, threads: int | None = None, cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.words = (vocab_size + 31) // 32
        self._max_rows = max_rows
        self._pin = pin
        self._threads = threads
        self._cache_size = cache_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # Two buffers, alternated: a step's masks may still be uploading while the next
        # step's are written (an overlapped step reads its tokens before the next fill).
        self._buffers: list[torch.Tensor] = []
        self._turn = 0
        self._thread: ThreadPoolExecutor | None = None
        self.stats = MaskStats()

    def prepare(self) -> None:
        """Build the tokenizer's token tables now (a second for a large vocabulary), not when
        the first constrained request arrives."""
        if self._ll_tokenizer is not None:
            return
        tok = self._tokenizer
        started = time.perf_counter()
        try:
            self._ll_tokenizer = llguidance.LLTokenizer(
                tok.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=sorted(tok.eos_token_ids))
        except Exception as exc:  # llguidance refuses tokenizers it cannot read
            raise GrammarUnavailable(
                f"this model's tokenizer cannot drive the grammar engine: {exc}") from exc
        self._executor = llguidance.LLExecutor(self._threads)
        self._buffers = [torch.empty((self._max_rows, self.words), dtype=torch.int32,
                                     pin_memory=self._pin) for _ in range(2)]
        log.info("grammar engine ready (llguidance %s, vocabulary %d) in %.2fs",
                 llguidance.__version__, self.vocab_size, time.perf_counter() - started)

    def check(self, grammar: str, generated: Sequence[int] = ()) -> None:
        """Raise ``GrammarUnavailable`` if the grammar does not compile for this tokenizer, or
        refuses the tokens already generated (a continued job)."""
        matcher = self._template(grammar)
        if generated and not matcher.deep_copy().consume_tokens(list(generated)):
            raise GrammarUnavailable("the tokens already generated break the grammar")

    def add(self, request_id: str, grammar: str, generated: Sequence[int] = ()) -> None:
        """Start the request's matcher, past the tokens it already generated (a continued
        job)."""
        matcher = self._template(grammar).deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise GrammarUnavailable(f"the tokens already generated break the grammar: "
                                     f"{matcher.get_error()}")
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def consume(self, request_id: str, token: int) -> bool:
        """Advance the request's matcher; False if the grammar refuses the token."""
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.consume_token(token)

    def consume_all(self, tokens: Sequence[tuple[str, int]]) -> list[bool]:
        """``consume`` for many requests at once: one call into llguidance's thread pool for a
        batch (one release of the GIL, not one per request)."""
        pairs = [(self._matchers[rid], token) for rid, token in tokens]
        if len(pairs) < PARALLEL_CONSUME_ROWS or self._executor is None:
            return [m.consume_token(t) for m, t in pairs]
        return self._executor.consume_token_par(pairs)

    def is_complete(self, request_id: str) -> bool:
        """The grammar can take no more tokens (a JSON document closed): the request ends."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_stopped()

    def error(self, request_id: str) -> str:
        matcher = self._matchers.get(request_id)
        return matcher.get_error() if matcher is not None else ""

    def fill(self, request_ids: Sequence[str]) -> TokenMask | None:
        """The masks of the constrained requests among a step's sampled rows (in row order);
        None when none is constrained."""
        pairs = [(m, k) for k, rid in enumerate(request_ids)
                 if (m := self._matchers.get(rid)) is not None]
        if not pairs:
            return None
        assert self._executor is not None
        started = time.perf_counter()
        count = len(pairs)
        if count > self._max_rows:
            raise ValueError(f"{count} constrained rows; at most {self._max_rows} a step")
        buffer = self._buffers[self._turn]
        self._turn ^= 1
        bits = buffer[:count]
        # Each matcher writes its mask at its position among the constrained rows.
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, (m, _) in enumerate(pairs)], bits.data_ptr(), self.words * 4, count)
        self.stats.fills += 1
        self.stats.rows += count
        self.stats.seconds += time.perf_counter() - started
        return TokenMask([k for _, k in pairs], bits)

    def fill_async(self, request_ids: Sequence[str]) -> Future[TokenMask | None]:
        """``fill`` on a helper thread (the CPU's forward pass runs meanwhile)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._thread.submit(self.fill, list(request_ids))

    def _template(self, grammar: str) -> llguidance.LLMatcher:
        matcher = self._templates.get(grammar)
        if matcher is not None:
            self._templates.move_to_end(grammar)
            return matcher
        self.prepare()
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarUnavailable(f"the grammar does not compile: {matcher.get_error()}")
        self._templates[grammar] = matcher
        if len(self._templates) > self._cache_size:
            self._templates.popitem(last=False)
        return matcher
