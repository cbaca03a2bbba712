"""Turns the scheduler's step into flat tensors, runs the model over the paged cache, samples.

The step's tokens from every scheduled chunk go through one forward pass as a flat batch:
token ids, positions, slot mapping (where each token's key and value are stored), block tables,
context lengths and query start offsets. Attention, the KV store and the other operations go
through ``tidegate.kernels.ops``; only the chunks that reach their sequence's end are sampled. A step
whose requests use LoRA adapters gets their slots from the ``LoraManager`` (copying in those
not resident) and hands the model each row's slot; a step without any runs the base model
alone, as if LoRA were off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tidegate.kernels import ops
from tidegate.kernels.cpu.native_cpu import native_kernels
from tidegate.kernels.cpu.paged_attention import (
    PagedAttentionMetadata,
    PagedLayer,
    PagedStack,
    upload,
)
from tidegate.kernels.ops import lora_rows
from tidegate.kernels.reference.lora import NO_ADAPTER
from tidegate.worker.engine.grammar_masks import TokenMask
from tidegate.worker.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from tidegate.worker.engine.lora_manager import LoraManager
from tidegate.worker.engine.sampler import Sampler, SamplerLaunch, SamplerOutput
from tidegate.worker.engine.scheduler import ScheduledChunk, SchedulerOutput
from tidegate.worker.engine.sequence import Sequence
from tidegate.worker.models.decoder import DecoderModel, LayerAttention
from tidegate.worker.models.lora_weights import LoraBatch

# A sampled chunk of up to this many tokens may run in the decode graphs, a row per token
# (a draft model's catch-up after its drafts were kept: the last draft and the target's token).
GRAPH_CHUNK_TOKENS = 4


def slot_of(table: list[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's token: its block (through the table), then the offset."""
    return table[position // block_size] * block_size + position % block_size


class PagedAttention:
    """The model's attention backend for one step over the paged cache."""

    def __init__(self, kv_cache: torch.Tensor, meta: PagedAttentionMetadata, scale: float):
        self.kv_cache = kv_cache  # [L, 2, num_blocks, block_size, Hk, D]
        self.meta = meta
        self.scale = scale

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        positions: torch.Tensor, rope_cache: torch.Tensor, spec: LayerAttention,
    ) -> torch.Tensor:
        key_cache, value_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        q, k = ops.rotary_store_kv(q, k, v, positions, rope_cache, key_cache, value_cache,
                                   self.meta.slot_mapping)
        return ops.paged_attention(q, key_cache, value_cache, self.meta, spec.scale,
                                   window=spec.window, softcap=spec.softcap)

    def paged_layer(self, layer: int) -> PagedLayer:
        return self.paged_stack().layer(layer)

    def paged_stack(self) -> PagedStack:
        return PagedStack(self.kv_cache, self.meta, self.scale)


@dataclass(frozen=True, slots=True)
class StepLogits:
    """A queued forward pass: the logits of its sampling rows (on the device) and their
    sequences, in order."""

    logits: torch.Tensor  # [S, V] float32
    rows: list[Sequence]

    def spans(self) -> list[tuple[Sequence, int, int]]:
        """Each sampling request with its rows of ``logits``, [start, end): one row, or a
        verify chunk's k + 1 (its last token and its k drafts)."""
        out: list[tuple[Sequence, int, int]] = []
        row = 0
        for seq in self.rows:
            n = 1 + len(seq.draft)
            out.append((seq, row, row + n))
            row += n
        return out


