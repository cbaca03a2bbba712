"""``DraftVerifier``: which drafted tokens a request keeps, from the target model's logits.

A speculative request's chunk is its last token and ``k`` drafted ones; the model's logits at
those k + 1 positions are the target's next-token distributions after each prefix. Every
position's token is picked exactly as plain decoding picks it, and a draft is kept while it
equals that token: greedy takes the argmax; sampling draws each position's token with the
request's own random stream, one draw per position as the sampler makes one per token (the
exponential race). The first position whose token differs from its draft (or the one after the
last draft) gives the last token of the step. So the tokens are plain decoding's, token for
token, for greedy and seeded requests alike, and a request's stream is left where plain
decoding leaves it: speculation on or off, a continued (migrated) request, or a step with fewer
drafts all draw the same. A proposer that names one token per position is a one-hot draft
distribution, and keeping it exactly when the target's own draw picks it is rejection sampling
with acceptance p(d) (Leviathan et al. / Chen et al.), the best possible for such drafts.
"""

from __future__ import annotations

import torch

from tidegate.worker.engine.sampler import (
    GREEDY_BELOW,
    Sampler,
    SamplingRow,
    probabilities,
    race,
    row_argmax,
)


class DraftVerifier:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(self, logits: torch.Tensor, row: SamplingRow, draft: list[int]) -> list[int]:
        """logits [k + 1, V] float32 at the chunk's positions, ``draft`` its k drafted tokens
        -> the kept drafts and one token more (1 to k + 1 tokens)."""
        k = len(draft)
        if logits.shape[0] != k + 1:
            raise ValueError(f"{logits.shape[0]} logits rows for {k} drafts")
        if row.params.temperature < GREEDY_BELOW:
            return _kept(row_argmax(logits).tolist(), draft)
        probs = probabilities(logits, [row.params] * (k + 1))
        gen = self.sampler.generator(row, logits.shape[-1])
        uniform = torch.empty_like(probs)
        states: list[torch.Tensor] = []
        for j in range(k + 1):  # row by row, as the sampler draws: the same stream
            uniform[j].uniform_(generator=gen)
            states.append(gen.get_state())
        tokens = _kept(race(probs, uniform).tolist(), draft)
        # Positions past the last token were drawn for nothing: give their draws back.
        gen.set_state(states[len(tokens) - 1])
        return tokens


def _kept(picked: list[int], draft: list[int]) -> list[int]:
    """The drafts while each equals the token picked at its position, then the picked token
    at the first miss (or after the last draft)."""
    for i, token in enumerate(draft):
        if picked[i] != token:
            return picked[: i + 1]
    return picked[: len(draft) + 1]
