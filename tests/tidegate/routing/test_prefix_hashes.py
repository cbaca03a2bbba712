"""``tidegate.routing.prefix_hashes``: the API's prompt block hashes are exactly the ones the
worker's block manager registers for the same prompt, and what it announces of them."""

from __future__ import annotations

from tidegate.routing.prefix_hashes import adapter_salt, block_hash, prompt_block_hashes, short
from tidegate.worker.engine.block_manager import BlockManager

BS = 4


def committed(bm: BlockManager, seq_id: str, ids: list[int], salt: bytes | None = None) -> None:
    """Allocate and compute a whole prompt, registering its full blocks."""
    bm.allocate(seq_id, ids, len(ids), salt)
    bm.commit(seq_id, ids, num_computed=len(ids))


def registered(bm: BlockManager, seq_id: str) -> list[bytes]:
    """The hashes the request's blocks were registered under, in table order."""
    return [h for b in bm.block_table(seq_id) if (h := bm.blocks[b].hash) is not None]


def test_prompt_hashes_are_the_block_managers() -> None:
    bm = BlockManager(num_blocks=64, block_size=BS)
    ids = list(range(10))  # two full blocks, then two tokens
    committed(bm, "a", ids)
    hashes = prompt_block_hashes(ids, BS)
    assert len(hashes) == 2
    assert registered(bm, "a") == hashes
    # A prompt sharing both blocks hits exactly them; one sharing the first only, the first.
    both = ids[:8] + [90, 91, 92]
    assert prompt_block_hashes(both, BS) == hashes
    assert bm.cached_prefix(both) == bm.block_table("a")[:2]
    first = ids[:4] + [80, 81, 82, 83, 84]
    assert prompt_block_hashes(first, BS)[0] == hashes[0]
    assert prompt_block_hashes(first, BS)[1] != hashes[1]
    assert bm.cached_prefix(first) == bm.block_table("a")[:1]


def test_recent_hashes_pack_the_newest_short_hashes_first() -> None:
    bm = BlockManager(num_blocks=64, block_size=BS)
    committed(bm, "a", list(range(9)))  # registers 2 blocks
    committed(bm, "b", list(range(100, 113)))  # registers 3 more
    order = prompt_block_hashes(list(range(9)), BS) + prompt_block_hashes(
        list(range(100, 113)), BS)
    newest_first = [short(h).to_bytes(8, "little") for h in reversed(order)]
    assert bm.recent_hashes(3) == b"".join(newest_first[:3])
    assert bm.recent_hashes(100) == b"".join(newest_first)
    assert bm.recent_hashes(0) == b""


def test_only_blocks_wholly_before_the_last_token_count() -> None:
    assert prompt_block_hashes(list(range(2 * BS)), BS) == [block_hash(None, range(BS))]
    assert len(prompt_block_hashes(list(range(2 * BS + 1)), BS)) == 2
    assert prompt_block_hashes(list(range(BS)), BS) == []
    assert prompt_block_hashes(list(range(BS + 1)), BS) == [block_hash(None, range(BS))]
    assert prompt_block_hashes([], BS) == []


def test_an_adapter_salt_changes_every_hash_and_none_does_not_salt() -> None:
    ids = list(range(13))
    plain = prompt_block_hashes(ids, BS)
    salted = prompt_block_hashes(ids, BS, adapter_salt("x"))
    assert len(salted) == len(plain) == 3
    assert not set(salted) & set(plain)
    assert salted != prompt_block_hashes(ids, BS, adapter_salt("y"))
    assert adapter_salt(None) is None
    assert prompt_block_hashes(ids, BS, None) == plain
    assert plain[0] == block_hash(None, ids[:BS])
    # The block manager salts alike: the base model's blocks never serve the adapter's.
    bm = BlockManager(num_blocks=64, block_size=BS)
    committed(bm, "a", ids, adapter_salt("x"))
    assert registered(bm, "a") == salted
    assert bm.cached_prefix(ids) == []
    assert len(bm.cached_prefix(ids, adapter_salt("x"))) == 3


def test_changes_count_registrations_and_evictions() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    assert bm.changes == 0
    committed(bm, "a", list(range(9)))  # two full blocks registered, the third partial
    assert bm.changes == 2
    bm.free("a")  # cached, evictable: nothing changed yet
    assert bm.changes == 2
    committed(bm, "b", list(range(9)))  # both hits: nothing new
    assert bm.changes == 2
    bm.free("b")
    bm.allocate("c", list(range(50, 59)), 9)  # needs all three blocks: evicts both
    assert bm.changes == 4
    assert bm.recent_hashes(10) == b""
    bm.commit("c", list(range(50, 59)), num_computed=9)
    assert bm.changes == 6
