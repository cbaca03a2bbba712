"""Batched token sampling: temperature, top-k, top-p, per-request seeds.

The whole batch is filtered with a handful of tensor ops on one sort. Each request draws its
randomness from its own generator (the exponential-race form of categorical sampling:
argmax(p / E) with E ~ Exp(1)), so a seeded request picks the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling parameters for one step, aligned with the logits' rows."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_p: torch.Tensor  # [N] float32 in (0, 1]
    top_k: torch.Tensor  # [N] int64; 0 = off
    generators: list[torch.Generator | None]  # None for greedy rows

    @property
    def all_greedy(self) -> bool:
        return all(g is None for g in self.generators)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [N, V] float32 -> chosen token ids [N] int64."""
        greedy_ids = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_ids
        probs, order = self._filtered_probs(logits, batch)
        noise = torch.ones_like(probs)
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        picked = order.gather(1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
        return torch.where(batch.temperature == 0, greedy_ids, picked)

    @staticmethod
    def _filtered_probs(
        logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities over each row's tokens sorted by logit, outside top-k/top-p zeroed."""
        vocab = logits.shape[-1]
        temp = torch.where(batch.temperature > 0, batch.temperature, 1.0)
        sorted_logits, order = (logits / temp[:, None]).sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        top_k = torch.where(batch.top_k > 0, batch.top_k, vocab)
        drop = ranks[None, :] >= top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= batch.top_p[:, None]
        return sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1), order
