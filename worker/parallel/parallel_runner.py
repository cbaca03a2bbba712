"""``ParallelRunner``: rank 0's model runner in a parallel worker.

It is the engine's ``ModelRunner`` (its own shard's) plus the broadcast: every operation the
engine asks of it is queued for the other ranks, and a forward pass sends the queue in one
broadcast before rank 0 runs its share, so every rank runs the same step at once (their
collectives meet). Sampling and freeing ride along with the next forward pass: the other ranks
need a step's tokens only as the next step's inputs. It is the ``StepRunner`` the engine owns
the interface of (``tidegate.worker.engine.step_runner``), handed to rank 0's engine by
``tidegate.worker.parallel.parallel_engine``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from tidegate.worker.engine.grammar_masks import TokenMask
from tidegate.worker.engine.kv_cache import KVCacheSpec
from tidegate.worker.engine.model_runner import ModelRunner, StepLogits
from tidegate.worker.engine.sampler import SamplerLaunch, SamplerOutput
from tidegate.worker.engine.scheduler import SchedulerOutput
from tidegate.worker.parallel.model_group import ModelGroup, is_peer_lost
from tidegate.worker.parallel.step_plan import FreeOp, Op, PlanWriter, SampleOp, StopOp


class ParallelRunner:
    def __init__(self, runner: ModelRunner, group: ModelGroup) -> None:
        self.runner = runner
        self.group = group
        self._writer = PlanWriter()
        self._queued: list[Op] = []
        self._stopped = False
        # What a lost rank does to the worker, given the collective's error
        # (``RankProcesses.collective_failed``); None: raise.
        self.on_lost: Callable[[str], NoReturn] | None = None

    @property
    def graphs(self):  # noqa: ANN201 - the wrapped runner's (metrics, benchmarks)
        return self.runner.graphs

    @property
    def kv_cache(self):  # noqa: ANN201
        return self.runner.kv_cache

    @property
    def kv_spec(self) -> KVCacheSpec:
        return self.runner.kv_spec

    @property
    def pipeline_depth(self) -> int:
        """One step in flight per pipeline stage; 0 under tensor parallelism alone."""
        pp = self.group.pp
        return pp if pp > 1 else 0

    @property
    def ranks(self) -> int:
        return self.group.place.layout.world

    def forward(self, sched: SchedulerOutput, block_tables: list[list[int]],
                previous: SamplerLaunch | None = None) -> StepLogits:
        op = self._writer.forward(sched, block_tables, previous is not None)
        try:
            self.group.broadcast([*self._queued, op])
            self._queued = []
            return self.runner.forward(sched, block_tables, previous)
        except RuntimeError as exc:
            self._failed(exc)

    def sample(self, step: StepLogits, mask: TokenMask | None = None) -> SamplerLaunch:
        self._queued.append(SampleOp(mask))
        try:
            if self.runner.stage is not None:
                # A pipeline's last stage samples now: rank 0 reads its tokens from there.
                self.group.broadcast(self._queued)
                self._queued = []
            launch = self.runner.sample(step, mask)
        except RuntimeError as exc:
            self._failed(exc)
        if self.runner.stage is None:
            return launch
        read = launch.read

        def guarded() -> SamplerOutput:  # the tokens come from the last stage
            try:
                return read()
            except RuntimeError as exc:
                self._failed(exc)

        return SamplerLaunch(launch.request_ids, launch.token_ids, guarded)

    def _failed(self, exc: RuntimeError) -> NoReturn:
        """A collective failed: a rank gone ends the worker (``on_lost``); anything else is
        raised as it is."""
        if self.on_lost is not None and is_peer_lost(exc):
            self.on_lost(str(exc).splitlines()[0][:200])
        raise exc

    def free(self, request_id: str) -> None:
        self.runner.free(request_id)
        self._writer.forget(request_id)
        self._queued.append(FreeOp(request_id))

    def stop(self) -> None:
        """Send the other ranks out of their loop (once)."""
        if not self._stopped:
            self._stopped = True
            self.group.broadcast([*self._queued, StopOp()])
            self._queued = []
