"""Block manager: allocation, sharing, reference counts, prefix hits, LRU eviction. No torch."""

from __future__ import annotations

import sys

import pytest

from tidegate.worker.engine.block_manager import BlockManager


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_allocate_rounds_up_to_blocks_and_free_returns_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.can_allocate(toks(9), 9)
    assert bm.allocate("a", toks(9), 9) == 0
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8
    with pytest.raises(KeyError):
        bm.block_table("a")


def test_can_allocate_refuses_what_does_not_fit() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", toks(8), 8)
    assert bm.can_allocate(toks(8, 100), 8)
    assert not bm.can_allocate(toks(9, 100), 9)
    with pytest.raises(ValueError):
        bm.allocate("a", toks(4), 4)


def test_append_slot_grows_one_block_at_a_boundary() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", toks(4), 4)
    assert bm.can_append("a", 4) and len(bm.block_table("a")) == 1
    bm.append_slot("a", 5)
    assert len(bm.block_table("a")) == 2
    bm.append_slot("a", 8)
    assert len(bm.block_table("a")) == 2
    assert bm.can_append("a", 12) and not bm.can_append("a", 13)
    # holds: what the table has room for already (the scheduler's no-allocation fast path)
    assert bm.holds("a", 8) and not bm.holds("a", 9)


def test_shared_prefix_blocks_are_reused_with_reference_counts() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    system = toks(8)  # two full blocks
    a = system + [100, 101, 102]
    bm.allocate("a", a, len(a))
    # Nothing is reusable until it has been computed and committed.
    assert bm.cached_prefix(system + [7]) == []
    bm.commit("a", a, len(a))
    b = system + [200, 201]
    assert bm.allocate("b", b, len(b)) == 8
    shared = bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == shared
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    assert bm.block_table("b")[2] not in bm.block_table("a")
    assert bm.stats.hit_tokens == 8 and bm.stats.queried_tokens == len(a) + len(b)
    bm.free("a")
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]


def test_the_last_prompt_token_is_always_computed() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    p = toks(8)
    bm.allocate("a", p, 8)
    bm.commit("a", p, 8)
    # The same 8-token prompt again: only the first block is served from cache, because the
    # last token must be run to get the next token's logits.
    assert bm.allocate("b", p, 8) == 4


def test_hash_chains_so_a_block_matches_only_after_the_same_prefix() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    bm.allocate("a", a, 9)
    bm.commit("a", a, 9)
    # Same second block, different first block: no hit at all.
    assert bm.cached_prefix([0, 0, 0, 0, 5, 6, 7, 8, 9]) == []
    assert len(bm.cached_prefix(a)) == 2


def test_freed_cached_blocks_are_evicted_least_recently_used_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = [1, 2, 3], [7, 8, 9]
    for name, p in (("old", old), ("new", new)):
        bm.allocate(name, p, 3)
        bm.commit(name, p, 2)  # first block full and computed
        bm.free(name)
    assert bm.num_free_blocks == 4
    # Two blocks are empty; the third allocation evicts the older cached block, not the newer.
    bm.allocate("x", toks(6, 50), 6)
    assert bm.cached_prefix(old) == [] and len(bm.cached_prefix(new)) == 1
    # A hit on an evictable block takes it out of the eviction pool.
    bm.free("x")
    assert bm.allocate("y", new, 3) == 2
    assert bm.blocks[bm.block_table("y")[0]].ref_count == 1


def test_tail_blocks_are_evicted_before_the_blocks_they_extend() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    p = [1, 2, 3, 4, 5]
    bm.allocate("a", p, 5)
    bm.commit("a", p, 4)
    bm.free("a")  # blocks [1,2] and [3,4] cached, [5] freed empty
    bm.allocate("x", toks(4, 50), 4)  # takes the empty block and evicts one cached block
    assert len(bm.cached_prefix(p)) == 1  # the head survived, the tail went


def test_can_allocate_counts_evictable_hits_correctly() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    p = [1, 2, 3]
    bm.allocate("a", p, 3)
    bm.commit("a", p, 2)
    bm.free("a")
    # 2 blocks needed, 1 is an evictable hit, so 1 more from a pool of (2 free - that hit) = 1.
    assert bm.can_allocate(p, 3)
    assert not bm.can_allocate(p + [4, 5], 5)


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, prefix_caching=False)
    p = [1, 2, 3, 4, 5]
    bm.allocate("a", p, 5)
    bm.commit("a", p, 5)
    assert bm.allocate("b", p, 5) == 0


def test_out_of_blocks_without_checking_is_a_clear_error() -> None:
    bm = BlockManager(num_blocks=1, block_size=2)
    bm.allocate("a", [1, 2], 2)
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.append_slot("a", 3)


def test_control_code_imports_no_torch() -> None:
    import subprocess

    code = "import sys, tidegate.worker.engine.block_manager, tidegate.worker.engine.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
