"""The KV cache's memory on the CPU: zeroed, and committed only where blocks are written."""

from __future__ import annotations

import resource

import pytest
import torch

from tidegate.worker.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from tidegate.worker.models.config import ModelConfig

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=16)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8,
                                   torch.float8_e4m3fn])
def test_the_cpu_cache_is_zeroed_in_its_layout(dtype: torch.dtype) -> None:
    kv = allocate_kv_cache(CFG, KVCacheSpec(32, 16, 0), dtype, torch.device("cpu"))
    row = CFG.head_dim + 4 if dtype == torch.int8 else CFG.head_dim
    assert kv.shape == (CFG.num_layers, 2, 32, 16, CFG.num_kv_heads, row)
    assert kv.dtype == dtype and kv.is_contiguous()
    assert not kv.view(torch.uint8).any()
    kv[1, 0, 3].fill_(1)  # writable, and each block its own memory
    written = kv.view(torch.uint8).reshape(-1, kv.itemsize).any(dim=1)  # per element
    assert written.sum() == 16 * CFG.num_kv_heads * row


def test_a_large_cpu_cache_costs_memory_only_where_written() -> None:
    """A 4 GiB budget: the process's peak resident memory grows by what was written, not by
    the budget (torch.zeros would write every byte up front)."""
    blocks = (4 << 30) // (CFG.num_layers * 2 * 16 * CFG.num_kv_heads * CFG.head_dim * 4)
    before = peak_rss_mib()
    kv = allocate_kv_cache(CFG, KVCacheSpec(blocks, 16, 0), torch.float32, torch.device("cpu"))
    assert kv.nbytes >= 4 << 30
    kv[:, :, :64].fill_(0.5)  # 64 blocks of every layer: 2 MiB
    assert kv[:, :, :64].eq(0.5).all() and not kv[:, :, 64:128].any()
    assert peak_rss_mib() - before < 256
