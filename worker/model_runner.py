"""Turns the sequences of one step into flat tensors, runs the model and samples.

Each scheduled sequence contributes the tokens not yet in its cache (the whole prompt when it
joins, one token per decode step afterwards); all of them go through one forward pass.
"""

from __future__ import annotations

import torch

from worker.kv_cache import ContiguousAttention, ContiguousKVCache, SeqSlice
from worker.models.llama import LlamaModel
from worker.sampler import Sampler, SamplingBatch
from worker.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.cfg
        self.cache = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                       self.dtype, self.device)
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    def run(self, seqs: list[Sequence]) -> list[int]:
        """Compute every sequence's uncached tokens and sample each one's next token."""
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        for seq in seqs:
            new = seq.all_ids()[seq.num_computed :]
            slices.append(SeqSlice(seq.request_id, seq.num_computed, len(new), len(ids)))
            ids.extend(new)
            positions.extend(range(seq.num_computed, seq.num_tokens))
            self.cache.reserve(seq.request_id, seq.num_tokens)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        hidden = self.model(as_tensor(ids), as_tensor(positions),
                            ContiguousAttention(self.cache, slices))
        last_rows = as_tensor([s.offset + s.length - 1 for s in slices])
        logits = self.model.compute_logits(hidden[last_rows])
        return self.sampler(logits, self._sampling_batch(seqs)).tolist()

    def free(self, request_id: str) -> None:
        self.cache.free(request_id)
        self._generators.pop(request_id, None)

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        params = [s.params for s in seqs]
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], device=self.device),
            top_p=torch.tensor([p.top_p for p in params], device=self.device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=self.device),
            generators=[self._generator(s) if s.params.temperature > 0 else None for s in seqs],
        )

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seq.seed)
            self._generators[seq.request_id] = gen
        return gen
