"""Which slice of each whole-model tensor a rank holds, and the whole tensor back from them.

Column-parallel projections (fused q/k/v, fused gate/up, the experts' gate/up) keep their
shard's output rows of each part; row-parallel ones (o, down, the experts' down) their input
columns; the embedding and LM head their vocabulary rows (zero padding past the vocabulary);
norms, routers and the o bias (added once, after the sum) are whole on every shard. A stage
holds its layers, renumbered from 0. ``WeightSharder`` is what a rank's loader applies to each
tensor as it is read, so no rank ever holds another's share; ``gather`` undoes it (tests).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import DecoderModel, TensorSource
from tidegate.worker.models.loaders.random_weights import INIT_STD
from tidegate.worker.parallel.layout import ParallelLayout, RankPlace

_LAYER = re.compile(r"^layers\.(\d+)\.")


def global_name(param: str, place: RankPlace, num_layers: int) -> str:
    """A stage's parameter name (layers numbered from 0) -> the whole model's."""
    start = place.layers(num_layers).start
    return _LAYER.sub(lambda m: f"layers.{int(m.group(1)) + start}.", param)


def stage_sources(sources: Sequence[TensorSource], place: RankPlace, num_layers: int,
                  model: DecoderModel) -> list[TensorSource]:
    """The checkpoint sources of the tensors a rank's ``model`` holds (of a model of
    ``num_layers``), its layers renumbered."""
    layers = place.layers(num_layers)
    have = {name for name, _ in model.named_parameters()}
    out: list[TensorSource] = []
    for src in sources:
        m = _LAYER.match(src.param)
        if m is not None:
            layer = int(m.group(1))
            if layer not in layers:
                continue
            param = _LAYER.sub(f"layers.{layer - layers.start}.", src.param)
            src = TensorSource(param, src.names, src.label, src.offset)
        elif src.param not in have:
            continue  # the embedding or LM head of another stage
        out.append(src)
    return out


class WeightSharder:
    """Cuts whole-model tensors to one rank's share."""

    def __init__(self, cfg: ModelConfig, place: RankPlace) -> None:
        self.cfg = cfg  # the whole model's
        self.place = place
        with torch.device("meta"):
            full = DecoderModel(cfg)
        self.shapes = {name: tuple(p.shape) for name, p in full.named_parameters()}

    def __call__(self, param: str, value: torch.Tensor) -> torch.Tensor:
        """``param`` (the rank's name) and the whole tensor, any shape of the right size ->
        the rank's slice."""
        name = global_name(param, self.place, self.cfg.num_layers)
        return shard(name, value.reshape(self.shapes[name]), self.cfg, self.place)


def shard(name: str, value: torch.Tensor, cfg: ModelConfig, place: RankPlace) -> torch.Tensor:
    """The whole model's tensor ``name`` -> rank ``place``'s slice (contiguous)."""
    tp = place.layout.tp
    leaf = name.rsplit(".", 2)
    kind = ".".join(leaf[-2:])
    if tp == 1 and kind not in ("embed_tokens.weight", "lm_head.weight"):
        return value
    d = cfg.head_dim
    if kind in ("embed_tokens.weight", "lm_head.weight"):
        rows = place.vocab_rows(cfg.vocab_size)
        part = value[rows.start : min(rows.stop, cfg.vocab_size)]
        return F.pad(part, (0, 0, 0, len(rows) - part.shape[0])).contiguous()
    if kind in ("qkv_proj.weight", "qkv_proj.bias"):
        q, k, v = value.split([cfg.num_heads * d, cfg.num_kv_heads * d,
                               cfg.num_kv_heads * d])
        qh = _q_heads(cfg, place)
        kv = place.kv_heads(cfg)
        return torch.cat([q[qh.start * d : qh.stop * d], k[kv.start * d : kv.stop * d],
                          v[kv.start * d : kv.stop * d]]).contiguous()
    if kind == "o_proj.weight":
        qh = _q_heads(cfg, place)
        return value[:, qh.start * d : qh.stop * d].contiguous()
    if kind == "gate_up_proj.weight":
        return _gate_up(value, cfg.intermediate_size, place, dim=0)
    if kind == "down_proj.weight":
        return _cols(value, cfg.intermediate_size, place, dim=1)
    if kind == "experts.w13":
        return _gate_up(value, cfg.moe_intermediate_size, place, dim=1)
    if kind == "experts.w2":
        return _cols(value, cfg.moe_intermediate_size, place, dim=2)
    return value  # norms, the router, the o bias: whole on every shard


