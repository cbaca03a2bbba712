"""The runner interface the engine owns: ``StepRunner``, what the engine steps through, and
``RankGroup``, what ``build_runner`` needs from the group of a parallel worker's ranks.

A single process steps through its own ``ModelRunner``. A parallel worker's rank 0 builds its
runner over its group and hands the engine one that also drives the other ranks
(``tidegate.worker.parallel``, which implements both interfaces); the engine never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from tidegate.worker.engine.grammar_masks import TokenMask
from tidegate.worker.engine.kv_cache import KVCacheSpec
from tidegate.worker.engine.model_runner import PipelineLink, StepLogits
from tidegate.worker.engine.sampler import SamplerLaunch
from tidegate.worker.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:  # CUDA only: imported where graphs are captured (it loads Triton kernels)
    from tidegate.worker.engine.cuda_graphs import CudaGraphDecoder


class StepRunner(Protocol):
    """What the engine asks of the runner it is given; ``ModelRunner`` satisfies it."""

    kv_spec: KVCacheSpec  # the KV cache the runner computes over (the engine's blocks index it)

    # Read through ``Engine.runner`` by metrics, tests and benchmarks.
    @property
    def graphs(self) -> CudaGraphDecoder | None: ...

    @property
    def kv_cache(self) -> torch.Tensor: ...

    @property
    def pipeline_depth(self) -> int:
        """Steps the engine keeps in flight at once: one per pipeline stage, each of other
        requests (``Engine._step_pipelined``); 0: one step at a time."""
        ...

    @property
    def ranks(self) -> int:
        """Processes (and devices) whose steps this runner drives, itself included."""
        ...

    def forward(self, sched: SchedulerOutput, block_tables: list[list[int]],
                previous: SamplerLaunch | None = None) -> StepLogits: ...

    def sample(self, step: StepLogits, mask: TokenMask | None = None) -> SamplerLaunch: ...

    def free(self, request_id: str) -> None: ...

    def stop(self) -> None:
        """The engine is closing: other ranks are sent out of their loop (once)."""
        ...


class RankGroup(PipelineLink, Protocol):
    """A parallel worker's group as each rank's runner is built over it
    (``tidegate.worker.parallel.model_group.ModelGroup``)."""

    @property
    def pp(self) -> int:
        """Pipeline stages (1: tensor parallelism alone)."""
        ...

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV cache all ranks can hold)."""
        ...