@dataclass(frozen=True, slots=True)
class ModelInput:
    """One step's flat batch."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: PagedAttentionMetadata
    sample_rows: torch.Tensor  # [S] int64: the flat row of each sampling chunk's last token


class PipelineLink(Protocol):
    """A pipeline stage's links (``tidegate.worker.parallel.model_group.ModelGroup``)."""

    sends_tokens: bool  # the last stage's first shard: it hands rank 0 the sampled tokens
    receives_tokens: bool  # rank 0

    def send_next(self, x: torch.Tensor) -> None: ...

    def recv_previous(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def send_tokens(self, out: SamplerOutput) -> None: ...

    def recv_tokens(self) -> SamplerOutput: ...


class ModelRunner:
    # A runner of one process: the engine keeps one step in flight at a time, and no other
    # rank follows it (a parallel worker's rank 0 wraps it: ``tidegate.worker.parallel``).
    pipeline_depth = 0
    ranks = 1

    def __init__(self, model: DecoderModel, spec: KVCacheSpec, *, max_model_len: int | None = None,
                 cuda_graph_max_batch: int = 0, kv_dtype: torch.dtype | None = None,
                 lora: LoraManager | None = None, stage: PipelineLink | None = None) -> None:
        """``cuda_graph_max_batch`` > 0 (CUDA only): capture decode steps of up to that many
        sequences, each context up to ``max_model_len`` tokens, in CUDA graphs (with
        ``lora``, each size twice: without adapters and with). ``kv_dtype``: the cache's
        element type (default the model's). ``stage``: the links of a pipeline stage
        (``tidegate.worker.parallel``): the residual stream comes from the stage before and goes to the
        next, the last stage samples and hands the tokens to rank 0; steps run eagerly."""
        self.model = model
        self.lora = lora
        self.stage = stage
        if stage is not None:
            cuda_graph_max_batch = 0
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_spec = spec
        self.block_size = spec.block_size
        self.kv_cache = allocate_kv_cache(model.cfg, spec, kv_dtype or self.dtype, self.device)
        self.scale = model.cfg.head_dim ** -0.5
        self.sampler = Sampler(self.device)
        # Build (or load) the native CPU kernels now, not inside the first step a job waits on.
        if self.device.type == "cpu" and self.dtype == torch.float32:
            native_kernels()
        self.graphs = None
        if cuda_graph_max_batch > 0 and self.device.type == "cuda":
            from tidegate.worker.engine.cuda_graphs import CudaGraphDecoder

            self.graphs = CudaGraphDecoder(
                model, self.kv_cache, block_size=self.block_size, max_batch=cuda_graph_max_batch,
                max_model_len=max_model_len or model.cfg.max_position_embeddings,
                scale=self.scale, lora=None if lora is None else lora.weights)

    def run(self, sched: SchedulerOutput, block_tables: list[list[int]],
            mask: TokenMask | None = None) -> SamplerOutput:
        """Compute every scheduled chunk; sample the next token of each sampling chunk."""
        return self.sample(self.forward(sched, block_tables), mask)()

    def launch(self, sched: SchedulerOutput, block_tables: list[list[int]],
               previous: SamplerLaunch | None = None) -> SamplerLaunch:
        """``run`` without the final wait: the step is queued (asynchronously on a GPU) and the
        returned launch reads its sampled tokens back.

        ``previous``: the step launched before, its tokens not read back yet. A decode whose
        input token it sampled (still pending in the sequence) takes that token on the device,
        so this step is queued without waiting for the previous one."""
        return self.sample(self.forward(sched, block_tables, previous))

    def forward(self, sched: SchedulerOutput, block_tables: list[list[int]],
                previous: SamplerLaunch | None = None) -> StepLogits:
        """Queue the step's forward pass (as ``launch``); its sampling is left to ``sample``,
        so grammar masks can be computed on the host meanwhile."""
        rows = [c.seq for c in sched.chunks if c.samples]
        if self.stage is not None:
            return self._forward_stage(sched, block_tables, rows)
        fill = self._pending_inputs(sched, previous)
        adapters = self._adapter_slots(sched)
        if self.graphs is not None and self._graph_step(sched):
            hidden = self._graph_forward(sched, block_tables, fill, adapters)
            if any(c.num_tokens > 1 + len(c.seq.draft) for c in sched.chunks):
                hidden = hidden[self._sample_rows(sched)]
            return StepLogits(self.model.compute_logits(hidden), rows)
        inp = self.prepare(sched, block_tables)
        if fill is not None:
            fill(inp.input_ids)
        lora = None
        if adapters is not None:
            assert self.lora is not None
            index = [slot for c, slot in zip(sched.chunks, adapters, strict=True)
                     for _ in range(c.num_tokens)]
            lora = LoraBatch(self.lora.weights, lora_rows(
                upload(index, torch.long, self.device), self.lora.num_slots))
        hidden = self.model(inp.input_ids, inp.positions,
                            PagedAttention(self.kv_cache, inp.meta, self.scale), lora)
        return StepLogits(self.model.compute_logits(hidden[inp.sample_rows]), rows)

    def _graph_forward(self, sched: SchedulerOutput, block_tables: list[list[int]],
                       fill: Callable[[torch.Tensor], None] | None,
                       adapters: list[int] | None) -> torch.Tensor:
        """A step of decodes and verify chunks through the captured decode graphs: each of a
        verify chunk's tokens is a row of its own, at its position, over the chunk's block
        table. Every row's key and value are stored before any row attends, so row i sees
        the chunk's tokens up to its own: the causal attention of the chunk, and the graph
        of its row count replays the whole step. -> final hidden states, one row per token."""
        inputs: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []  # each token's adapter slot
        bs = self.block_size
        for k, (chunk, table) in enumerate(zip(sched.chunks, block_tables, strict=True)):
            end = chunk.start + chunk.num_tokens
            inputs += ([_first_input(chunk)] if chunk.num_tokens == 1
                       else chunk.seq.ids_between(chunk.start, end))
            span = range(chunk.start, end)
            positions += span
            slots += [slot_of(table, p, bs) for p in span]
            tables += [table] * chunk.num_tokens
            if adapters is not None:
                rows += [adapters[k]] * chunk.num_tokens
        assert self.graphs is not None
        return self.graphs.run(inputs, positions, slots, tables, fill=fill,
                               adapters=rows if adapters is not None else None)

    def _forward_stage(self, sched: SchedulerOutput, block_tables: list[list[int]],
                       rows: list[Sequence]) -> StepLogits:
        """A pipeline stage's share of the step: its layers over the stream the stage before
        sent (the first stage: the token ids), then on to the next stage, or (the last) the
        logits."""
        assert self.stage is not None
        inp = self.prepare(sched, block_tables)
        stream = (None if self.model.partition is None or self.model.partition.first
                  else self.stage.recv_previous((inp.input_ids.shape[0], self.model.cfg.hidden_size),
                                                self.dtype))
        out = self.model(inp.input_ids, inp.positions,
                         PagedAttention(self.kv_cache, inp.meta, self.scale), None, stream)
        if not self.model.is_last_stage:
            self.stage.send_next(out)
            return StepLogits(out.new_empty(0), rows)
        return StepLogits(self.model.compute_logits(out[inp.sample_rows]), rows)

    def _adapter_slots(self, sched: SchedulerOutput) -> list[int] | None:
        """Each chunk's adapter slot (``NO_ADAPTER`` for the base model), its adapters made
        resident; None when no chunk has an adapter."""
        if self.lora is None:
            return None
        names = [c.seq.adapter for c in sched.chunks if c.seq.adapter is not None]
        if not names:
            return None
        slots = self.lora.slots_for(names)
        return [NO_ADAPTER if c.seq.adapter is None else slots[c.seq.adapter]
                for c in sched.chunks]

    def sample(self, step: StepLogits, mask: TokenMask | None = None) -> SamplerLaunch:
        """Queue the sampling of a forward pass's logits, ``mask`` applied first. A pipeline's
        last stage samples and sends rank 0 the tokens (its first shard does); rank 0 reads
        them from there; the other stages have nothing to sample."""
        if self.stage is None:
            return self.sampler.launch(step.logits, step.rows, mask)
        ids = [row.request_id for row in step.rows]
        none = torch.empty(0, dtype=torch.long, device=self.device)
        if self.model.is_last_stage:
            launch = self.sampler.launch(step.logits, step.rows, mask)
            if self.stage.sends_tokens:
                self.stage.send_tokens(launch())
            return launch
        if self.stage.receives_tokens:
            stage = self.stage
            return SamplerLaunch(ids, none, stage.recv_tokens)
        return SamplerLaunch(ids, none, lambda: SamplerOutput([], []))

    def _pending_inputs(self, sched: SchedulerOutput, previous: SamplerLaunch | None
                        ) -> Callable[[torch.Tensor], None] | None:
        """What writes the step's pending input tokens into its flat ``input_ids`` on the
        device, from ``previous``'s sampled tokens; None when every input is known."""
        at: list[int] = []  # flat input rows
        source: list[int] = []  # their rows in previous.token_ids
        row_of: dict[str, int] = {}
        offset = 0
        for chunk in sched.chunks:
            seq = chunk.seq
            known = seq.num_known + len(seq.draft)  # drafts are inputs too
            if chunk.start + chunk.num_tokens > known:
                # Only a decode can read a pending token: the one its last step sampled.
                if previous is None or chunk.num_tokens != 1:
                    raise RuntimeError(f"{seq.request_id}: input token {chunk.start} unknown")
                row_of = row_of or {rid: i for i, rid in enumerate(previous.request_ids)}
                at.append(offset)
                source.append(row_of[seq.request_id])
            offset += chunk.num_tokens
        if not at:
            return None
        assert previous is not None
        tokens = previous.token_ids

        def fill(input_ids: torch.Tensor) -> None:
            index = upload([at, source], torch.long, input_ids.device)  # [2, P]
            input_ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))

        return fill

    def _graph_step(self, sched: SchedulerOutput) -> bool:
        """A step of decodes, verify chunks and short final chunks only (each sampled; a
        draft model's catch-up), its tokens within the captured sizes."""
        assert self.graphs is not None
        chunks = sched.chunks
        return (0 < sum(c.num_tokens for c in chunks) <= self.graphs.max_batch
                and all(c.samples and c.num_tokens <= max(GRAPH_CHUNK_TOKENS,
                                                          1 + len(c.seq.draft))
                        for c in chunks))

    def _sample_rows(self, sched: SchedulerOutput) -> torch.Tensor:
        """The flat rows whose logits are sampled: each sampling chunk's last token, and a
        verify chunk's drafts before it."""
        rows: list[int] = []
        end = 0
        for chunk in sched.chunks:
            end += chunk.num_tokens
            if chunk.samples:
                rows += range(end - 1 - len(chunk.seq.draft), end)
        return upload(rows, torch.long, self.device)

    def prepare(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        bs = self.block_size
        for chunk, table in zip(sched.chunks, block_tables, strict=True):
            end = chunk.start + chunk.num_tokens
            if chunk.num_tokens == 1:
                ids.append(_first_input(chunk))
            else:
                ids += chunk.seq.ids_between(chunk.start, end)
            span = range(chunk.start, end)
            positions += span
            slots += [slot_of(table, p, bs) for p in span]
            if chunk.samples:
                # A verify chunk (its last token and drafts) needs logits at every position.
                sample_rows += range(len(ids) - 1 - len(chunk.seq.draft), len(ids))
            seq_lens.append(end)
            query_lens.append(chunk.num_tokens)
        meta = PagedAttentionMetadata.build(
            block_tables=block_tables, seq_lens=seq_lens, query_lens=query_lens,
            slot_mapping=slots, device=self.device,
        )
        dev = self.device
        return ModelInput(upload(ids, torch.long, dev), upload(positions, torch.long, dev), meta,
                          upload(sample_rows, torch.long, dev))

    def free(self, request_id: str) -> None:
        self.sampler.free(request_id)

    def stop(self) -> None:
        """Nothing to stop: no other rank follows this runner."""


def _first_input(chunk: ScheduledChunk) -> int:
    """The chunk's first input token; 0 stands in for one still pending (filled on device)."""
    seq = chunk.seq
    return seq.token_at(chunk.start) if chunk.start < seq.num_known else 0
