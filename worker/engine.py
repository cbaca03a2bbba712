"""The continuous-batching engine: ``add_request``, ``abort``, ``step() -> outputs``.

Requests join at step boundaries and leave the moment they finish; every step runs the new
requests' prompts and every running request's next token through one forward pass, so no
request waits for another to finish.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass

from tidegate.protocol import FinishReason, SamplingParams
from tidegate.tokenizer import Tokenizer
from worker.detokenizer import IncrementalDetokenizer
from worker.model_runner import ModelRunner
from worker.models.llama import LlamaModel
from worker.sequence import SeqStatus, Sequence


class RequestError(ValueError):
    """A request the engine can never run (empty or too long for the model)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_model_len: int
    max_num_seqs: int = 32
    # Prompt tokens admitted per step; a longer prompt still runs, alone in its step.
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


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


class Engine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.runner = ModelRunner(model)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._aborted: set[str] = set()
        self.num_steps = 0

    # ------------------------------------------------------------------ interface

    def add_request(self, request: EngineRequest) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise RequestError("prompt is empty")
        if n + 1 > self.config.max_model_len:
            raise RequestError(
                f"prompt has {n} tokens; the model's context is {self.config.max_model_len}")
        params = request.params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.waiting.append(Sequence(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
            seed=seed,
        ))

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step boundary; it finishes with ``cancelled``."""
        self._aborted.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self) -> list[RequestOutput]:
        outputs = self._apply_aborts()
        batch = self._schedule()
        if batch:
            tokens = self.runner.run(batch)
            self.num_steps += 1
            outputs.extend(self._advance(seq, tok) for seq, tok in zip(batch, tokens, strict=True))
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return outputs

    # ------------------------------------------------------------------ steps

    def _apply_aborts(self) -> list[RequestOutput]:
        if not self._aborted:
            return []
        outputs: list[RequestOutput] = []
        for queue in (self.waiting, self.running):
            for seq in [s for s in queue if s.request_id in self._aborted]:
                queue.remove(seq)
                self._finish(seq, "cancelled")
                outputs.append(self._output(seq, None, ""))
        self._aborted.clear()  # ids not found were already finished: nothing to do
        return outputs

    def _schedule(self) -> list[Sequence]:
        """Every running request decodes; waiting ones join while seats and budget last."""
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            cost = self.waiting[0].num_tokens
            if cost > budget and budget < self.config.max_num_batched_tokens:
                break  # over budget; a prompt longer than the whole budget still runs alone
            budget -= cost
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        return list(self.running)

    def _advance(self, seq: Sequence, token: int) -> RequestOutput:
        seq.num_computed = seq.num_tokens
        seq.output_ids.append(token)
        params = seq.params
        if token in self.tokenizer.eos_token_ids:
            self._finish(seq, "stop")
            return self._output(seq, token, seq.detokenizer.flush())
        text = seq.detokenizer.push(token)
        if seq.detokenizer.stopped:
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            self._finish(seq, "length")
            text += seq.detokenizer.flush()
        return self._output(seq, token, text)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.runner.free(seq.request_id)

    def _output(self, seq: Sequence, token: int | None, text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            token_id=token,
            index=len(seq.output_ids) - 1 if token is not None else len(seq.output_ids),
            text=text,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            output_text=seq.detokenizer.text,
        )
