"""``Follower``: a rank other than 0 of a parallel worker, running the steps rank 0 sends.

It holds its shard of the model and of the KV cache and a model runner like rank 0's; it
never talks to Redis and never schedules. It repeats what rank 0's runner did, in the same
order (``tidegate.worker.parallel.step_plan``), until told to stop.
"""

from __future__ import annotations

import logging

import torch

from tidegate.worker.engine.model_runner import ModelRunner, StepLogits
from tidegate.worker.engine.sampler import SamplerLaunch
from tidegate.worker.parallel.model_group import ModelGroup
from tidegate.worker.parallel.step_plan import ForwardOp, FreeOp, PlanReader, SampleOp, StopOp

log = logging.getLogger("tidegate.parallel")


class Follower:
    def __init__(self, runner: ModelRunner, group: ModelGroup) -> None:
        self.runner = runner
        self.group = group
        self.reader = PlanReader()
        self.steps = 0
        self._step: StepLogits | None = None  # the last forward pass, not sampled yet
        self._launch: SamplerLaunch | None = None  # the last sampled step

    def run(self) -> None:
        """Follow rank 0 until it says stop (a lost rank raises from the collective)."""
        with torch.inference_mode():
            while True:
                for op in self.group.broadcast():
                    if isinstance(op, StopOp):
                        return
                    self._apply(op)

    def _apply(self, op: ForwardOp | SampleOp | FreeOp) -> None:
        if isinstance(op, FreeOp):
            self.runner.free(op.request_id)
            self.reader.forget(op.request_id)
        elif isinstance(op, SampleOp):
            assert self._step is not None
            self._launch = self.runner.sample(self._step, op.mask)
        else:
            plan = self.reader.step(op)
            self._step = self.runner.forward(
                plan, op.block_tables,  # type: ignore[arg-type]
                self._launch if op.previous else None)
            self.steps += 1
