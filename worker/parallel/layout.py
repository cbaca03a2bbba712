"""Where each rank of a parallel worker sits and what share of the model it holds.

A worker of ``tp`` x ``pp`` ranks (one host): rank ``r`` is tensor-parallel rank ``r % tp`` of
pipeline stage ``r // tp``, so rank 0 (the one that talks to Redis and schedules) holds the
first stage's first shard. Torch-free control code: the checks that refuse a model a layout
cannot split, the layers of each stage, the vocabulary rows of each shard and the config each
rank's model is built with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tidegate.worker.models.config import ModelConfig


class LayoutError(ValueError):
    """A model this layout cannot split (the message names the size and the model's shape)."""


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    tp: int = 1  # tensor-parallel ranks per stage
    pp: int = 1  # pipeline stages

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise LayoutError("tensor- and pipeline-parallel sizes must be at least 1")

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def place(self, rank: int) -> RankPlace:
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} outside a world of {self.world}")
        return RankPlace(self, rank)

    def check(self, cfg: ModelConfig) -> None:
        """Raise ``LayoutError`` where the model cannot be split this way."""
        tp, pp = self.tp, self.pp
        if cfg.num_heads % tp:
            raise LayoutError(f"--tensor-parallel-size {tp} must divide the model's "
                              f"{cfg.num_heads} attention heads")
        kv = cfg.num_kv_heads
        if kv % tp and tp % kv:
            raise LayoutError(f"--tensor-parallel-size {tp} and the model's {kv} KV heads: one "
                              "must divide the other (KV heads are split, or replicated when "
                              "fewer than the ranks)")
        if cfg.intermediate_size % tp:
            raise LayoutError(f"--tensor-parallel-size {tp} must divide the MLP's "
                              f"{cfg.intermediate_size} columns")
        if cfg.num_experts and cfg.moe_intermediate_size % tp:
            raise LayoutError(f"--tensor-parallel-size {tp} must divide the experts' "
                              f"{cfg.moe_intermediate_size} columns")
        if pp > cfg.num_layers:
            raise LayoutError(f"--pipeline-parallel-size {pp} exceeds the model's "
                              f"{cfg.num_layers} layers")


@dataclass(frozen=True, slots=True)
class RankPlace:
    """One rank's place in a layout."""

    layout: ParallelLayout
    rank: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.layout.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.layout.tp

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def stage_ranks(self, pp_rank: int | None = None) -> list[int]:
        """The ranks of a stage (default: this rank's), tensor-parallel rank order."""
        stage = self.pp_rank if pp_rank is None else pp_rank
        tp = self.layout.tp
        return list(range(stage * tp, (stage + 1) * tp))

    def layers(self, num_layers: int) -> range:
        """The global indices of the layers this rank's stage runs: an even split, the first
        ``num_layers % pp`` stages one layer more."""
        return stage_layers(num_layers, self.layout.pp, self.pp_rank)

    def vocab_rows(self, vocab_size: int) -> range:
        """The embedding and LM-head rows this shard holds: ``ceil(V / tp)`` each, the last
        shard's tail past V zero padding."""
        per = -(-vocab_size // self.layout.tp)
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def kv_heads(self, cfg: ModelConfig) -> range:
        """The global KV heads this shard's query heads read: its share, or the one head all
        of them share when there are fewer KV heads than ranks (replicated)."""
        tp, kv = self.layout.tp, cfg.num_kv_heads
        if kv >= tp:
            per = kv // tp
            return range(self.tp_rank * per, (self.tp_rank + 1) * per)
        group = cfg.num_heads // kv  # query heads per KV head
        first_q = self.tp_rank * (cfg.num_heads // tp)
        return range(first_q // group, first_q // group + 1)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config this rank's model is built with: its heads, MLP columns and layers
        (per-layer fields sliced to them). ``vocab_size`` stays the model's: the embedding and
        LM head are sized by ``vocab_rows``."""
        self.layout.check(cfg)
        tp = self.layout.tp
        layers = self.layers(cfg.num_layers)
        return dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // tp,
            num_kv_heads=len(self.kv_heads(cfg)),
            intermediate_size=cfg.intermediate_size // tp,
            moe_intermediate_size=cfg.moe_intermediate_size // tp,
            num_layers=len(layers),
            layer_kinds=None if cfg.layer_kinds is None else tuple(
                cfg.layer_kinds[i] for i in layers),
            moe_layers=None if cfg.moe_layers is None else tuple(
                cfg.moe_layers[i] for i in layers),
            # The score scale is the whole model's: it must not follow a changed head count.
            attn_scale=cfg.scale,
        )


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))
