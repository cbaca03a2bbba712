"""``tidegate.routing.cache_announcement``: records and packed hashes survive the trip, damaged
ones read as nothing, and announce/read/withdraw against a real Redis."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis

from tidegate import keys
from tidegate.routing.cache_announcement import (
    CacheAnnouncement,
    announce,
    pack_hashes,
    read_hashes,
    read_table,
    unpack_hashes,
    withdraw,
)

MODEL = "random_tiny"


def record(worker_id: str, version: int = 1) -> CacheAnnouncement:
    return CacheAnnouncement(worker_id=worker_id, block_size=16, seats=8, busy=3, queued=1,
                             at_ms=1_000, expires_ms=11_000, version=version)


def packed(hashes: list[int]) -> bytes:
    return b"".join(h.to_bytes(8, "little") for h in hashes)


def test_a_record_round_trips() -> None:
    r = record("w1", version=7)
    assert CacheAnnouncement.from_json(r.to_json()) == r


@pytest.mark.parametrize("raw", [
    "", "not json", "null", "[]", "1", '"w1"', "{}",
    '{"worker_id": "w1"}',
    record("w1").to_json().replace('"seats":8', '"seats":"many"'),
    record("w1").to_json().replace('"busy":3', '"busy":null'),
])
def test_a_damaged_record_reads_as_none(raw: str) -> None:
    assert CacheAnnouncement.from_json(raw) is None


def test_hashes_round_trip() -> None:
    hashes = [0, 1, 2**64 - 1, 0x0123456789ABCDEF]
    assert unpack_hashes(pack_hashes(packed(hashes))) == frozenset(hashes)
    assert unpack_hashes(pack_hashes(b"")) == frozenset()


@pytest.mark.parametrize("raw", [None, "", "!!not base64!!", "QUJD\n", "QUJ"])
def test_missing_or_bad_hashes_read_as_none(raw: str | None) -> None:
    assert unpack_hashes(raw) == frozenset()


def test_a_trailing_partial_hash_is_dropped() -> None:
    assert unpack_hashes(pack_hashes(packed([5]) + b"\x01\x02")) == frozenset({5})


async def test_announce_read_and_withdraw(aredis: aioredis.Redis) -> None:
    await announce(aredis, MODEL, record("w1"), packed([1, 2, 3]))
    await announce(aredis, MODEL, record("w2", version=4), packed([3, 4]))
    assert await read_table(aredis, MODEL) == {"w1": record("w1"), "w2": record("w2", 4)}
    assert await read_hashes(aredis, ["w1", "w2", "w3"]) == {
        "w1": frozenset({1, 2, 3}), "w2": frozenset({3, 4}), "w3": frozenset()}
    assert await read_hashes(aredis, []) == {}
    # A record without hashes keeps the ones announced before.
    await announce(aredis, MODEL, record("w1", version=1), None)
    assert (await read_hashes(aredis, ["w1"]))["w1"] == frozenset({1, 2, 3})

    await withdraw(aredis, MODEL, "w1")
    assert await read_table(aredis, MODEL) == {"w2": record("w2", 4)}
    assert await read_hashes(aredis, ["w1", "w2"]) == {
        "w1": frozenset(), "w2": frozenset({3, 4})}


async def test_read_table_skips_damaged_and_misfiled_records(aredis: aioredis.Redis) -> None:
    await announce(aredis, MODEL, record("w1"), packed([1]))
    await aredis.hset(keys.routing_table(MODEL), mapping={
        "w2": "garbage", "w3": record("w4").to_json()})
    assert await read_table(aredis, MODEL) == {"w1": record("w1")}


@pytest.mark.parametrize("field,value", [("seats", "Infinity"), ("block_size", "0"),
                                         ("seats", "0")])
def test_a_record_no_router_could_use_reads_as_none(field: str, value: str) -> None:
    raw = json.loads(CacheAnnouncement("a", 4, 4, 0, 0, 1, 2, 3).to_json())
    text = json.dumps(raw).replace(f'"{field}": {raw[field]}', f'"{field}": {value}')
    assert value in text
    assert CacheAnnouncement.from_json(text) is None
