"""Where each rank sits and what it holds: exact, torch-free."""

from __future__ import annotations

import pytest

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.parallel.layout import LayoutError, ParallelLayout, stage_layers

LLAMA_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)


def test_ranks_are_tensor_parallel_within_a_stage() -> None:
    layout = ParallelLayout(tp=2, pp=3)
    assert layout.world == 6
    places = [layout.place(r) for r in range(6)]
    assert [(p.pp_rank, p.tp_rank) for p in places] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert places[0].first_stage and not places[0].last_stage
    assert places[5].last_stage and not places[5].first_stage
    assert places[3].stage_ranks() == [2, 3]
    with pytest.raises(LayoutError):
        layout.place(6)
    with pytest.raises(LayoutError):
        ParallelLayout(tp=0)


def test_stages_split_the_layers_evenly_earlier_stages_first() -> None:
    assert [stage_layers(32, 2, s) for s in range(2)] == [range(0, 16), range(16, 32)]
    assert [stage_layers(10, 3, s) for s in range(3)] == [range(0, 4), range(4, 7),
                                                         range(7, 10)]
    assert [len(stage_layers(80, 3, s)) for s in range(3)] == [27, 27, 26]
    covered = [i for s in range(4) for i in stage_layers(30, 4, s)]
    assert covered == list(range(30))


def test_vocabulary_rows_cover_the_vocabulary_padded() -> None:
    layout = ParallelLayout(tp=4)
    rows = [layout.place(r).vocab_rows(1001) for r in range(4)]
    assert rows == [range(0, 251), range(251, 502), range(502, 753), range(753, 1004)]


def test_kv_heads_split_or_replicated() -> None:
    tp2 = ParallelLayout(tp=2)
    assert [tp2.place(r).kv_heads(LLAMA_8B) for r in range(2)] == [range(0, 4), range(4, 8)]
    # 16 ranks, 8 KV heads: two query-head shards read each KV head.
    tp16 = ParallelLayout(tp=16)
    assert [tp16.place(r).kv_heads(LLAMA_8B).start for r in range(16)] == [
        r // 2 for r in range(16)]
    assert all(len(tp16.place(r).kv_heads(LLAMA_8B)) == 1 for r in range(16))


def test_local_config_is_the_rank_share() -> None:
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=5,
                      num_heads=8, num_kv_heads=2, head_dim=8, sliding_window=4,
                      layer_kinds=("sliding", "full", "sliding", "full", "sliding"),
                      attn_scale=0.3)
    place = ParallelLayout(tp=4, pp=2).place(6)  # stage 1, shard 2
    local = place.local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 24)
    assert local.num_layers == 2 and local.layer_kinds == ("full", "sliding")
    assert local.vocab_size == 100 and local.hidden_size == 64 and local.head_dim == 8
    assert local.scale == 0.3
    # The default scale follows head_dim, which a shard keeps.
    assert ParallelLayout(tp=2).place(1).local_config(LLAMA_8B).scale == 128 ** -0.5


@pytest.mark.parametrize(("tp", "pp", "message"), [
    (3, 1, "must divide the model's 32 attention heads"),
    (32, 1, "must divide the MLP's"),  # 32 heads, 8 KV heads (replicated): the MLP fails
    (1, 33, "exceeds the model's 32 layers"),
])
def test_layouts_a_model_cannot_take_are_refused(tp: int, pp: int, message: str) -> None:
    cfg = LLAMA_8B if tp != 32 else ModelConfig(
        vocab_size=10, hidden_size=64, intermediate_size=48, num_layers=2, num_heads=32,
        num_kv_heads=8, head_dim=2)
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(tp, pp).check(cfg)


def test_kv_heads_neither_dividing_nor_divided_are_refused() -> None:
    cfg = ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=48, num_layers=2,
                      num_heads=12, num_kv_heads=4, head_dim=8)
    with pytest.raises(LayoutError, match="4 KV heads"):
        ParallelLayout(tp=6).check(cfg)
    ParallelLayout(tp=2).check(cfg)
    ParallelLayout(tp=4).check(cfg)
    ParallelLayout(tp=12).check(ModelConfig(
        vocab_size=10, hidden_size=64, intermediate_size=48, num_layers=2, num_heads=12,
        num_kv_heads=4, head_dim=8))
