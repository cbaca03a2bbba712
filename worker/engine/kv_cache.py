"""The paged KV cache's memory: sizing it from a budget and allocating its one tensor.

Layout: ``[num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]``; the
block manager decides which blocks each request owns, the kernels read and write them. The
CPU's 8-bit cache ("int8") is int8 with ``head_dim + 4`` bytes per head: the head's values
rounded to 8 bits, then their float32 scale (``tidegate.kernels.cpu.paged_attention``), 3.8x fewer bytes per
token than float32, so a decode step at batch 32 streams a third of the memory.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from tidegate.kernels.cpu.native_cpu import native_kernels
from tidegate.kernels.dispatch import kernel_mode
from tidegate.worker.models.config import ModelConfig

GIB = 1 << 30
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
DEFAULT_CPU_KV_GB = 2.0
DEFAULT_CUDA_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def gib(self) -> float:
        return self.num_blocks * self.bytes_per_block / GIB

    def describe(self) -> str:
        return (f"KV cache: {self.gib:.2f} GiB = {self.num_blocks} blocks x {self.block_size} "
                f"tokens = {self.num_tokens} tokens")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype, device: torch.device
                         ) -> torch.dtype:
    """The cache's element type: the model's ("auto"), float8 e4m3 ("fp8"), which only the
    Triton attention and store kernels read and write (CUDA), or 8-bit heads with their scales
    ("int8"), which only the native CPU kernels read and write (float32 models)."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        if device.type != "cpu" or model_dtype != torch.float32 or native_kernels() is None:
            raise ValueError("kv_cache_dtype int8 needs a float32 model on the CPU and the "
                             f"native kernels (device {device}, {model_dtype}, "
                             f"TIDEGATE_KERNELS {kernel_mode()})")
        return torch.int8
    if name != "fp8":
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                         f"{name!r}")
    if device.type != "cuda" or kernel_mode() == "reference":
        raise ValueError("kv_cache_dtype fp8 needs a CUDA device and the Triton kernels "
                         f"(device {device}, TIDEGATE_KERNELS {kernel_mode()})")
    return torch.float8_e4m3fn


def head_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one cached head: its values, and in an int8 cache their float32 scale."""
    if dtype == torch.int8:
        return cfg.head_dim + 4
    return cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * head_bytes(cfg, dtype)


def plan_kv_cache(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, *, block_size: int = 16,
    kv_cache_gb: float | None = None, memory_fraction: float | None = None,
    num_blocks: int | None = None,
) -> KVCacheSpec:
    """How many blocks to allocate: explicit, or a GiB budget, or a fraction of free memory.

    Defaults: 2 GiB on the CPU; on CUDA, ``memory_fraction`` (0.9) of the memory free now
    (after the weights are loaded).
    """
    per_block = bytes_per_block(cfg, block_size, dtype)
    if num_blocks is None:
        if kv_cache_gb is None and device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = free * (memory_fraction or DEFAULT_CUDA_FRACTION)
        else:
            budget = (kv_cache_gb if kv_cache_gb is not None else DEFAULT_CPU_KV_GB) * GIB
        num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget holds no block of {per_block} bytes")
    return KVCacheSpec(num_blocks, block_size, per_block)


def allocate_kv_cache(
    cfg: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The cache, zeroed rather than empty: padding lanes in batched kernels may read unused
    slots.

    On the CPU it is an anonymous memory map, which the kernel hands out as zero pages and
    commits page by page as blocks are first written: a worker starts without writing its
    whole budget (``torch.zeros`` spent ~1 s on the default 2 GiB) and holds only the memory
    its requests have used.
    """
    row = cfg.head_dim + 4 if dtype == torch.int8 else cfg.head_dim
    shape = (cfg.num_layers, 2, spec.num_blocks, spec.block_size, cfg.num_kv_heads, row)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    # The tensor holds the map (frombuffer keeps its buffer alive) and its pages are aligned.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
