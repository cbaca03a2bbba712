"""Batched sampling: filters, greedy rows, and per-request seeds independent of the batch."""

from __future__ import annotations

import torch

from worker.sampler import Sampler, SamplingBatch


def batch(n: int, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
          seeds: list[int] | None = None) -> SamplingBatch:
    seeds = seeds or list(range(n))
    return SamplingBatch(
        temperature=torch.full((n,), temperature),
        top_p=torch.full((n,), top_p),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        generators=[None if temperature == 0 else torch.Generator().manual_seed(s) for s in seeds],
    )


def test_greedy_and_top_k_one_are_argmax() -> None:
    logits = torch.randn(6, 50)
    assert torch.equal(Sampler()(logits, batch(6, temperature=0)), logits.argmax(-1))
    assert torch.equal(Sampler()(logits, batch(6, top_k=1)), logits.argmax(-1))


def test_top_p_keeps_only_the_nucleus() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two only.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(400, 1)
    picked = Sampler()(logits, batch(400, top_p=0.7, seeds=list(range(400))))
    assert set(picked.tolist()) == {0, 1}
    share0 = (picked == 0).float().mean().item()
    assert 0.55 < share0 < 0.70  # 0.5 / 0.8 renormalised = 0.625


def test_top_k_limits_the_choice() -> None:
    logits = torch.zeros(300, 10)
    logits[:, 7] = 1.0
    logits[:, 2] = 0.9
    picked = Sampler()(logits, batch(300, top_k=2, seeds=list(range(300))))
    assert set(picked.tolist()) == {2, 7}


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 100)
    others = torch.randn(5, 100)
    alone = [Sampler()(row, batch(1, seeds=[42])).item()]
    gen = torch.Generator().manual_seed(42)
    crowd = SamplingBatch(
        temperature=torch.tensor([0.0, 1.0, 0.7, 1.0, 1.0, 1.0]),
        top_p=torch.ones(6), top_k=torch.zeros(6, dtype=torch.long),
        generators=[None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2),
                    gen, torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)],
    )
    mixed = torch.cat([others[:3], row, others[3:]])
    assert Sampler()(mixed, crowd)[3].item() == alone[0]
