"""``DraftModelSpeculator``: drafts from a smaller model that shares the target's tokenizer.

The draft model runs on the target's device with its own paged KV cache (its own block
manager, prefix caching included) and its own ``ModelRunner``, so its decode steps replay CUDA
graphs as the target's do. Each step it drafts for every request that wants drafts, batched:
one catch-up pass over each request's tokens the draft has not computed (the whole prompt the
first time; after that the target's last token, and the last draft when all were kept), whose
last position gives the first draft, then one decode pass per further draft. Drafts are the
draft model's argmax: a one-hot proposal, which the verifier keeps exactly when the target picks
it (``tidegate.worker.speculative.draft_verifier``).

The draft's cache holds a request's tokens followed by its drafts. Before drafting again, the
speculator compares what it computed with the request's tokens now: positions up to the first
difference (a rejected draft) stay, the rest are computed again, so a rejected draft's slot is
simply overwritten. Only positions that hold the request's real tokens are ever registered in
the draft's prefix cache. A request the draft cache has no room for gets no drafts this step
(requests not drafting this step give their draft blocks back first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidegate.worker.engine.block_manager import BlockManager
from tidegate.worker.engine.model_runner import ModelRunner
from tidegate.worker.engine.sampler import row_argmax
from tidegate.worker.engine.scheduler import ScheduledChunk, SchedulerOutput
from tidegate.worker.engine.sequence import Sequence


@dataclass(slots=True)
class _DraftState:
    """What the draft's cache holds for one request: ``shadow.prompt_ids`` are the tokens
    it was last given (the request's, then its drafts), the first ``computed`` of them in
    the cache."""

    shadow: Sequence
    computed: int


class DraftModelSpeculator:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, num_tokens: int,
                 vocab_size: int) -> None:
        """``runner``: the draft model's runner over its own cache, managed by ``blocks``;
        ``vocab_size``: the target's (a draft with a larger, padded vocabulary never
        proposes ids the target does not have)."""
        if num_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        self.runner = runner
        self.blocks = blocks
        self.num_tokens = num_tokens
        self.vocab_size = vocab_size
        self._states: dict[str, _DraftState] = {}
        self.passes = 0  # draft forward passes run (catch-up and decode)

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Drafts for each (request, limit): up to ``min(num_tokens, limit)`` tokens after
        the request's tokens so far, in one batched pass per draft position."""
        drafts: list[list[int]] = [[] for _ in wanted]
        live: list[tuple[int, _DraftState, int]] = []  # (index in wanted, state, k)
        keep = {seq.request_id for seq, _ in wanted}
        for i, (seq, limit) in enumerate(wanted):
            k = min(self.num_tokens, limit)
            state = self._state_for(seq, k, keep) if k > 0 else None
            if state is not None:
                live.append((i, state, k))
        if not live:
            return drafts
        # Catch-up: each request's uncomputed tokens; the last position gives draft 1.
        chunks = []
        for _, state, _ in live:
            shadow = state.shadow
            chunks.append(ScheduledChunk(shadow, state.computed,
                                         len(shadow.prompt_ids) - state.computed, True))
        tokens = self._pass(chunks)
        for (i, _, _), token in zip(live, tokens, strict=True):
            drafts[i].append(token)
        for step in range(1, max(k for _, _, k in live)):
            going = [(i, state) for i, state, k in live if k > step]
            chunks = []
            for i, state in going:
                shadow = state.shadow
                shadow.prompt_ids.append(drafts[i][-1])
                chunks.append(ScheduledChunk(shadow, len(shadow.prompt_ids) - 1, 1, True))
            for (i, _), token in zip(going, self._pass(chunks), strict=True):
                drafts[i].append(token)
        for _, state, _ in live:
            state.computed = len(state.shadow.prompt_ids)
        return drafts

    def forget(self, request_id: str) -> None:
        """The request finished: its draft blocks go back."""
        if self._states.pop(request_id, None) is not None:
            self.blocks.free(request_id)

    def _state_for(self, seq: Sequence, k: int, keep: set[str]) -> _DraftState | None:
        """The request's draft state, its valid computed prefix found and its cache grown to
        hold its tokens and k - 1 drafts; None when the draft cache has no room."""
        rid = seq.request_id
        tokens = seq.all_ids()
        need = len(tokens) + k - 1  # the last draft is proposed, never computed
        state = self._states.get(rid)
        if state is None:
            if not self._make_room(lambda: self.blocks.can_allocate(tokens, need), keep):
                return None
            computed = self.blocks.allocate(rid, tokens, need)
            state = self._states[rid] = _DraftState(_shadow(seq, tokens), computed)
        else:
            old = state.shadow.prompt_ids
            valid = 0
            limit = min(state.computed, len(tokens))
            while valid < limit and old[valid] == tokens[valid]:
                valid += 1
            state.shadow.prompt_ids = tokens
            state.computed = valid
            if not self.blocks.holds(rid, need):
                if not self._make_room(lambda: self.blocks.can_append(rid, need), keep):
                    return None
                self.blocks.append_slot(rid, need)
        # The last token is always computed: its logits give the first draft.
        state.computed = min(state.computed, len(tokens) - 1)
        # Full blocks of the request's own tokens may serve later prompts.
        self.blocks.commit(rid, tokens, state.computed)
        return state

    def _make_room(self, fits: Callable[[], bool], keep: set[str]) -> bool:
        """Whether ``fits()`` holds, giving back the blocks of requests not drafting now
        first if it does not."""
        if fits():
            return True
        for rid in [r for r in self._states if r not in keep]:
            self.forget(rid)
        return fits()

    def _pass(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One draft forward pass over the chunks -> each chunk's next-token argmax."""
        sched = SchedulerOutput()
        for chunk in chunks:
            sched.add(chunk)
        tables = [self.blocks.block_table(c.seq.request_id) for c in chunks]
        with torch.inference_mode():
            logits = self.runner.forward(sched, tables).logits
        self.passes += 1
        return row_argmax(logits[:, : self.vocab_size]).tolist()


def _shadow(seq: Sequence, tokens: list[int]) -> Sequence:
    """The draft's view of a request: its tokens as a prompt the draft runner reads."""
    return Sequence(request_id=seq.request_id, prompt_ids=tokens, params=seq.params,
                    detokenizer=seq.detokenizer, seed=seq.seed, arrival=seq.arrival)
