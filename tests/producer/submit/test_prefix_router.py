"""``tidegate.producer.submit.prefix_router.PrefixRouter``: where a job goes given the workers'
announcements and this router's own recent routes, with a fake clock and wall clock (no
Redis): the longest cached chain, load, first sight, predictions, expiry and tie-breaks."""

from __future__ import annotations

import pytest

from tidegate.producer.submit.prefix_router import BALANCE, PrefixRouter, Route
from tidegate.routing.cache_announcement import CacheAnnouncement
from tidegate.routing.prefix_hashes import prompt_block_hashes, short

BS = 4
NOW_MS = 1_000_000
PREDICT_S = 10.0
PROMPT = list(range(17))  # four full blocks before the last token


class Clocks:
    """A monotonic clock (seconds) and a wall clock (ms) the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0
        self.wall = NOW_MS

    def clock(self) -> float:
        return self.now

    def wall_ms(self) -> int:
        return self.wall


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


def router(clocks: Clocks, balance: float = 4.0) -> PrefixRouter:
    """A router whose load weighs little against PROMPT's 17 tokens (a worker's full seats
    cost a quarter of the prompt), so the tests below isolate matching; BALANCE itself is
    tested on its own."""
    return PrefixRouter(predict_s=PREDICT_S, balance=balance, clock=clocks.clock,
                        wall_ms=clocks.wall_ms)


def rec(worker_id: str, *, seats: int = 4, busy: int = 0, queued: int = 0, at_ms: int = NOW_MS,
        expires_ms: int = NOW_MS + 10_000, version: int = 1) -> CacheAnnouncement:
    return CacheAnnouncement(worker_id=worker_id, block_size=BS, seats=seats, busy=busy,
                             queued=queued, at_ms=at_ms, expires_ms=expires_ms, version=version)


def held(prompt: list[int], blocks: slice) -> frozenset[int]:
    """The short hashes of some of the prompt's blocks, as a worker would announce them."""
    return frozenset(short(h) for h in prompt_block_hashes(prompt, BS)[blocks])


def table(*records: CacheAnnouncement) -> dict[str, CacheAnnouncement]:
    return {r.worker_id: r for r in records}


def test_no_live_worker_means_the_shared_lane(clocks: Clocks) -> None:
    r = router(clocks)
    assert r.route(PROMPT) == Route(None, "shared")
    r.observe(table(rec("a", expires_ms=NOW_MS)), {"a": held(PROMPT, slice(None))})
    assert r.route(PROMPT) == Route(None, "shared")


@pytest.mark.parametrize("length", [0, 1, BS])
def test_a_prompt_without_a_full_block_goes_to_the_shared_lane(clocks: Clocks,
                                                               length: int) -> None:
    r = router(clocks)
    r.observe(table(rec("a")), {"a": frozenset()})
    assert r.route(PROMPT[:length]) == Route(None, "shared")
    assert r.route(PROMPT[:BS + 1]) == Route("a", "placed", 0)


def test_the_longest_chain_wins(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a"), rec("b"), rec("c")),
              {"a": held(PROMPT, slice(0, 2)), "b": held(PROMPT, slice(0, 3)), "c": frozenset()})
    assert r.route(PROMPT) == Route("b", "cached", 3)


def test_a_chain_counts_from_the_first_block_only(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a"), rec("b", busy=1)),
              {"a": held(PROMPT, slice(1, 4)), "b": held(PROMPT, slice(0, 3))})
    assert r.route(PROMPT) == Route("b", "cached", 3)


def test_an_adapters_prompt_matches_only_its_salted_blocks(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a"), rec("b", busy=1)),
              {"a": frozenset(), "b": held(PROMPT, slice(None))})
    assert r.route(PROMPT, b"lora\0x").matched_blocks == 0


def test_expired_records_are_ignored(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a", expires_ms=NOW_MS), rec("b", busy=3)),
              {"a": held(PROMPT, slice(None)), "b": frozenset()})
    assert r.route(PROMPT) == Route("b", "placed", 0)
    assert r.live() == ["b"]


