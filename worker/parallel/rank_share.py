"""``RankShare``: the share of the model one rank of a parallel worker loads.

It is the loader's ``ModelShare`` (``tidegate.worker.models.loaders.model_share``) for a
``RankPlace``: the rank's config and vocabulary rows from the layout (``layout``), its slice of
every tensor from ``weight_shards``. Rank 0 and the other ranks hand it to ``load_model``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import DecoderModel, Partition, TensorSource
from tidegate.worker.parallel.layout import RankPlace
from tidegate.worker.parallel.weight_shards import WeightSharder, init_random_shard, stage_sources


@dataclass(frozen=True, slots=True)
class RankShare:
    place: RankPlace

    def check(self, cfg: ModelConfig) -> None:
        self.place.layout.check(cfg)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        return self.place.local_config(cfg)

    def partition(self, cfg: ModelConfig) -> Partition:
        place = self.place
        return Partition(place.vocab_rows(cfg.vocab_size), place.first_stage, place.last_stage)

    def init_random(self, model: DecoderModel, cfg: ModelConfig, seed: int) -> None:
        init_random_shard(model, cfg, self.place, seed)

    def load(self, model: DecoderModel, cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
             sources: Sequence[TensorSource]) -> None:
        """Each tensor is cut to the rank's slice as it is read: no rank holds another's."""
        model.load_hf_state_dict(weights, stage_sources(sources, self.place, cfg.num_layers,
                                                        model),
                                 shard=WeightSharder(cfg, self.place))
