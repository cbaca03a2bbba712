"""``DraftVerifier``: which drafted tokens a request keeps, from the target model's logits.

A speculative request's chunk is its last token and ``k`` drafted ones; the model's logits at
those k + 1 positions are the target's next-token distributions after each prefix. Greedy: the
drafts are kept while each equals the argmax after the prefix before it, then the argmax at the
first miss (or after the last draft) is the extra token, exactly the tokens plain decoding
gives. Sampling: draft ``d`` at a position is kept with probability p(d) (a proposer that names
one token is a one-hot draft distribution, so min(1, p/q) is p); at the first rejection the
token is drawn from p with ``d`` taken out, renormalised, and after the last draft one more from
p. Each kept or drawn token is then distributed exactly as plain sampling's (the rejection
sampling of Leviathan et al. / Chen et al.); all draws come from the request's own generator,
so a seeded request gives the same tokens again.
"""

from __future__ import annotations

import torch

from worker.engine.sampler import GREEDY_BELOW, Sampler, SamplingRow, probabilities, row_argmax


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
            best = row_argmax(logits).tolist()
            out: list[int] = []
            for i, token in enumerate(draft):
                if best[i] != token:
                    return [*out, best[i]]
                out.append(token)
            return [*out, best[k]]
        vocab = logits.shape[-1]
        probs = probabilities(logits, [row.params] * (k + 1))
        probs = probs / probs.sum(dim=-1, keepdim=True)
        gen = self.sampler.generator(row, vocab)
        accept = torch.rand(k, generator=gen, device=probs.device).tolist() if k else []
        out = []
        for i, token in enumerate(draft):
            if accept[i] < float(probs[i, token]):
                out.append(token)
                continue
            residual = probs[i].clone()
            residual[token] = 0.0
            return [*out, _draw(residual, gen)]
        return [*out, _draw(probs[k], gen)]


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """One token with probability proportional to ``p`` [V] (the exponential race)."""
    uniform = torch.rand(p.shape, generator=gen, device=p.device)
    noise = uniform.clamp_min_(torch.finfo(uniform.dtype).tiny).log_().neg_()
    return int(row_argmax((p / noise)[None])[0])
