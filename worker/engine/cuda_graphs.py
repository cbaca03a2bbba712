"""Decode steps replayed from CUDA graphs: one capture per batch size, static input buffers.

A decode step of a large model on a GPU launches a few hundred small kernels; launching them
one by one from Python costs more than running them at small batch sizes. The decoder captures
the model's forward (embedding, every layer, final norm) once per batch size in
``capture_sizes`` and replays it: a step is then a few host-to-device copies into the static
buffers, one graph launch, the LM head (one large matrix product, left outside so no graph keeps
a [batch, vocab] output alive) and the copy of the sampled tokens back.

A batch pads up to the next captured size. Padding rows hold token 0 at position 0, a slot of -1
(the KV store skips it) and a context of one token read from block 0: finite values whose
outputs are never read. Attention takes its split count per captured size from the longest
context the engine allows, since the graph cannot depend on this step's lengths.

With LoRA slots, each size is captured a second time with adapters: each row's slot is one
more static buffer (padding rows: no adapter), and the rows' sorted layout is computed inside
the graph. Steps without adapters replay the first graph, which runs the base model alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidegate.kernels import ops
from tidegate.kernels.cpu.paged_attention import padded_tables
from tidegate.kernels.gpu.paged_attention_triton import default_num_splits
from tidegate.kernels.ops import lora_rows
from tidegate.kernels.reference.lora import NO_ADAPTER
from tidegate.worker.models.decoder import DecoderModel, LayerAttention
from tidegate.worker.models.lora_weights import LoraBatch, LoraWeights


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, multiples of 16 up to 256, of 64 beyond; ``max_batch`` always included."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, min(max_batch, 256), 16)) + list(range(256, max_batch, 64))
    return [*sizes, max_batch]


class GraphDecodeAttention:
    """Attention backend inside a captured decode step: every tensor is a static buffer."""

    def __init__(self, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                 num_splits: int) -> None:
        self.kv_cache = kv_cache
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.slot_mapping = slot_mapping
        self.scale = scale
        self.num_splits = num_splits

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, rope_cache: torch.Tensor, spec: LayerAttention
               ) -> torch.Tensor:
        key_cache, value_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        q, k = ops.rotary_store_kv(q, k, v, positions, rope_cache, key_cache, value_cache,
                                   self.slot_mapping)
        return ops.paged_decode(q, key_cache, value_cache, self.block_tables, self.seq_lens,
                                spec.scale, self.num_splits, window=spec.window,
                                softcap=spec.softcap)

    def paged_layer(self, layer: int) -> None:
        return None  # captured steps run op by op (the whole-layer kernel is the CPU's)

    def paged_stack(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [batch, hidden] final hidden states, written by every replay


class CudaGraphDecoder:
    """Captures decode steps for ``capture_sizes(max_batch)`` and runs batches through them."""

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, *, block_size: int,
                 max_batch: int, max_model_len: int, scale: float,
                 lora: LoraWeights | None = None) -> None:
        device = kv_cache.device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need the model and KV cache on a CUDA device")
        self.model = model
        self.block_size = block_size
        self.max_batch = max_batch
        self.width = -(-max_model_len // block_size)  # block-table columns
        self.sizes = capture_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, self.width, dtype=torch.int32, device=device)
        self.adapters = torch.full((max_batch,), NO_ADAPTER, dtype=torch.long, device=device)
        # Pinned staging: the step's inputs go up in one asynchronous copy per buffer.
        self._host = {
            name: torch.zeros_like(buf, device="cpu").pin_memory()
            for name, buf in self._buffers().items()
        }
        self._graphs: dict[tuple[int, bool], _Captured] = {}
        pool = None
        num_kv_heads = model.cfg.num_kv_heads
        variants = (False, True) if lora is not None else (False,)
        with torch.inference_mode():
            for b in sorted(self.sizes, reverse=True):  # largest first: later ones reuse its pool
                attn = GraphDecodeAttention(
                    kv_cache, self.block_tables[:b], self.seq_lens[:b], self.slot_mapping[:b],
                    scale, default_num_splits(max_model_len, b, num_kv_heads))
                for with_lora in variants:

                    def step(b: int = b, attn: GraphDecodeAttention = attn,
                             with_lora: bool = with_lora) -> torch.Tensor:
                        batch = None
                        if with_lora:
                            assert lora is not None
                            batch = LoraBatch(lora, lora_rows(self.adapters[:b], lora.num_slots))
                        return model(self.input_ids[:b], self.positions[:b], attn, batch)

                    stream = torch.cuda.Stream(device)
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        step()  # compiles the Triton kernels, warms cuBLAS outside the capture
                    torch.cuda.current_stream(device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = step()
                    pool = graph.pool()
                    self._graphs[(b, with_lora)] = _Captured(graph, hidden)
        torch.cuda.synchronize(device)
        # Marks the end of the last run's copies out of the pinned staging buffers.
        self._staged = torch.cuda.Event()
        self._staged.record(torch.cuda.current_stream(device))

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions,
                "slot_mapping": self.slot_mapping, "seq_lens": self.seq_lens,
                "block_tables": self.block_tables, "adapters": self.adapters}

    def padded_size(self, batch: int) -> int | None:
        """The captured size a batch runs at, or None if it is larger than any."""
        return next((b for b in self.sizes if b >= batch), None)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            block_tables: list[list[int]],
            fill: Callable[[torch.Tensor], None] | None = None,
            adapters: list[int] | None = None) -> torch.Tensor:
        """One decode token per sequence -> final hidden states [B, hidden] (a view of a static
        buffer, valid until the next run). ``fill``, if given, writes into the step's input ids
        on the device (tokens the host does not know yet) before the replay. ``adapters``:
        each sequence's LoRA slot (``NO_ADAPTER``: none), or None when no sequence has one."""
        n = len(input_ids)
        b = self.padded_size(n)
        if b is None or n == 0:
            raise ValueError(f"batch of {n} is outside the captured sizes 1..{self.max_batch}")
        host = self._host
        # The previous run may still be queued behind an earlier step (async scheduling
        # launches a step before reading the last): its copies must leave the staging
        # buffers before they are overwritten. Almost always done already.
        self._staged.synchronize()
        host["input_ids"][:n] = torch.tensor(input_ids)
        host["positions"][:n] = torch.tensor(positions)
        host["slot_mapping"][:n] = torch.tensor(slots)
        host["seq_lens"][:n] = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        with_lora = adapters is not None
        if with_lora:
            if (b, True) not in self._graphs:
                raise ValueError("these graphs were captured without LoRA slots")
            host["adapters"][:n] = torch.tensor(adapters)
            host["adapters"][n:b] = NO_ADAPTER
        tables = host["block_tables"]
        padded = padded_tables(block_tables)
        w = padded.shape[1]
        if w > self.width:
            raise ValueError(f"a block table of {w} blocks exceeds the captured {self.width}")
        tables[:n, :w] = padded
        # Padding rows: a skipped store and a one-token context in block 0.
        host["input_ids"][n:b] = 0
        host["positions"][n:b] = 0
        host["slot_mapping"][n:b] = -1
        host["seq_lens"][n:b] = 1
        tables[n:b] = 0
        for name, buf in self._buffers().items():
            if name != "adapters" or with_lora:
                buf[:b].copy_(host[name][:b], non_blocking=True)
        self._staged.record(torch.cuda.current_stream(self.input_ids.device))
        if fill is not None:
            fill(self.input_ids[:n])
        captured = self._graphs[(b, with_lora)]
        captured.graph.replay()
        return captured.hidden[:n]
