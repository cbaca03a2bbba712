"""A contiguous per-sequence KV cache and the attention backend that reads it.

Each sequence owns one growable tensor per layer; a step's attention loops over the sequences
in the batch (the matmuls around it stay batched). The paged cache replaces this layout behind
the same ``AttentionBackend`` interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class ContiguousKVCache:
    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.shape = (num_layers, 2, num_kv_heads)
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self._kv: dict[str, torch.Tensor] = {}  # id -> [L, 2, Hk, capacity, D]

    def reserve(self, seq_id: str, length: int) -> None:
        """Make room for ``length`` tokens, doubling so appends are amortised O(1)."""
        kv = self._kv.get(seq_id)
        capacity = 0 if kv is None else kv.shape[3]
        if length <= capacity:
            return
        new_cap = max(length, 2 * capacity, 64)
        grown = torch.empty(*self.shape, new_cap, self.head_dim, dtype=self.dtype,
                            device=self.device)
        if kv is not None:
            grown[:, :, :, :capacity] = kv
        self._kv[seq_id] = grown

    def free(self, seq_id: str) -> None:
        self._kv.pop(seq_id, None)

    def layer(self, seq_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv[seq_id][layer]
        return kv[0], kv[1]  # each [Hk, capacity, D]

    def __len__(self) -> int:
        return len(self._kv)


@dataclass(frozen=True, slots=True)
class SeqSlice:
    seq_id: str
    start: int  # position of the slice's first token = tokens already cached
    length: int  # tokens of this sequence in the step
    offset: int  # where they sit in the flat batch


class ContiguousAttention:
    """Attention for one step over a ``ContiguousKVCache``: stores k/v, then attends."""

    def __init__(self, cache: ContiguousKVCache, slices: list[SeqSlice]) -> None:
        self.cache = cache
        self.slices = slices

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for s in self.slices:
            end = s.start + s.length
            rows = slice(s.offset, s.offset + s.length)
            k_cache, v_cache = self.cache.layer(s.seq_id, layer)
            k_cache[:, s.start : end] = k[rows].transpose(0, 1)
            v_cache[:, s.start : end] = v[rows].transpose(0, 1)
            mask = None
            if s.length > 1:  # query i sees every cached key and new keys up to itself
                mask = torch.ones(s.length, end, dtype=torch.bool, device=q.device).tril(s.start)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k_cache[:, :end], v_cache[:, :end],
                attn_mask=mask, enable_gqa=True,
            )
            out[rows] = o.transpose(0, 1)
        return out
