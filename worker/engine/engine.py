"""The continuous-batching engine: ``add_request``, ``abort``, ``step() -> outputs``.

Requests join at step boundaries and leave the moment they finish. Each step the scheduler picks
running decodes and prompt chunks under a token budget, the model runner computes them in one
forward pass over the paged KV cache, and the engine turns sampled tokens into outputs: text
released incrementally, stopped by EOS, stop token ids, stop strings or max_tokens.
A request with a ``response_format`` samples under its grammar's token mask, computed on the
host while the device runs the step's forward pass, and ends once its grammar is complete.
A request may name a LoRA adapter registered with ``add_adapter``: requests of different
adapters and of the base model share steps (``tidegate.worker.engine.lora_manager``).

Parallel execution and speculative decoding plug in through interfaces the engine owns: it is
handed the runner it steps through (``step_runner.StepRunner``; a parallel worker's rank 0
hands it one that drives the other ranks) and the parts it speculates with
(``speculation.SpeculationFactory``), and imports neither implementation.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tidegate.kernels.reference.lora import MAX_RANK
from tidegate.model_files.tokenizer import Tokenizer
from tidegate.protocol import FinishReason, SamplingParams
from tidegate.structured.grammar import GrammarError, grammar_of
from tidegate.worker.engine.block_manager import BlockManager
from tidegate.worker.engine.detokenizer import IncrementalDetokenizer
from tidegate.worker.engine.grammar_masks import GrammarMasks, GrammarUnavailable, TokenMask
from tidegate.worker.engine.kv_cache import (
    KV_CACHE_DTYPES,
    KVCacheSpec,
    bytes_per_block,
    kv_cache_torch_dtype,
    plan_kv_cache,
)
from tidegate.worker.engine.lora_manager import AdapterError, LoraManager
from tidegate.worker.engine.model_runner import ModelRunner, StepLogits
from tidegate.worker.engine.sampler import SamplerLaunch, TokenLogprobs, is_penalised
from tidegate.worker.engine.scheduler import (
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tidegate.worker.engine.sequence import SeqStatus, Sequence
from tidegate.worker.engine.speculation import (
    CountsPasses,
    Governor,
    Proposer,
    SpeculationFactory,
    Verifier,
)
from tidegate.worker.engine.step_runner import RankGroup, StepRunner
from tidegate.worker.models.decoder import DecoderModel
from tidegate.worker.models.lora_weights import LoraWeights

log = logging.getLogger("tidegate.engine")


def choice_id(request_id: str, choice: int) -> str:
    """The engine's id of a request's choice k > 0 (choice 0's is the request's own)."""
    return f"{request_id}#{choice}"


class RequestError(ValueError):
    """A request the engine can never run (empty, or too long for the context or the cache)."""


class ResumeError(RequestError):
    """A request to continue from tokens already generated that cannot continue from them (they
    do not give the text already sent, or they already end the request); it can start over."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_model_len: int
    max_num_seqs: int = 32
    # Tokens per step: every running decode plus prompt chunks up to this many.
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_gb: float | None = None  # None: 2 GiB on CPU, a fraction of free memory on CUDA
    kv_cache_memory_fraction: float | None = None
    num_blocks: int | None = None  # overrides the budgets above (tests, benchmarks)
    # "auto": the model's dtype; "fp8": float8 e4m3 (CUDA, Triton kernels), half of bf16's
    # bytes per token, so the same budget holds twice the tokens.
    kv_cache_dtype: str = "auto"
    prefix_caching: bool = True
    # CUDA only: replay decode steps from CUDA graphs (captured at start-up for batch sizes up to
    # max_num_seqs); False runs every step eagerly.
    cuda_graphs: bool = True
    # Detokenize and build a step's outputs while the next step runs on the device, instead of
    # before launching it. ``step()`` then returns the outputs of the step before the one it
    # launched (the same outputs, one call later); a stop string is found one step late, and
    # the extra token computed for that request is dropped. None: on for CUDA, off on the CPU
    # (where nothing runs asynchronously, so there is nothing to overlap).
    async_output: bool | None = None
    # Needs async_output. Launch each step before reading the previous step's tokens: a decode
    # takes its input token from the device, so the device never waits for the host to read
    # tokens, commit and schedule. Steps that cannot (a penalised request needs its generated
    # ids on the host) fall back to reading first. None: on exactly when async_output is.
    async_scheduling: bool | None = None
    # LoRA adapters resident on the device at once (0: adapters off) and the largest rank
    # served; their slots take memory beside the weights before the KV cache is planned.
    max_loras: int = 0
    max_lora_rank: int = 16
    # Speculative decoding: "ngram" (prompt lookup: drafts are what followed the last tokens'
    # latest earlier occurrence), "draft" (a draft model, given to the engine), None: off; a
    # speculative engine is handed its parts (tidegate.worker.speculative.speculative_engine).
    # Up to num_speculative_tokens drafts a step per request, verified in the step's one
    # forward pass (tidegate.worker.speculative); a step that speculates is read back before the
    # next is launched (with async_output, the step in flight is read back first; steps that
    # do not speculate overlap as usual). speculative_max_batch: speculate in steps of at
    # most this many running requests; None: wherever it measures faster
    # (SpeculationGovernor).
    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError("speculative must be ngram, draft or None, got "
                             f"{self.speculative!r}")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise ValueError("speculative_max_batch must be at least 1")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.max_loras < 0:
            raise ValueError("max_loras must not be negative")
        if not 1 <= self.max_lora_rank <= MAX_RANK:
            raise ValueError(f"max_lora_rank must be 1 to {MAX_RANK}")
        if self.async_scheduling and self.async_output is False:
            raise ValueError("async_scheduling needs async_output")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)  # validates both


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    lane: str = "interactive"
    priority: int = 0
    deadline_ms: int | None = None
    # Continue a request another engine began (a migrated job): the tokens it generated, and
    # the text released for them (checked: the same tokens must give the same text). Outputs
    # go on from index len(output_ids); penalties, stop strings and max_tokens count them.
    output_ids: tuple[int, ...] = ()
    output_text: str = ""
    # The request's RNG seed when its params have none (a migrated job must draw the same
    # stream); None: params.seed, else a random one.
    seed: int | None = None
    adapter: str | None = None  # a LoRA adapter registered with ``Engine.add_adapter``


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_id: int | None  # the token generated this step; None when finished without one
    index: int  # the token's position among generated tokens
    text: str  # text released this step (empty while a character or stop match is pending)
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    output_text: str  # all text released so far (the result, once finished)
    logprobs: TokenLogprobs | None = None
    choice: int = 0  # which of the request's n choices (request_id is the request's)


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0
    preemptions: int = 0
    # Steps launched before the previous step's tokens were read (async_scheduling).
    scheduled_ahead: int = 0
    # Pipeline parallelism: steps launched while an earlier one was still in the pipeline
    # (the stages worked on both at once).
    overlapped_steps: int = 0
    # Speculative decoding: tokens drafted, drafts kept, and verify chunks run (each gives
    # its kept drafts and one token more).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_chunks: int = 0
    # Steps that drafted (the governor chose to speculate), and draft-model passes.
    speculative_steps: int = 0
    draft_passes: int = 0


