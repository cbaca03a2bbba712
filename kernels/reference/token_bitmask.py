"""Grammar token masks applied to logits: the plain-torch reference.

A mask row holds one bit per vocabulary entry, packed little-endian into int32 words (bit
``t % 32`` of word ``t // 32`` allows token ``t``), as llguidance and xgrammar write them.
Only constrained rows carry a mask: ``rows`` [C] names each mask's logits row; every logit of a
disallowed token (and of ids past the mask's width) becomes -inf. The Triton version is
``tidegate.kernels.gpu.token_bitmask_triton``; ``tidegate.kernels.ops.apply_token_bitmask`` picks one.
"""

from __future__ import annotations

import torch


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: torch.Tensor) -> None:
    """In place: logits [N, V] float32, bitmask [C, W] int32, rows [C] int64 (distinct)."""
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [C, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # [C, 32W]
    width = allowed.shape[1]
    if width < vocab:  # ids past the mask are never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - width)], 1)
    selected = logits.index_select(0, rows)
    logits.index_copy_(0, rows, selected.masked_fill(~allowed[:, :vocab], float("-inf")))
