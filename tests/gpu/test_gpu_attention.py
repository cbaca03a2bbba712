"""The Triton paged attention kernels in bfloat16 on a real GPU, at the model's shapes.

Compared with ``paged_attention_ref`` in float32 on the same bfloat16 inputs by relative error
||out - ref|| / ||ref|| (bfloat16 keeps 8 bits: 1e-2 leaves room for its rounding but not for a
wrong row). Every cache slot no sequence owns is NaN, so a stray read fails. Last, the decode
kernel is captured in a CUDA graph and replayed with other context lengths, as the model's
decode step runs it.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.conftest import BF16_REL_ERR, rel_err
from tidegate.kernels import ops
from tidegate.kernels.cpu.paged_attention import PagedAttentionMetadata, paged_attention_ref
from tidegate.kernels.gpu.paged_attention_triton import (
    default_num_splits,
    paged_attention_triton,
    paged_decode_attention_triton,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HQ, HK, D = 32, 8, 128
BLOCK_SIZE = 16
MAX_CONTEXT = 2048


def paged_step(
    seqs: list[tuple[int, int]], *, width: int | None = None, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """(q, key_cache, value_cache, meta) in bfloat16 for (seq_len, query_len) per sequence,
    decodes first; each sequence owns ``width`` shuffled blocks (default: what it needs),
    every other slot (block 0, unwritten tails) is NaN."""
    rng = random.Random(seed)
    need = [-(-(width * BLOCK_SIZE if width else n) // BLOCK_SIZE) for n, _ in seqs]
    num_blocks = sum(need) + 1
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(k)] for k in need]
    owned = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool)
    for (n, _), table in zip(seqs, tables, strict=True):
        span = max(n, width * BLOCK_SIZE if width else 0)
        pos = torch.arange(span)
        owned[torch.tensor(table)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE] = True
    caches = []
    for _ in range(2):
        cache = torch.randn(num_blocks * BLOCK_SIZE, HK, D, device="cuda", dtype=torch.bfloat16)
        cache[~owned.cuda()] = float("nan")
        caches.append(cache.view(num_blocks, BLOCK_SIZE, HK, D))
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for (n, q), t in zip(seqs, tables, strict=True) for p in range(n - q, n)]
    meta = PagedAttentionMetadata.build(tables, [n for n, _ in seqs], [q for _, q in seqs],
                                        slots, device="cuda")
    q = torch.randn(meta.num_tokens, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, caches[0], caches[1], meta


def reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              meta: PagedAttentionMetadata) -> torch.Tensor:
    return paged_attention_ref(q.float(), key_cache.float(), value_cache.float(), meta,
                               D**-0.5)


def decode_contexts(batch: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    edge = [1, BLOCK_SIZE, MAX_CONTEXT, MAX_CONTEXT - 1]
    return [(n, 1) for n in edge + [rng.randint(1, MAX_CONTEXT) for _ in range(batch - 4)]]


@pytest.mark.parametrize(("batch", "num_splits"), [(64, None), (64, 4), (4, None)])
def test_decode_bf16_matches_float32_reference(batch: int, num_splits: int | None) -> None:
    q, kc, vc, meta = paged_step(decode_contexts(batch, seed=batch))
    splits = num_splits or default_num_splits(meta.max_seq_len, batch, HK)
    out = paged_decode_attention_triton(q, kc, vc, meta.block_tables, meta.seq_lens,
                                        D**-0.5, splits)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_err(out, reference(q, kc, vc, meta)) < BF16_REL_ERR


def test_prefill_chunks_after_cached_prefixes_bf16() -> None:
    # Four 512-token chunks after 1024 cached tokens, one without a prefix.
    q, kc, vc, meta = paged_step([(1536, 512)] * 4 + [(512, 512)], seed=1)
    out = paged_attention_triton(q, kc, vc, meta, D**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(q, kc, vc, meta)) < BF16_REL_ERR


def test_mixed_step_through_ops_bf16() -> None:
    q, kc, vc, meta = paged_step(decode_contexts(48, seed=2) + [(1536, 512), (700, 300)], seed=2)
    out = ops.paged_attention(q, kc, vc, meta, D**-0.5)
    assert torch.isfinite(out).all()
    ref = reference(q, kc, vc, meta)
    nd = meta.num_decodes
    assert rel_err(out[:nd], ref[:nd]) < BF16_REL_ERR
    assert rel_err(out[nd:], ref[nd:]) < BF16_REL_ERR


def test_decode_replays_in_a_cuda_graph_with_new_context_lengths() -> None:
    batch, width = 32, MAX_CONTEXT // BLOCK_SIZE
    # Every sequence owns blocks for the longest context, as a captured batch's tables do.
    q, kc, vc, meta = paged_step([(MAX_CONTEXT, 1)] * batch, width=width, seed=3)
    splits = default_num_splits(MAX_CONTEXT, batch, HK)
    assert splits > 1  # the graph covers the combine kernel too
    seq_lens = meta.seq_lens.clone()

    def step() -> torch.Tensor:
        return paged_decode_attention_triton(q, kc, vc, meta.block_tables, seq_lens,
                                             D**-0.5, splits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    rng = random.Random(4)
    for lens in ([rng.randint(1, MAX_CONTEXT) for _ in range(batch)], [1] * batch,
                 [MAX_CONTEXT - 3 * i for i in range(batch)]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        replay_meta = PagedAttentionMetadata.build(
            meta.block_tables.tolist(), lens, [1] * batch, [0] * batch, device="cuda")
        assert torch.isfinite(out).all()
        assert rel_err(out, reference(q, kc, vc, replay_meta)) < BF16_REL_ERR