@dataclass(slots=True)
class _Sampled:
    token: int
    logprobs: TokenLogprobs | None = field(default=None)


# Verify chunks replay the decode graphs one row per token: graphs are captured for up to
# this many rows (or max_num_seqs, if larger); larger verify steps run eagerly.
MAX_VERIFY_GRAPH_ROWS = 1024


def build_runner(model: DecoderModel, config: EngineConfig, lora: LoraManager | None = None,
                 group: RankGroup | None = None, draft: DecoderModel | None = None
                 ) -> tuple[KVCacheSpec, ModelRunner, ModelRunner | None]:
    """The KV cache's plan, the model runner over it and (with ``draft``) the draft model's
    runner over its own cache. The budget is split so both caches hold the same number of
    blocks. In a parallel worker every rank calls this with its ``group``
    (``tidegate.worker.parallel``; rank 0 then hands its engine the runner wrapped) and the
    ranks agree on the smallest cache any of them can hold: block tables are the same on
    every rank."""
    param = next(model.parameters())
    kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, param.dtype, param.device)
    spec = plan_kv_cache(
        model.cfg, kv_dtype, param.device, block_size=config.block_size,
        kv_cache_gb=config.kv_cache_gb, memory_fraction=config.kv_cache_memory_fraction,
        num_blocks=config.num_blocks,
    )
    draft_per_block = (0 if draft is None else
                       bytes_per_block(draft.cfg, config.block_size, kv_dtype))
    if draft_per_block and config.num_blocks is None:
        spec = KVCacheSpec(spec.num_blocks * spec.bytes_per_block
                           // (spec.bytes_per_block + draft_per_block),
                           spec.block_size, spec.bytes_per_block)
    if group is not None:
        spec = KVCacheSpec(group.min_int(spec.num_blocks), spec.block_size,
                           spec.bytes_per_block)
    stage = group if group is not None and group.pp > 1 else None
    graph_rows = draft_rows = config.max_num_seqs if config.cuda_graphs else 0
    if config.speculative and graph_rows:
        # Verify chunks (1 + K rows each) of up to speculative_max_batch requests replay
        # graphs too, and so do a draft model's catch-ups (up to 2 rows each).
        spec_batch = min(config.max_num_seqs,
                         config.speculative_max_batch or config.max_num_seqs)
        graph_rows = max(graph_rows, min(spec_batch * (config.num_speculative_tokens + 1),
                                         MAX_VERIFY_GRAPH_ROWS))
        draft_rows = max(draft_rows, min(2 * spec_batch, MAX_VERIFY_GRAPH_ROWS))
    runner = ModelRunner(
        model, spec, kv_dtype=kv_dtype, max_model_len=config.max_model_len,
        cuda_graph_max_batch=graph_rows, lora=lora, stage=stage)
    draft_runner = None
    if draft is not None:
        draft_runner = ModelRunner(
            draft, KVCacheSpec(spec.num_blocks, spec.block_size, draft_per_block),
            kv_dtype=kv_dtype, max_model_len=config.max_model_len,
            cuda_graph_max_batch=draft_rows)
    return spec, runner, draft_runner


