"""Each rank's slice of the weights: gathered back they are the whole model, and a rank loads
exactly its slice from a checkpoint (or from the random draws) without the others'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.models.family_checkpoints import write_family
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import DecoderModel, Partition
from tidegate.worker.models.loaders.loader import load_model
from tidegate.worker.models.loaders.random_weights import init_random_weights
from tidegate.worker.parallel.layout import ParallelLayout
from tidegate.worker.parallel.rank_share import RankShare
from tidegate.worker.parallel.weight_shards import gather, global_name, init_random_shard, shard

DENSE = ModelConfig(vocab_size=261, hidden_size=32, intermediate_size=48, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, o_bias=True,
                    qk_norm=True)
MOE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=1, head_dim=8, num_experts=3, experts_per_token=2,
                  moe_intermediate_size=16, moe_layers=(True, False), tie_word_embeddings=True)


def whole_model(cfg: ModelConfig) -> DecoderModel:
    model = DecoderModel(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # every entry distinct, so a wrong slice shows
            p.copy_(torch.randn(p.shape, generator=generator))
    return model


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("tp", [2, 4])
def test_shards_gathered_back_equal_the_original(cfg: ModelConfig, tp: int) -> None:
    model = whole_model(cfg)
    layout = ParallelLayout(tp=tp)
    for name, value in model.state_dict().items():
        if name.startswith("rope_cache"):
            continue
        parts = [shard(name, value, cfg, layout.place(r)) for r in range(tp)]
        assert torch.equal(gather(name, parts, cfg, layout), value), name


def test_shards_are_the_local_models_shapes_and_disjoint() -> None:
    cfg = DENSE
    layout = ParallelLayout(tp=2, pp=2)
    model = whole_model(cfg)
    whole = dict(model.named_parameters())
    seen: dict[str, int] = {}
    for rank in range(layout.world):
        place = layout.place(rank)
        local = DecoderModel(place.local_config(cfg))
        layers = place.layers(cfg.num_layers)
        for name, param in local.named_parameters():
            gname = global_name(name, place, cfg.num_layers)
            if name.startswith("layers."):
                assert int(gname.split(".")[1]) in layers
            if gname not in whole or name.startswith(("embed_tokens", "lm_head")):
                continue  # a local model keeps both ends; the loader sizes them
            assert shard(gname, whole[gname], cfg, place).shape == param.shape, gname
            seen[gname] = seen.get(gname, 0) + 1
    # Every layer's matrices are on exactly tp ranks: one stage.
    assert all(count == 2 for name, count in seen.items() if name.startswith("layers.")), seen


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mixtral"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_a_rank_loads_its_slice_of_a_checkpoint(family: str, tp: int, pp: int,
                                                tmp_path: Path) -> None:
    """Loading with a place gives exactly the slices of the whole model loaded alone: the
    embedding and LM head rows, the stage's layers renumbered, the shards of every matrix."""
    _, path = write_family(family, tmp_path / family)
    whole = load_model(str(path)).model
    cfg = whole.cfg
    layout = ParallelLayout(tp=tp, pp=pp)
    expected = dict(whole.named_parameters())
    for rank in range(layout.world):
        place = layout.place(rank)
        local = load_model(str(path), share=RankShare(place)).model
        names = {n for n, _ in local.named_parameters()}
        assert ("embed_tokens.weight" in names) == (
            place.first_stage or (place.last_stage and cfg.tie_word_embeddings))
        assert ("lm_head.weight" in names) == (place.last_stage and not cfg.tie_word_embeddings)
        assert len(local.layers) == len(place.layers(cfg.num_layers))
        for name, param in local.named_parameters():
            gname = global_name(name, place, cfg.num_layers)
            assert torch.equal(param, shard(gname, expected[gname], cfg, place)), (rank, name)


def test_random_shards_are_slices_of_the_same_random_model() -> None:
    whole = load_model("random:tiny").model
    layout = ParallelLayout(tp=2, pp=2)
    expected = dict(whole.named_parameters())
    for rank in range(layout.world):
        place = layout.place(rank)
        local = load_model("random:tiny", share=RankShare(place)).model
        for name, param in local.named_parameters():
            gname = global_name(name, place, whole.cfg.num_layers)
            assert torch.equal(param, shard(gname, expected[gname], whole.cfg, place)), name


def test_random_init_matches_the_whole_model_draws() -> None:
    """The sharded draws start from init_random_weights' own (same order, same stds)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    whole = DecoderModel(cfg)
    init_random_weights(whole, seed=3)
    place = ParallelLayout(tp=1, pp=2).place(1)
    local = DecoderModel(place.local_config(cfg), Partition(
        place.vocab_rows(cfg.vocab_size), first=False, last=True))
    init_random_shard(local, cfg, place, seed=3)
    assert torch.equal(local.layers[0].qkv_proj.weight, whole.layers[1].qkv_proj.weight)
    assert torch.equal(local.lm_head.weight, whole.lm_head.weight)