def test_first_sight_places_on_the_least_loaded_then_predicts(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a", busy=2), rec("b", busy=1, queued=1), rec("c", queued=1)),
              {"a": frozenset(), "b": frozenset(), "c": frozenset()})
    assert r.route(PROMPT) == Route("c", "placed", 0)
    # No announcement shows it yet: the router's own route counts as a match.
    assert r.route(PROMPT) == Route("c", "cached", 4)
    assert r.route(PROMPT[:9] + [70, 71]) == Route("c", "cached", 2)


def test_predictions_expire_after_predict_s(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a"), rec("b", busy=1)), {"a": frozenset(), "b": frozenset()})
    assert r.route(PROMPT) == Route("a", "placed", 0)
    clocks.now += PREDICT_S - 0.5
    assert r.route(PROMPT) == Route("a", "cached", 4)  # renews the prediction
    clocks.now += PREDICT_S
    # "a" has now taken two jobs: the least loaded is "b" again ("b" busy 1 < "a" sent 2).
    assert r.route(PROMPT) == Route("b", "placed", 0)


def test_a_saturated_holder_is_passed_over_for_a_free_seat(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a", seats=2, busy=1, queued=1), rec("b", seats=2), rec("c", seats=2)),
              {"a": held(PROMPT, slice(None)), "b": held(PROMPT, slice(0, 3)),
               "c": frozenset()})
    assert r.route(PROMPT) == Route("b", "cached", 3)


def test_jobs_sent_count_toward_a_full_worker(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a", seats=2, busy=1), rec("b", seats=2)),
              {"a": held(PROMPT, slice(None)), "b": frozenset()})
    assert r.route(PROMPT) == Route("a", "cached", 4)  # now busy 1 + sent 1: full
    assert r.route(PROMPT) == Route("b", "placed", 0)


def test_when_every_worker_is_full_the_best_holder_takes_it(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a", seats=1, busy=2), rec("b", seats=1, busy=1),
                    rec("c", seats=1, queued=1)),
              {"a": held(PROMPT, slice(0, 3)), "b": held(PROMPT, slice(0, 1)),
               "c": frozenset()})
    assert r.route(PROMPT) == Route("a", "cached", 3)


def test_a_newer_record_resets_the_jobs_sent(clocks: Clocks) -> None:
    r = router(clocks)
    hashes = {"a": held(PROMPT, slice(None)), "b": frozenset()}
    r.observe(table(rec("a", seats=1), rec("b", seats=1)), hashes)
    assert r.route(PROMPT).worker_id == "a"
    # The same record again: "a" still counts the job sent, and is full.
    r.observe(table(rec("a", seats=1), rec("b", seats=1)), {})
    assert r.route(PROMPT).worker_id == "b"
    # A newer record of "a" counts what it took itself: sent starts again.
    r.observe(table(rec("a", seats=1, at_ms=NOW_MS + 1), rec("b", seats=1)), {})
    assert r.route(PROMPT) == Route("a", "cached", 4)


def test_stale_lists_the_live_workers_new_or_with_a_new_version(clocks: Clocks) -> None:
    r = router(clocks)
    first = table(rec("a"), rec("b"), rec("gone", expires_ms=NOW_MS))
    assert r.stale(first) == ["a", "b"]
    r.observe(first, {"a": frozenset(), "b": frozenset()})
    assert r.stale(first) == []
    later = table(rec("a", version=2), rec("b"), rec("c"), rec("gone", expires_ms=NOW_MS))
    assert r.stale(later) == ["a", "c"]