class Engine:
    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig, *,
                 runner: StepRunner | None = None, speculation: SpeculationFactory | None = None,
                 draft: DecoderModel | None = None) -> None:
        """``runner``: the runner to step through, built over the model by its owner (a
        parallel worker's rank 0: ``tidegate.worker.parallel.parallel_engine``); None: the
        engine's own ``ModelRunner``. ``speculation``: makes the parts a speculative engine
        steps with, given exactly when ``config.speculative`` is set
        (``tidegate.worker.speculative.speculative_engine`` builds such engines). ``draft``: the
        draft model of ``speculative="draft"``, on the model's device, sharing its
        tokenizer."""
        self.tokenizer = tokenizer
        self.config = config
        param = next(model.parameters())
        # A runner handed in was planned without the LoRA slots (they are made below).
        if runner is not None and config.max_loras:
            raise ValueError("LoRA adapters are not served by tensor- or pipeline-parallel "
                             "workers (max_loras must be 0)")
        # Before the KV cache is planned: the cache takes what memory is left.
        self.lora = (LoraManager(LoraWeights(model.cfg, config.max_loras, config.max_lora_rank,
                                             param.dtype, param.device))
                     if config.max_loras else None)
        if (config.speculative == "draft") != (draft is not None):
            raise ValueError('a draft model is given exactly when speculative is "draft"')
        if draft is not None and next(draft.parameters()).device != param.device:
            raise ValueError("the draft model must be on the model's device")
        # Drafts are verified with the engine's own runner's sampler.
        if config.speculative and runner is not None:
            raise ValueError("speculative decoding is not served by tensor- or pipeline-"
                             "parallel workers")
        if (config.speculative is not None) != (speculation is not None):
            raise ValueError("an engine is handed its speculation exactly when speculative is "
                             "set (tidegate.worker.speculative.speculative_engine builds one)")
        draft_runner = None
        if runner is None:
            _, runner, draft_runner = build_runner(model, config, self.lora, draft=draft)
        self.runner: StepRunner = runner
        self.kv_spec = runner.kv_spec
        log.info("%s", self.kv_spec.describe())
        self.blocks = BlockManager(self.kv_spec.num_blocks, config.block_size,
                                   prefix_caching=config.prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            config.max_loras), self.blocks)
        # Called by ``close``: a parallel worker's rank processes are waited for there.
        self.on_close: list[Callable[[], None]] = []
        self.stats = EngineStats()
        self.async_output = (config.async_output if config.async_output is not None
                             else param.device.type == "cuda")
        self.speculator: Proposer | None = None
        self.verifier: Verifier | None = None
        self.governor: Governor | None = None
        if speculation is not None:
            assert isinstance(runner, ModelRunner)  # the engine's own (checked above)
            parts = speculation(runner, draft_runner, self.kv_spec)
            self.speculator, self.verifier = parts.proposer, parts.verifier
            self.governor = parts.governor
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.async_output)
        if self.async_scheduling and not self.async_output:
            raise ValueError("async_scheduling needs async_output")
        # Pipeline parallelism: one step in flight per stage, each of other requests
        # (``_step_pipelined``); 0: the single-step paths.
        self.pipeline_depth = self.runner.pipeline_depth
        self._pipe: deque[tuple[SchedulerOutput, SamplerLaunch]] = deque()
        # The launched step whose tokens have not been read back yet (async_output only).
        self._inflight: tuple[SchedulerOutput, SamplerLaunch] | None = None
        # A launched forward pass whose sampling waits for grammar masks (async_output only).
        self._unsampled: tuple[SchedulerOutput, StepLogits] | None = None
        self.grammars = GrammarMasks(tokenizer, model.cfg.vocab_size,
                                     max_rows=config.max_num_seqs,
                                     pin=param.device.type == "cuda")
        self._seqs: dict[str, Sequence] = {}
        self._groups: dict[str, list[str]] = {}  # request id -> its choices' sequence ids
        self._aborted: dict[str, FinishReason] = {}
        self._arrivals = itertools.count()

    # ------------------------------------------------------------------ interface

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request: ``params.n`` sequences (choices), choice k's id ``<id>#k`` inside
        the engine, its outputs under the request's id with ``choice`` k."""
        grammar = self._check_limits(request)
        params = request.params
        seed = request.seed if request.seed is not None else params.seed
        seed = seed if seed is not None else secrets.randbits(63)
        first: Sequence | None = None
        ids = [request.request_id, *(choice_id(request.request_id, k) for k in range(1, params.n))]
        self._groups[request.request_id] = ids
        for k, rid in enumerate(ids):
            self._seqs[rid] = seq = Sequence(
                request_id=rid,
                prompt_ids=list(request.prompt_ids),
                params=params,
                detokenizer=self._resumed_detokenizer(request),
                seed=(seed + k) % 2**63,  # each choice its own stream, reproducible
                arrival=next(self._arrivals),
                # A continued request's tokens are computed again with its prompt (one
                # prefill), exactly as a preempted request's are.
                output_ids=list(request.output_ids),
                max_num_tokens=min(len(request.prompt_ids) + params.max_tokens,
                                   self.config.max_model_len),
                lane=request.lane,
                priority=request.priority,
                deadline_ms=request.deadline_ms,
                group_id=request.request_id,
                choice=k,
                waits_for=first if self.config.prefix_caching else None,
                adapter=request.adapter,
            )
            first = first or seq
            if grammar is not None:
                self.grammars.add(rid, grammar, request.output_ids)
            self.scheduler.add(seq)

    def add_adapter(self, name: str, path: str) -> None:
        """Register the LoRA adapter in the PEFT directory ``path`` as ``name`` (thread-safe:
        callable while another thread steps). A no-op if it is registered from that path
        already; ``AdapterError`` if it cannot be (unreadable, unsupported, not this model's,
        or adapters are off)."""
        if self.lora is None:
            raise AdapterError(f"adapter {name!r}: LoRA adapters are off on this worker "
                               "(max_loras is 0)")
        self.lora.add(name, path)

    def adapter_names(self) -> list[str]:
        """The registered adapters, by name."""
        return [] if self.lora is None else self.lora.names()

    def check_request(self, request: EngineRequest) -> None:
        """Raise ``RequestError`` for a request that could never run here (``ResumeError``
        for one whose tokens already generated cannot be continued from)."""
        self._check_limits(request)
        if request.output_ids:
            self._resumed_detokenizer(request)

    def _check_limits(self, request: EngineRequest) -> str | None:
        """Raise ``RequestError`` as ``check_request`` says; the request's grammar (None: free)."""
        n, max_tokens = len(request.prompt_ids), request.params.max_tokens
        if n == 0:
            raise RequestError("prompt is empty")
        if request.request_id in self._groups or request.request_id in self._seqs:
            raise RequestError(f"request {request.request_id} is already running")
        limit = self.config.max_model_len
        if n + 1 > limit:
            raise RequestError(f"prompt has {n} tokens; the model's context is {limit}")
        if n + max_tokens > limit:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the "
                               f"model's context of {limit} tokens")
        if n + max_tokens > self.kv_spec.num_tokens:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) can never fit in this "
                f"worker's KV cache of {self.kv_spec.num_tokens} tokens")
        if request.params.n > 1 and request.output_ids:
            raise RequestError("a request with n > 1 cannot continue from tokens")
        if request.adapter is not None and (self.lora is None or request.adapter not in self.lora):
            raise RequestError(f"adapter {request.adapter!r} is not loaded on this worker")
        grammar = self._grammar(request)
        if grammar is not None:
            try:
                self.grammars.check(grammar)
            except GrammarUnavailable as exc:
                raise RequestError(f"response_format: {exc}") from exc
            if request.output_ids:
                try:
                    self.grammars.check(grammar, request.output_ids)
                except GrammarUnavailable as exc:
                    raise ResumeError(str(exc)) from exc
        return grammar

    def _grammar(self, request: EngineRequest) -> str | None:
        try:
            return grammar_of(request.params.response_format)
        except GrammarError as exc:
            raise RequestError(f"response_format.{exc.path}: {exc.reason}") from exc

    def _resumed_detokenizer(self, request: EngineRequest) -> IncrementalDetokenizer:
        """The request's detokenizer, past its tokens already generated: it holds back what
        the first run held back, so the text goes on exactly as it would have."""
        params = request.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        if not request.output_ids:
            return detokenizer
        ids = request.output_ids
        if len(ids) >= params.max_tokens:
            raise ResumeError(f"its {len(ids)} tokens already reach max_tokens")
        ending = set(params.stop_token_ids)
        if not params.ignore_eos:
            ending |= set(self.tokenizer.eos_token_ids)
        if ending.intersection(ids):
            raise ResumeError("its tokens already hold a stop token")
        text = "".join(detokenizer.push(token) for token in ids)
        if detokenizer.stopped or text != request.output_text:
            raise ResumeError("its tokens do not give the text already sent")
        return detokenizer

    def abort(self, request_id: str, reason: FinishReason = "cancelled") -> None:
        """Stop a request (every choice) at the next step boundary, finishing with ``reason``."""
        for rid in self._groups.get(request_id, ()):
            if rid in self._seqs:
                self._aborted.setdefault(rid, reason)

    def close(self) -> None:
        """Send a parallel worker's other ranks out of their loop and wait for them (a no-op
        for a single process). Once only; the engine steps no more."""
        self.runner.stop()
        closers, self.on_close = self.on_close, []
        for close in closers:
            close()

    def reset_stats(self) -> None:
        """Zero the counters (after a warm-up that must not show in the metrics)."""
        for name in EngineStats.__dataclass_fields__:
            setattr(self.stats, name, 0)
        self.scheduler.prefix_query_tokens = self.scheduler.prefix_hit_tokens = 0
        self.blocks.stats.queried_tokens = self.blocks.stats.hit_tokens = 0

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or self._inflight is not None or bool(self._pipe)

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_backlogged(self) -> int:
        """Waiting requests, when the engine's last schedule had no room (KV blocks or a seat)
        for one of them; 0 when they wait only for the step's token budget or for another's
        prefill of their prompt (they run in the next steps)."""
        if not self.scheduler.out_of_room:
            return 0
        return max(0, len(self.scheduler.waiting) - self.scheduler.num_held)

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens admitted but not yet run through the model. A decoding
        request has one token to compute, its last; scheduling ahead, also the pending one
        whose id is not read yet: neither is prompt work (counting them, every decode looked
        like a two-token prompt to the intake, the shedder and the speculation governor)."""
        seqs = [*self.scheduler.running, *self.scheduler.waiting]
        return sum(left for s in seqs if (left := s.num_known - s.num_computed) > 1)

    def tokens_left(self) -> dict[str, int]:
        """Each request's remaining output budget (max_tokens minus what it generated, tokens
        still being sampled included)."""
        return {rid: s.params.max_tokens - len(s.output_ids) - s.num_pending
                for rid, s in self._seqs.items()}

    def step(self) -> list[RequestOutput]:
        aborted = sorted((self._seqs[r] for r in self._aborted if r in self._seqs),
                         key=lambda s: s.arrival)
        # Held-back text (a possible stop string's start) is dropped: no token carries it.
        outputs = [self._finish(seq, self._aborted[seq.request_id], None, "") for seq in aborted]
        self._aborted.clear()
        if self.pipeline_depth:
            return outputs + self._step_pipelined()
        if self.speculator is not None:
            return outputs + self._step_governed()
        if self.async_output:
            return outputs + self._step_overlapped()
        return outputs + self._step_plain(self._schedule())

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        return sched

    def _step_plain(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Compute the step, read its tokens back and build their outputs."""
        if not sched.chunks:
            return []
        sampled = self._forward_and_sample(sched)()
        self.scheduler.commit(sched)
        self._count(sched)
        sampling = [c.seq for c in sched.chunks if c.samples]
        return [self._advance(seq, _Sampled(token, lp))
                for seq, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs,
                                          strict=True)]

    def _step_governed(self) -> list[RequestOutput]:
        """A step of a speculative engine: drafts proposed when the governor says speculation
        pays at this batch size, and the step's speed reported back to it (steps with little
        prompt work only, at most a token per running request: more would blur the
        comparison). With async_output a step that does not speculate overlaps as usual; one
        that does first reads back the step in flight (drafts follow the tokens the host
        has)."""
        start = time.perf_counter()
        governor = self.governor
        assert governor is not None  # a speculative engine is handed one
        batch = len(self.scheduler.running)
        speculate = governor.speculate(batch)
        if self.async_output and not speculate:
            steady = self.pending_prefill_tokens <= batch
            outputs = self._step_overlapped()
            if steady and outputs:
                governor.record(batch, False, sum(o.token_id is not None for o in outputs),
                                     time.perf_counter() - start)
            return outputs
        drained = self._drain() if self.async_output else []
        start = time.perf_counter()
        batch = len(self.scheduler.running)
        if speculate:
            self.stats.speculative_steps += 1
            self._propose()
        sched = self._schedule()
        scheduled = {id(c.seq) for c in sched.chunks}
        for seq in self.scheduler.running:  # drafts of requests left out would go stale
            if seq.draft and id(seq) not in scheduled:
                seq.draft.clear()
        prompt_work = sum(c.num_tokens for c in sched.chunks
                          if not (c.samples and c.num_tokens == 1 + len(c.seq.draft)))
        decoding = bool(sched.chunks) and prompt_work <= batch
        verifying = any(c.samples and c.seq.draft for c in sched.chunks)
        outputs = self._step_speculative(sched) if verifying else self._step_plain(sched)
        # Counted as the way chosen, drafts or not (no n-gram may match): with async_output,
        # choosing to speculate costs the overlap even when nothing is drafted.
        if decoding and not sched.preempted:
            tokens = sum(1 for o in outputs if o.token_id is not None)
            governor.record(batch, speculate, tokens, time.perf_counter() - start)
        return drained + outputs

    def _drain(self) -> list[RequestOutput]:
        """Read back the step in flight (async_output) and build its outputs, launching none:
        every token is then on the host, as drafting needs."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        sched, launched = inflight
        self.scheduler.commit(sched)
        self._count(sched)
        return [self._emit(seq, sampled) for seq, sampled in self._read(sched, launched)]

    def _propose(self) -> None:
        """Draft tokens for each running request that decodes next and takes drafts: not
        constrained by a grammar, not penalised, biased or asking for logprobs (their
        sampling reads more than one distribution), with room before max_tokens."""
        assert self.speculator is not None
        wanted: list[tuple[Sequence, int]] = []
        for seq in self.scheduler.running:
            params = seq.params
            if (not params.speculative or seq.num_pending or seq.num_uncomputed != 1
                    or is_penalised(params)
                    or params.logit_bias or params.logprobs is not None
                    or seq.request_id in self.grammars):
                continue
            # k drafts give up to k + 1 tokens; the request's last must stay within its cap.
            cap = seq.max_num_tokens if seq.max_num_tokens is not None else 1 << 62
            room = cap - seq.num_known - 1
            if room > 0:
                wanted.append((seq, room))
        if not wanted:
            return
        for (seq, _), draft in zip(wanted, self.speculator.propose_all(wanted), strict=True):
            seq.draft.extend(draft)
        if isinstance(self.speculator, CountsPasses):
            self.stats.draft_passes = self.speculator.passes

    def _step_speculative(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """A step with verify chunks: plain rows are sampled as always; each verify chunk's
        drafts are kept or not (``DraftVerifier``), and its tokens go out one by one, so a
        stop, a stop string or max_tokens ends it exactly where plain decoding would. A
        request's computed tokens are its last known one and the drafts it kept."""
        verifier = self.verifier
        assert verifier is not None  # a speculative engine is handed one
        tables = [self.blocks.block_table(c.seq.request_id) for c in sched.chunks]
        with torch.inference_mode():
            step = self.runner.forward(sched, tables)
        chunk_of = {id(c.seq): c for c in sched.chunks}
        plain: list[int] = []  # logits rows of plain sampling chunks
        plain_seqs: list[Sequence] = []
        verify: list[tuple[ScheduledChunk, list[int], torch.Tensor]] = []
        for seq, start, end in step.spans():
            if seq.draft:
                verify.append((chunk_of[id(seq)], list(seq.draft), step.logits[start:end]))
            else:
                plain.append(start)
                plain_seqs.append(seq)
        masks = (self.grammars.fill_async([s.request_id for s in plain_seqs])
                 if self._constrained([s.request_id for s in plain_seqs]) else None)
        with torch.inference_mode():
            index = torch.tensor(plain, dtype=torch.long, device=step.logits.device)
            sampled = self.runner.sample(
                StepLogits(step.logits.index_select(0, index), plain_seqs),
                masks.result() if masks else None)()
            kept = [(chunk, draft, verifier.verify(logits, chunk.seq, draft))
                    for chunk, draft, logits in verify]
        verifying = {id(chunk) for chunk, _, _ in kept}
        rest = SchedulerOutput()
        for chunk in sched.chunks:
            if id(chunk) not in verifying:
                rest.add(chunk)
        self.scheduler.commit(rest)
        self._count(rest)
        outputs = [self._advance(seq, _Sampled(token, lp)) for seq, token, lp in
                   zip(plain_seqs, sampled.token_ids, sampled.logprobs, strict=True)]
        for chunk, draft, tokens in kept:
            seq = chunk.seq
            seq.draft.clear()
            self.stats.verify_chunks += 1
            self.stats.draft_tokens += len(draft)
            emitted = 0
            for token in tokens:
                outputs.append(self._advance(seq, _Sampled(token)))
                emitted += 1
                if seq.status is SeqStatus.FINISHED:
                    break
            else:  # computed: its last known token and the drafts it kept
                done = SchedulerOutput()
                done.add(ScheduledChunk(seq, chunk.start, len(tokens), True))
                self.scheduler.commit(done)
            # The tokens it gave: those after a stop are dropped, never generated.
            self.stats.accepted_tokens += emitted - 1
            self.stats.decode_tokens += emitted
        return outputs

    def _forward_and_sample(self, sched: SchedulerOutput) -> SamplerLaunch:
        """Queue the step's forward pass and its sampling; its grammar masks are computed on
        a helper thread while the forward pass runs."""
        tables = [self.blocks.block_table(c.seq.request_id) for c in sched.chunks]
        sampling_ids = [c.seq.request_id for c in sched.chunks if c.samples]
        masks = (self.grammars.fill_async(sampling_ids) if self._constrained(sampling_ids)
                 else None)
        with torch.inference_mode():
            step = self.runner.forward(sched, tables)
            return self.runner.sample(step, masks.result() if masks else None)

    def _step_overlapped(self) -> list[RequestOutput]:
        """Read back the launched step and launch the next; build the first one's outputs
        while the device computes the second.

        Scheduling ahead, the next step is launched before the tokens are read: each request
        the read step sampled counts its token as pending, a decode takes it on the device,
        and a request its token ends has one extra token computed, dropped at the next read.
        Otherwise the tokens are read first, and requests they end leave before scheduling."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            self._launch(None)
            self._sample_deferred(self._deferred_masks())
            return []
        sched, launched = inflight
        # The step's inputs are all known by now (pending tokens are its new ones): commit
        # registers no block holding a pending token.
        self.scheduler.commit(sched)
        self._count(sched)
        if self.async_scheduling and self._can_schedule_ahead(sched):
            self._launch(launched)
            read = self._read(sched, launched)
            # Its masks need the tokens just read; they are computed on llguidance's threads
            # while this thread detokenizes, and the sampling is queued after.
            masks = self._deferred_masks()
            outputs = [self._emit(seq, sampled) for seq, sampled in read]
            self._sample_deferred(masks)
            return outputs
        read = self._read(sched, launched)
        ending = [(seq, s) for seq, s in read if self._ends_on_token(seq, s.token)]
        outputs = [self._emit(seq, s) for seq, s in ending]  # they leave before scheduling
        self._launch(None)
        masks = self._deferred_masks()
        # The device is busy with the next step; detokenize this one meanwhile.
        outputs += [self._emit(seq, s) for seq, s in read if seq.status is not SeqStatus.FINISHED]
        self._sample_deferred(masks)
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """Pipeline parallelism: fill the pipeline, then read its oldest step.

        Up to ``pipeline_depth`` steps are in flight, each of requests that no other step in
        flight holds (a request waits for its token before it is scheduled again), so while
        the last stage computes one step the first computes the next: the running requests
        fall into groups that take turns. A step is committed when launched (its inputs are
        known; its new tokens are pending), its tokens read back in launch order."""
        while len(self._pipe) < self.pipeline_depth:
            # Each step takes its share of the requests, so every stage has one to work on.
            share = -(-(self.num_running + self.num_waiting) // self.pipeline_depth)
            sched = self.scheduler.schedule(hold_pending=True, max_seqs=max(1, share))
            self.stats.preemptions += len(sched.preempted)
            if not sched.chunks:
                break
            launched = self._forward_and_sample(sched)
            self.scheduler.commit(sched)
            for chunk in sched.chunks:
                if chunk.samples:
                    chunk.seq.num_pending += 1
            self.stats.overlapped_steps += bool(self._pipe)
            self._pipe.append((sched, launched))
        if not self._pipe:
            return []
        sched, launched = self._pipe.popleft()
        self._count(sched)
        return [self._emit(seq, sampled) for seq, sampled in self._read(sched, launched)]

    def _can_schedule_ahead(self, sched: SchedulerOutput) -> bool:
        """Whether the next step can be launched with ``sched``'s tokens still unread.

        A penalised request's sampling reads its generated ids, so a step it samples in needs
        them on the host. Requests the tokens end by length are kept out of the next step by
        the scheduler (``Sequence.is_complete``); those ending otherwise get an extra token,
        dropped. A preempted request drops to waiting with its token pending, and is admitted
        again only in a later step, once the token is read."""
        return not any(is_penalised(c.seq.params) for c in sched.chunks
                       if c.samples and c.seq.status is not SeqStatus.FINISHED)

    def _launch(self, previous: SamplerLaunch | None) -> None:
        """Schedule the next step and queue it; ``previous``: the step whose tokens are still
        pending (scheduling ahead), which its decodes take their inputs from."""
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if not sched.chunks:
            return
        tables = [self.blocks.block_table(c.seq.request_id) for c in sched.chunks]
        with torch.inference_mode():
            step = self.runner.forward(sched, tables, previous)
            if self._constrained([seq.request_id for seq in step.rows]):
                # Sampled once the masks are computed, after the previous step's tokens are
                # read (``_sample_deferred``), while the device runs this forward pass.
                self._unsampled = (sched, step)
            else:
                self._inflight = (sched, self.runner.sample(step))
        for chunk in sched.chunks:
            if chunk.samples:
                chunk.seq.num_pending += 1
        self.stats.scheduled_ahead += previous is not None

    def _deferred_masks(self) -> Future[TokenMask | None] | None:
        """Start computing the launched step's grammar masks (its matchers are up to date)."""
        if self._unsampled is None:
            return None
        return self.grammars.fill_async([seq.request_id for seq in self._unsampled[1].rows])

    def _sample_deferred(self, masks: Future[TokenMask | None] | None) -> None:
        """Queue the launched step's sampling once its masks are computed."""
        if self._unsampled is None or masks is None:
            return
        (sched, step), self._unsampled = self._unsampled, None
        mask = masks.result()
        with torch.inference_mode():
            self._inflight = (sched, self.runner.sample(step, mask))
        for seq in step.rows:  # finished meanwhile: its token is dropped, so is its generator
            if seq.status is SeqStatus.FINISHED:
                self.runner.free(seq.request_id)

    def _constrained(self, request_ids: list[str]) -> bool:
        grammars = self.grammars
        return bool(grammars) and any(rid in grammars for rid in request_ids)

    def _read(self, sched: SchedulerOutput, launched: SamplerLaunch
              ) -> list[tuple[Sequence, _Sampled]]:
        """Wait for the step's tokens and append each to its sequence, in place of its pending
        token. A request finished after the step was launched (an abort, a stop string found
        late, a token ending it read after the next step was launched) drops its token."""
        sampled = launched()
        read: list[tuple[Sequence, _Sampled]] = []
        sampling = [c.seq for c in sched.chunks if c.samples]
        for seq, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs, strict=True):
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_pending -= 1
            seq.output_ids.append(token)
            read.append((seq, _Sampled(token, lp)))
        if self.grammars:  # every matcher advanced in one call (llguidance's thread pool)
            self._took_all([(seq, s.token) for seq, s in read])
        return read

    def _count(self, sched: SchedulerOutput) -> None:
        """Count a computed step, less the chunks of requests finished meanwhile (overlapped
        steps only): their tokens are dropped, never generated."""
        chunks = [c for c in sched.chunks if c.seq.status is not SeqStatus.FINISHED]
        decodes = sum(1 for c in chunks if c.is_decode)
        self.stats.steps += 1
        self.stats.decode_tokens += decodes
        self.stats.prompt_tokens_computed += sum(c.num_tokens for c in chunks) - decodes

    # ------------------------------------------------------------------ per token

    def _took(self, seq: Sequence, token: int) -> None:
        """Advance the request's grammar past its new token."""
        if seq.request_id in self.grammars:
            self._took_all([(seq, token)])

    def _took_all(self, tokens: list[tuple[Sequence, int]]) -> None:
        """Advance each request's grammar past its new token."""
        rows = [(seq, token) for seq, token in tokens if seq.request_id in self.grammars]
        accepted = self.grammars.consume_all([(seq.request_id, t) for seq, t in rows])
        for (seq, token), ok in zip(rows, accepted, strict=True):
            if not ok:  # the mask allowed it, so only a grammar bug gets here: it fails
                log.error("request %s: the grammar refused token %d: %s", seq.request_id,
                          token, self.grammars.error(seq.request_id))
                seq.grammar_failed = True
            # Read now: from here until the next step's sampling is queued, the matchers are
            # the mask thread's (``_deferred_masks``), and a matcher is not shared.
            seq.grammar_complete = self.grammars.is_complete(seq.request_id)

    @staticmethod
    def _grammar_ended(seq: Sequence) -> bool:
        return seq.grammar_failed or seq.grammar_complete

    def _ends_on_token(self, seq: Sequence, token: int) -> bool:
        """Whether the token just appended ends the request whatever its text says."""
        params = seq.params
        return ((token in self.tokenizer.eos_token_ids and not params.ignore_eos)
                or token in params.stop_token_ids
                or self._reached_length(seq)
                or self._grammar_ended(seq))

    def _reached_length(self, seq: Sequence) -> bool:
        """max_tokens or the context reached, counting the tokens read (not those pending)."""
        return (len(seq.output_ids) >= seq.params.max_tokens
                or seq.num_known >= self.config.max_model_len)

    def _advance(self, seq: Sequence, sampled: _Sampled) -> RequestOutput:
        seq.output_ids.append(sampled.token)
        self._took(seq, sampled.token)
        return self._emit(seq, sampled)

    def _emit(self, seq: Sequence, sampled: _Sampled) -> RequestOutput:
        """The output for a token already appended to ``seq``; finishes it where it ends."""
        token, params = sampled.token, seq.params
        is_eos = token in self.tokenizer.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            return self._finish(seq, "stop", sampled, seq.detokenizer.flush())
        text = seq.detokenizer.push(token)
        if seq.detokenizer.stopped:
            return self._finish(seq, "stop", sampled, text)
        if self._grammar_ended(seq):  # the document is complete: nothing may follow
            reason: FinishReason = "error" if seq.grammar_failed else "stop"
            return self._finish(seq, reason, sampled, text + seq.detokenizer.flush())
        if self._reached_length(seq):
            return self._finish(seq, "length", sampled, text + seq.detokenizer.flush())
        return self._output(seq, sampled, text)

    def _finish(
        self, seq: Sequence, reason: FinishReason, sampled: _Sampled | None, text: str
    ) -> RequestOutput:
        seq.finish_reason = reason
        seq.draft.clear()
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)
        self.scheduler.remove(seq)
        self.runner.free(seq.request_id)
        self.grammars.remove(seq.request_id)
        del self._seqs[seq.request_id]
        group = self._groups.get(seq.group_id)
        if group is not None and not any(rid in self._seqs for rid in group):
            del self._groups[seq.group_id]
        return self._output(seq, sampled, text)

    def _output(self, seq: Sequence, sampled: _Sampled | None, text: str) -> RequestOutput:
        n_out = len(seq.output_ids)
        return RequestOutput(
            request_id=seq.group_id,
            choice=seq.choice,
            token_id=sampled.token if sampled else None,
            index=n_out - 1 if sampled else n_out,
            text=text,
            finish_reason=seq.finish_reason if seq.status is SeqStatus.FINISHED else None,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=n_out,
            output_text=seq.detokenizer.text,
            logprobs=sampled.logprobs if sampled else None,
        )
