"""The interface the loader owns for loading part of a model: ``ModelSplit``, a way of cutting
a model (checked before any weight is read), and ``ModelShare``, one rank's part of it.

A parallel worker's ranks each load their share (``tidegate.worker.parallel``: its
``ParallelLayout`` is a split, its ``RankShare`` a share) and hand it to ``load_model``; the
loader never imports them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import DecoderModel, Partition, TensorSource


class ModelSplit(Protocol):
    def check(self, cfg: ModelConfig) -> None:
        """Raise ``ValueError`` naming why the model cannot be cut this way."""
        ...


class ModelShare(ModelSplit, Protocol):
    """One rank's share of a model cut by a split: its config and ends, its slice of every
    tensor."""

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config the share's model is built with (its heads, columns and layers)."""
        ...

    def partition(self, cfg: ModelConfig) -> Partition:
        """The share's vocabulary rows and whether it holds the model's first and last
        layers."""
        ...

    def init_random(self, model: DecoderModel, cfg: ModelConfig, seed: int) -> None:
        """The share's slices of the random model ``init_random_weights`` draws."""
        ...

    def load(self, model: DecoderModel, cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
             sources: Sequence[TensorSource]) -> None:
        """Read the share's slices of a checkpoint's tensors (``sources`` name the whole
        model's) into ``model``."""
        ...