def gather(name: str, parts: Sequence[torch.Tensor], cfg: ModelConfig,
           layout: ParallelLayout) -> torch.Tensor:
    """The shards' slices of ``name`` (tensor-parallel rank order, one stage) -> the whole
    tensor; ``shard``'s inverse."""
    tp = layout.tp
    kind = ".".join(name.rsplit(".", 2)[-2:])
    d = cfg.head_dim
    places = [layout.place(r) for r in range(tp)]
    if kind in ("embed_tokens.weight", "lm_head.weight"):
        return torch.cat(list(parts))[: cfg.vocab_size]
    if kind in ("qkv_proj.weight", "qkv_proj.bias"):
        qs, ks, vs = [], {}, {}
        for place, part in zip(places, parts, strict=True):
            kv = place.kv_heads(cfg)
            q, k, v = part.split([len(_q_heads(cfg, place)) * d, len(kv) * d, len(kv) * d])
            qs.append(q)
            for j, head in enumerate(kv):  # replicated heads: every copy is the same
                ks.setdefault(head, k[j * d : (j + 1) * d])
                vs.setdefault(head, v[j * d : (j + 1) * d])
        heads = range(cfg.num_kv_heads)
        return torch.cat([*qs, *(ks[h] for h in heads), *(vs[h] for h in heads)])
    if kind == "o_proj.weight":
        return torch.cat(list(parts), dim=1)
    if kind in ("gate_up_proj.weight", "experts.w13"):
        dim = 0 if kind == "gate_up_proj.weight" else 1
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    if kind == "down_proj.weight":
        return torch.cat(list(parts), dim=1)
    if kind == "experts.w2":
        return torch.cat(list(parts), dim=2)
    return parts[0]


def _q_heads(cfg: ModelConfig, place: RankPlace) -> range:
    per = cfg.num_heads // place.layout.tp
    return range(place.tp_rank * per, (place.tp_rank + 1) * per)


def _gate_up(value: torch.Tensor, inter: int, place: RankPlace, dim: int) -> torch.Tensor:
    per = inter // place.layout.tp
    lo = place.tp_rank * per
    gate = value.narrow(dim, lo, per)
    up = value.narrow(dim, inter + lo, per)
    return torch.cat([gate, up], dim=dim).contiguous()


def _cols(value: torch.Tensor, inter: int, place: RankPlace, dim: int) -> torch.Tensor:
    per = inter // place.layout.tp
    return value.narrow(dim, place.tp_rank * per, per).contiguous()


@torch.no_grad()
def init_random_shard(model: DecoderModel, cfg: ModelConfig, place: RankPlace,
                      seed: int) -> None:
    """Random weights of the whole model ``cfg`` (exactly ``init_random_weights``'s draws,
    in its order), each cut to ``place``'s share as it is drawn: a rank never holds more than
    one whole tensor at a time."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * cfg.num_layers)
    sharder = WeightSharder(cfg, place)
    own = _owned(model, place, cfg.num_layers)
    for name, shape in sharder.shapes.items():
        if len(shape) == 1:  # norm gains, biases: not drawn
            value = torch.full(shape, 0.0 if name.endswith(".bias") else 1.0, dtype=dtype,
                               device=device)
        else:
            std = (residual_std if name.endswith(("o_proj.weight", "down_proj.weight",
                                                  "experts.w2")) else INIT_STD)
            value = torch.empty(shape, dtype=dtype, device=device).normal_(
                0.0, std, generator=generator)
        if name in own:
            own[name].copy_(shard(name, value, cfg, place))


def _owned(model: DecoderModel, place: RankPlace, num_layers: int
           ) -> Mapping[str, torch.nn.Parameter]:
    """The rank's parameters by their whole-model names."""
    return {global_name(name, place, num_layers): p for name, p in model.named_parameters()}
