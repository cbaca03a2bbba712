"""The device's LoRA adapter slots: per layer, one stack per projection group of the decoder.

The decoder's projections are packed (q, k and v in one matrix, gate and up in another), so an
adapter's matrices are laid out the same way: one segmented stack per packed projection
(``tidegate.kernels.reference.lora.LoraStack`` with ``segments``), each holding ``num_slots`` adapters of rank up
to ``max_rank``, zero-padded. An adapter is first checked and staged on the host
(``stage``: its matrices in the model's dtype, pinned), then copied into a slot when a step
needs it (``load``); a slot keeps whatever was last loaded into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidegate.kernels.reference.lora import LoraRows, LoraStack
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.loaders.lora_adapter import LoraAdapter

# Projection groups in the order the decoder applies them, and the adapter projections packed
# into each (as the model packs its weights).
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class AdapterMismatch(ValueError):
    """An adapter that does not fit the model (its shapes, layers or rank)."""


@dataclass(frozen=True, slots=True)
class LayerLora:
    """One layer's stacks; ``gate_up`` and ``down`` are None on a layer of routed experts."""

    qkv: LoraStack
    o: LoraStack
    gate_up: LoraStack | None
    down: LoraStack | None


@dataclass(frozen=True, slots=True)
class StagedAdapter:
    """An adapter checked against the model, on the host: for each (layer, group, segment) it
    targets, A [r, in] and B [out, r] in the model's dtype."""

    name: str
    rank: int
    scale: float
    parts: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.parts.values())


class LoraWeights:
    """``num_slots`` adapter slots on the model's device, for every layer (see the module)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        h, i = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # Each group's (in, out of each segment) as the decoder's packed matrices have them.
        self.shapes: dict[str, tuple[int, tuple[int, ...]]] = {
            "qkv": (h, (q, kv, kv)), "o": (q, (h,)), "gate_up": (h, (i, i)), "down": (i, (h,)),
        }
        self.layers = [self._layer(n) for n in range(cfg.num_layers)]

    def _layer(self, index: int) -> LayerLora:
        stacks = {group: self._stack(group) for group in GROUPS
                  if group in ("qkv", "o") or not self.cfg.is_moe(index)}
        return LayerLora(stacks["qkv"], stacks["o"], stacks.get("gate_up"), stacks.get("down"))

    def _stack(self, group: str) -> LoraStack:
        k, outs = self.shapes[group]
        segments = len(outs)
        offsets = tuple(sum(outs[:s]) for s in range(1, segments))
        kw = {"dtype": self.dtype, "device": self.device}
        return LoraStack(
            torch.zeros(self.num_slots, segments * self.max_rank, k, **kw),  # type: ignore[arg-type]
            torch.zeros(self.num_slots, sum(outs), self.max_rank, **kw),  # type: ignore[arg-type]
            torch.zeros(self.num_slots, dtype=torch.float32, device=self.device),
            segments=offsets)

    @property
    def nbytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for layer in self.layers
                   for s in (layer.qkv, layer.o, layer.gate_up, layer.down) if s is not None)

    def stage(self, adapter: LoraAdapter) -> StagedAdapter:
        """The adapter checked against the model and laid out for ``load``;
        ``AdapterMismatch`` naming what does not fit."""
        if adapter.rank > self.max_rank:
            raise AdapterMismatch(f"its rank is {adapter.rank}; this worker serves ranks up to "
                                  f"{self.max_rank} (max_lora_rank)")
        pin = self.device.type == "cuda"
        parts: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, projection), (a, b) in adapter.weights.items():
            if layer >= self.cfg.num_layers:
                raise AdapterMismatch(f"it targets layer {layer}; the model has "
                                      f"{self.cfg.num_layers}")
            group = next(g for g, projections in GROUPS.items() if projection in projections)
            if group in ("gate_up", "down") and self.cfg.is_moe(layer):
                raise AdapterMismatch(f"it targets {projection} of layer {layer}, a layer of "
                                      "routed experts (adapters on experts are not served)")
            segment = GROUPS[group].index(projection)
            k, outs = self.shapes[group]
            if tuple(b.shape[:1]) + tuple(a.shape[1:]) != (outs[segment], k):
                raise AdapterMismatch(
                    f"layer {layer} {projection} is {(b.shape[0], a.shape[1])}; the model's is "
                    f"{(outs[segment], k)}")
            a, b = a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous()
            parts[(layer, group, segment)] = (a.pin_memory(), b.pin_memory()) if pin else (a, b)
        return StagedAdapter(adapter.name, adapter.rank, adapter.scale, parts)

    def load(self, slot: int, staged: StagedAdapter) -> None:
        """Copy a staged adapter into ``slot`` (asynchronously on a GPU, in stream order, so a
        step still queued that used the slot's previous adapter computes with it)."""
        r, rank = staged.rank, self.max_rank
        for n, layer in enumerate(self.layers):
            for group, stack in (("qkv", layer.qkv), ("o", layer.o),
                                 ("gate_up", layer.gate_up), ("down", layer.down)):
                if stack is None:
                    continue
                stack.a[slot].zero_()
                stack.b[slot].zero_()
                stack.scale[slot] = staged.scale
                _, outs = self.shapes[group]
                start = 0
                for segment, out in enumerate(outs):
                    part = staged.parts.get((n, group, segment))
                    if part is not None:
                        a, b = part
                        stack.a[slot, segment * rank: segment * rank + r].copy_(
                            a, non_blocking=True)
                        stack.b[slot, start: start + out, :r].copy_(b, non_blocking=True)
                    start += out


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """A step's adapters: the slots, and each flat row's slot (``tidegate.kernels.reference.lora.LoraRows``,
    built once per step and shared by every projection of every layer)."""

    weights: LoraWeights
    rows: LoraRows

    def layer(self, index: int) -> tuple[LayerLora, LoraRows]:
        return self.weights.layers[index], self.rows
