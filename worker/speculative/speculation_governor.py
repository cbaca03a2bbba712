"""``SpeculationGovernor``: whether a step speculates, from the speed the engine measured.

Speculation pays while a step is bound by reading the weights: verifying k drafts then costs
little more than decoding one token. As the batch grows the step becomes bound by compute, the
drafts' extra tokens cost about what they are worth and then more, and speculation slows the
engine down. Where that happens depends on the model, the device, how many drafts the target
keeps (the workload) and what the proposer costs, so the governor measures it instead of
being told: for each class of batch size (powers of two) it keeps a moving average of output
tokens per second of decode steps with and without speculation, runs the faster way, and every
``explore_every``-th step of a class the other way (rarer, up to 8x, the further behind it
measured), so a change of workload is noticed. A
request's tokens are the same either way (greedy and seeded sampling alike,
``tidegate.worker.speculative.draft_verifier``); only the speed depends on the choice.
``max_batch`` replaces the measurement with a fixed rule: speculate at batch sizes up to it.
Plain Python: the engine hands it the times.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True)
class StepRate:
    """Output tokens per second of one way of stepping at one class of batch size."""

    tokens_per_s: float = 0.0
    samples: int = 0


class SpeculationGovernor:
    def __init__(self, *, max_batch: int | None = None, warmup: int = 4,
                 explore_every: int = 16, smoothing: float = 0.2) -> None:
        if max_batch is not None and max_batch < 0:
            raise ValueError("speculative_max_batch must not be negative")
        if warmup < 1 or explore_every < 2 or not 0 < smoothing <= 1:
            raise ValueError("warmup >= 1, explore_every >= 2 and 0 < smoothing <= 1")
        self.max_batch = max_batch
        self.warmup = warmup
        self.explore_every = explore_every
        self.smoothing = smoothing
        self._rates: dict[tuple[int, bool], StepRate] = {}
        self._decisions: Counter[int] = Counter()

    @staticmethod
    def batch_class(batch: int) -> int:
        """1; 2-3; 4-7; 8-15; ...: the class's smallest batch size."""
        return 1 << (batch.bit_length() - 1) if batch > 0 else 0

    def rate(self, batch: int, speculative: bool) -> StepRate:
        """What was measured for steps of this batch size's class."""
        return self._rates.get((self.batch_class(batch), speculative), StepRate())

    def speculate(self, batch: int) -> bool:
        """Whether the next step, of ``batch`` running requests, speculates."""
        if batch < 1:
            return False
        if self.max_batch is not None:
            return batch <= self.max_batch
        spec, plain = self.rate(batch, True), self.rate(batch, False)
        if spec.samples < self.warmup:
            return True
        if plain.samples < self.warmup:
            return False
        cls = self.batch_class(batch)
        self._decisions[cls] += 1
        best = spec.tokens_per_s >= plain.tokens_per_s
        # The further behind the other way measured, the rarer its check (up to 8x rarer):
        # a check costs what the gap is.
        gap = (max(spec.tokens_per_s, plain.tokens_per_s)
               / max(min(spec.tokens_per_s, plain.tokens_per_s), 1e-9))
        every = self.explore_every * min(8, max(1, int(gap)))
        return best if self._decisions[cls] % every else not best

    def record(self, batch: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A decode step (no prompt chunks: they would blur the comparison) of ``batch``
        requests gave ``tokens`` tokens in ``seconds``, speculating or not."""
        if batch < 1 or seconds <= 0 or self.max_batch is not None:
            return
        key = (self.batch_class(batch), speculative)
        rate = self._rates.setdefault(key, StepRate())
        speed = tokens / seconds
        rate.tokens_per_s = (speed if rate.samples == 0 else
                             (1 - self.smoothing) * rate.tokens_per_s + self.smoothing * speed)
        rate.samples += 1

    def switched_off(self) -> list[int]:
        """The classes (smallest batch size of each) where plain decoding measured faster."""
        out = []
        for (cls, speculative), spec in sorted(self._rates.items()):
            plain = self._rates.get((cls, False))
            if (speculative and plain is not None and min(spec.samples, plain.samples)
                    >= self.warmup and plain.tokens_per_s > spec.tokens_per_s):
                out.append(cls)
        return out