def test_new_hashes_replace_old_and_unfetched_ones_stay(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a"), rec("b", busy=1)), {"a": held(PROMPT, slice(None)),
                                                 "b": frozenset()})
    r.observe(table(rec("a"), rec("b", busy=1, version=2)), {"b": held(PROMPT, slice(0, 2))})
    assert r.route(PROMPT) == Route("a", "cached", 4)
    r.observe(table(rec("a", version=2), rec("b", busy=1, version=2)), {"a": frozenset()})
    clocks.now += PREDICT_S  # the route above no longer counts for "a"
    assert r.route(PROMPT[:9] + [9, 9, 9]) == Route("b", "cached", 2)


@pytest.mark.parametrize("prompt_start", range(8))
def test_independent_routers_place_a_new_prefix_alike(clocks: Clocks, prompt_start: int) -> None:
    prompt = list(range(prompt_start * 100, prompt_start * 100 + 9))
    records = [rec(w, busy=1) for w in ("w0", "w1", "w2", "w3")]
    one, two = router(clocks), router(clocks)
    one.observe(table(*records), {})
    two.observe(table(*reversed(records)), {})
    assert one.route(prompt) == two.route(prompt)
    assert one.route(prompt).kind == "cached"  # its own prediction now


def test_rendezvous_spreads_new_prefixes_over_equally_loaded_workers(clocks: Clocks) -> None:
    chosen: set[str | None] = set()
    for start in range(40):
        r = router(clocks)
        r.observe(table(*(rec(w) for w in ("w0", "w1", "w2", "w3"))), {})
        chosen.add(r.route(list(range(start * 100, start * 100 + 9))).worker_id)
    assert chosen == {"w0", "w1", "w2", "w3"}


def test_a_version_first_seen_expired_is_fetched_once_live(clocks: Clocks) -> None:
    r = router(clocks)
    r.observe(table(rec("a", version=1)), {"a": held(PROMPT, slice(None))})
    expired_v2 = table(rec("a", version=2, expires_ms=NOW_MS - 1))
    assert r.stale(expired_v2) == []  # not fetched while expired...
    r.observe(expired_v2, {})
    assert r.stale(table(rec("a", version=2, at_ms=NOW_MS + 1))) == ["a"]  # ...but once live


def test_a_holder_keeps_a_prefix_until_it_leads_by_balance_times_its_seats(
        clocks: Clocks) -> None:
    """A worker holding the whole prompt keeps its jobs until it runs BALANCE x seats more
    than another (then the other computes the prefix too); a match of one block of four (a
    template's header) makes no holder: the prompt is new, and goes to the idler worker."""
    seats = 32
    lead = int(BALANCE * seats)
    for busy, where in ((lead - 1, "a"), (lead + 1, "b")):
        r = router(clocks, BALANCE)
        r.observe(table(rec("a", seats=seats, busy=busy), rec("b", seats=seats)),
                  {"a": held(PROMPT, slice(None)), "b": frozenset()})
        assert r.route(PROMPT).worker_id == where, busy
    r = router(clocks, BALANCE)
    r.observe(table(rec("a", seats=16, busy=1), rec("b", seats=16)),
              {"a": held(PROMPT, slice(0, 1)), "b": frozenset()})
    assert r.route(PROMPT) == Route("b", "placed", 0)


def test_a_new_prefix_goes_where_the_least_traffic_went_lately(clocks: Clocks) -> None:
    """Matches of under half the prompt (a shared header) don't hold a new prefix: it goes to
    the worker this router sent the fewest jobs lately; its later jobs follow it there."""
    r = router(clocks)
    r.observe(table(rec("a", seats=64), rec("b", seats=64)),
              {"a": held(PROMPT, slice(0, 1)), "b": frozenset()})
    first_prompt, second_prompt = PROMPT[:4] + [7] * 13, PROMPT[:4] + [8] * 13
    first, second = r.route(first_prompt), r.route(second_prompt)
    assert first.kind == second.kind == "placed"
    assert {first.worker_id, second.worker_id} == {"a", "b"}
    assert r.route(first_prompt[:16] + [5]) == Route(first.worker_id, "cached", 4)
    assert r.route(second_prompt[:16] + [5]) == Route(second.worker_id, "cached", 4)
