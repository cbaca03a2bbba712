"""Grammar token masks applied to logits on the GPU: one program per (masked row, column block)
reads its packed words once and writes -inf over the disallowed logits in place.

Same result as ``tidegate.kernels.reference.token_bitmask.apply_token_bitmask_ref``; rows without a mask are not
touched, so a batch of mostly free requests pays only for its constrained rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program: 32 words of bits


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, words, logits_stride,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    word_index = cols // 32
    word = tl.load(bitmask_ptr + i.to(tl.int64) * words + word_index,
                   mask=word_index < words, other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    ptrs = logits_ptr + row * logits_stride + cols
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), tl.float32),
             mask=(cols < vocab) & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                               rows: torch.Tensor) -> None:
    """In place: logits [N, V] float32, bitmask [C, W] int32, rows [C] int64 (distinct)."""
    count = rows.numel()
    if count == 0:
        return
    vocab = logits.shape[1]
    bitmask = bitmask.contiguous()
    grid = (count, triton.cdiv(vocab, BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, rows, vocab, bitmask.shape[1],
                                logits.stride(0), BLOCK=BLOCK)
