"""Scheduler: token budget, chunked prefill, decode priority, lanes, deadlines, preemption."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import pytest

from tidegate.protocol import SamplingParams
from tidegate.worker.engine.block_manager import BlockManager
from tidegate.worker.engine.detokenizer import IncrementalDetokenizer
from tidegate.worker.engine.scheduler import (
    HOLD_MIN_TOKENS,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tidegate.worker.engine.sequence import SeqStatus, Sequence


class ByteDecoder:
    def decode(self, ids: Seq[int]) -> str:
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


_arrivals = iter(range(10**9))


def seq(rid: str, n_prompt: int, *, lane: str = "interactive", deadline: int | None = None,
        priority: int = 0, start: int = 0, adapter: str | None = None) -> Sequence:
    return Sequence(
        request_id=rid, prompt_ids=list(range(start, start + n_prompt)),
        params=SamplingParams(), detokenizer=IncrementalDetokenizer(ByteDecoder()), seed=0,
        arrival=next(_arrivals), lane=lane, priority=priority, deadline_ms=deadline,
        adapter=adapter,
    )


def make(num_blocks: int = 100, block_size: int = 4, **cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step without a model: schedule, commit, append a token where one is sampled."""
    out = s.schedule()
    s.commit(out)
    for c in out.chunks:
        if c.samples:
            c.seq.output_ids.append(token)
    return out


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_config_needs_room_for_every_decode() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)


def test_long_prompt_is_chunked_and_samples_only_at_its_end() -> None:
    s = make(max_num_seqs=4, max_num_batched_tokens=8)
    a = seq("a", 20)
    s.add(a)
    outs = [step(s) for _ in range(4)]
    assert [shape(o) for o in outs] == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)], [("a", 20, 1)]]
    assert [c.samples for o in outs for c in o.chunks] == [False, False, True, True]
    assert a.output_ids == [7, 7] and a.num_computed == 21


def test_decodes_go_first_and_a_long_prompt_fills_the_rest() -> None:
    s = make(max_num_seqs=4, max_num_batched_tokens=8)
    a, b = seq("a", 3), seq("b", 3)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled
    s.add(seq("long", 30))
    out = step(s)
    assert shape(out) == [("a", 3, 1), ("b", 3, 1), ("long", 0, 6)]
    assert out.num_decodes == 2 and out.num_batched_tokens == 8
    out = step(s)
    assert shape(out) == [("a", 4, 1), ("b", 4, 1), ("long", 6, 6)]


def test_sequence_cap_holds_back_waiting_requests() -> None:
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add(seq(f"r{i}", 4))
    assert [c.seq.request_id for c in step(s).chunks] == ["r0", "r1"]
    assert [x.request_id for x in s.waiting] == ["r2"]


def test_waiting_order_is_lane_then_priority_then_deadline_then_arrival() -> None:
    s = make(max_num_seqs=1, max_num_batched_tokens=64)
    s.add(seq("batch-early", 2, lane="batch", deadline=1))
    s.add(seq("late", 2, deadline=900))
    s.add(seq("none", 2))
    s.add(seq("soon", 2, deadline=100))
    s.add(seq("soon-2nd", 2, deadline=100))
    s.add(seq("vip", 2, deadline=5000, priority=5))
    assert [x.request_id for x in s.waiting] == [
        "vip", "soon", "soon-2nd", "late", "none", "batch-early"]


def test_prefix_cache_hit_skips_computed_prompt_tokens() -> None:
    s = make(max_num_seqs=4, max_num_batched_tokens=64)
    system = list(range(100, 112))  # three blocks of 4
    a = seq("a", 0)
    a.prompt_ids = system + [1, 2]
    s.add(a)
    step(s)
    b = seq("b", 0)
    b.prompt_ids = system + [3]
    s.add(b)
    out = step(s)
    assert ("b", 12, 1) in shape(out) and b.num_cached_prompt == 12
    assert s.blocks.stats.hit_tokens == 12


def test_out_of_blocks_preempts_the_latest_deadline_and_recomputes_it() -> None:
    # 6 blocks of 4 tokens; two requests of 8-token prompts grow until they collide.
    s = make(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    urgent, relaxed = seq("urgent", 8, deadline=100), seq("relaxed", 8, deadline=999, start=50)
    s.add(relaxed)
    s.add(urgent)
    step(s)  # 4 blocks used
    preempted_at = None
    for i in range(12):
        out = step(s)
        if out.preempted:
            preempted_at = i
            break
    assert preempted_at is not None
    assert [v.request_id for v in out.preempted] == ["relaxed"]
    assert relaxed.status is SeqStatus.WAITING and relaxed.num_computed == 0
    assert relaxed.num_preemptions == 1 and s.num_preemptions == 1
    assert [c.seq.request_id for c in out.chunks] == ["urgent"]  # nobody admitted that step
    generated = list(relaxed.output_ids)
    s.remove(urgent)  # urgent finishes; relaxed comes back and recomputes prompt + output
    out = step(s)
    # Its own freed blocks stayed in the prefix cache, so only the uncached tail is recomputed.
    chunk = out.chunks[0]
    assert chunk.seq is relaxed and chunk.start == 8 and chunk.start + chunk.num_tokens == 8 + len(generated)
    assert relaxed.output_ids[: len(generated)] == generated


def test_batch_lane_is_preempted_before_interactive() -> None:
    s = make(num_blocks=4, block_size=2, max_num_seqs=4, max_num_batched_tokens=32)
    inter, bulk = seq("inter", 3, deadline=10**12), seq("bulk", 3, lane="batch", deadline=1)
    s.add(inter)
    s.add(bulk)
    step(s)
    for _ in range(6):
        out = step(s)
        if out.preempted:
            break
    assert [v.request_id for v in out.preempted] == ["bulk"]


def test_a_request_that_is_itself_last_preempts_itself() -> None:
    s = make(num_blocks=3, block_size=2, max_num_seqs=4, max_num_batched_tokens=32)
    first, second = seq("first", 2, deadline=1), seq("second", 2, deadline=2)
    s.add(first)
    s.add(second)
    step(s)  # 2 blocks
    step(s)  # each needs a second block: one fits, the other preempts
    assert second.status is SeqStatus.WAITING and first.status is SeqStatus.RUNNING


def test_remove_releases_blocks_for_running_and_waiting() -> None:
    s = make(num_blocks=10, block_size=4, max_num_seqs=1, max_num_batched_tokens=16)
    a, b = seq("a", 5), seq("b", 5)
    s.add(a)
    s.add(b)
    step(s)
    assert s.blocks.num_free_blocks == 8
    s.remove(a)
    s.remove(b)
    assert s.blocks.num_free_blocks == 10 and not s.has_work()
    assert a.status is SeqStatus.FINISHED and b.status is SeqStatus.FINISHED


def test_a_pending_token_is_scheduled_as_a_decode_with_its_cache_slot() -> None:
    # Async scheduling: each step is scheduled before the last step's token is read back.
    s = make(block_size=4)
    a = seq("a", 4)
    s.add(a)
    launched = s.schedule()  # the prompt
    a.num_pending += 1
    for token in (100, 101, 102, 103):
        s.commit(launched)
        assert a.num_computed == a.num_known == a.num_tokens - 1  # all but the pending one
        nxt = s.schedule()
        assert shape(nxt) == [("a", a.num_computed, 1)] and nxt.chunks[0].samples
        assert len(s.blocks.block_table("a")) == 2  # from the first decode: its slot
        # Only the prompt's block is registered: no block holding a pending token.
        assert len(s.blocks.cached_prefix([*a.prompt_ids, *a.output_ids, 0, 0, 0, 0])) == 1
        a.num_pending += 1  # launched; then the last step's token is read back
        a.num_pending -= 1
        a.output_ids.append(token)
        launched = nxt
    s.commit(launched)  # block 1 is full and computed now, its tokens all read back
    assert len(s.blocks.cached_prefix([*a.prompt_ids, 100, 101, 102, 103, 0])) == 2
    assert len(s.blocks.cached_prefix([*a.prompt_ids, 100, 101, 102, 0, 0])) == 1


def test_a_request_holding_its_last_token_is_not_scheduled_again() -> None:
    s = make(block_size=4)
    a, b = seq("a", 4), seq("b", 3)
    a.max_num_tokens = 5  # max_tokens = 1
    s.add(a)
    s.add(b)
    out = s.schedule()
    a.num_pending = b.num_pending = 1
    s.commit(out)
    assert a.is_complete and not b.is_complete
    # a's pending token ends it once read: no chunk, no block for a position beyond its limit.
    assert shape(s.schedule()) == [("b", 3, 1)]
    assert len(s.blocks.block_table("a")) == 1


def test_running_adapters_stay_within_the_slots_and_a_refused_one_closes_the_door() -> None:
    s = make(max_num_seqs=8, max_num_batched_tokens=64, max_adapters=2)
    for rid, adapter in [("a1", "a"), ("b1", "b"), ("c1", "c"), ("base", None), ("a2", "a"),
                         ("d1", "d")]:
        s.add(seq(rid, 4, adapter=adapter))
    out = step(s)
    # c1 finds no slot: base may pass it, but a2 (a resident adapter) may not, so a and b drain.
    assert [c.seq.request_id for c in out.chunks] == ["a1", "b1", "base"]
    assert dict(s.adapters) == {"a": 1, "b": 1}
    for victim in [x for x in s.running if x.request_id in ("a1", "b1")]:
        s.remove(victim)
    assert not s.adapters
    out = step(s)
    assert [c.seq.request_id for c in out.chunks if c.num_tokens > 1] == ["c1", "a2"]
    assert dict(s.adapters) == {"c": 1, "a": 1}


def test_a_preempted_request_gives_back_its_adapter() -> None:
    s = make(num_blocks=3, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
             max_adapters=1)
    s.add(seq("a", 4, adapter="x", deadline=1))
    s.add(seq("b", 4, adapter="x", deadline=2))
    step(s)
    assert s.adapters["x"] == 2
    for _ in range(6):  # both grow until one is preempted
        step(s)
    assert s.num_preemptions >= 1
    assert s.adapters["x"] == len(s.running)


def test_the_prefix_cache_keeps_each_adapter_apart() -> None:
    s = make(max_num_seqs=4, max_num_batched_tokens=64, max_adapters=2)
    s.add(seq("base", 13))
    step(s)
    for rid, adapter in [("same", None), ("lora", "x")]:
        s.add(seq(rid, 13, adapter=adapter))
    out = step(s)
    computed = {c.seq.request_id: c.num_tokens for c in out.chunks if c.seq.request_id != "base"}
    assert computed == {"same": 1, "lora": 13}  # the base's 3 full blocks serve only the base


def test_holding_pending_requests_splits_the_running_into_turns() -> None:
    """Pipeline parallelism: a request whose token is still in flight sits the next step out,
    so consecutive steps hold different requests; once its token is in, it is scheduled."""
    s = make(max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq("a", 5), seq("b", 5, start=50)
    s.add(a)
    first = s.schedule(hold_pending=True)
    s.commit(first)
    a.num_pending += 1  # launched, its token not read yet
    s.add(b)
    second = s.schedule(hold_pending=True)
    assert [c.seq.request_id for c in second.chunks] == ["b"]
    s.commit(second)
    b.num_pending += 1
    assert s.schedule(hold_pending=True).chunks == []  # both in flight: nothing to run
    a.num_pending -= 1
    a.output_ids.append(9)  # a's token read back
    third = s.schedule(hold_pending=True)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in third.chunks] == [("a", 5, 1)]
    # Without holding, a pending decode is scheduled at once (async scheduling).
    assert [c.seq.request_id for c in s.schedule().chunks] == ["a", "b"]


def test_a_preempted_request_with_a_token_in_flight_waits_for_it() -> None:
    s = make(max_num_seqs=4, max_num_batched_tokens=64)
    a = seq("a", 5)
    s.add(a)
    s.commit(s.schedule(hold_pending=True))
    a.num_pending += 1
    s.remove(a)
    a.status = SeqStatus.WAITING  # preempted: back to waiting with its token in flight
    a.num_computed = 0
    s.waiting.append(a)
    assert s.schedule(hold_pending=True).chunks == []
    a.num_pending -= 1
    a.output_ids.append(3)
    # Admitted again (its first block from the prefix cache), up to its token just read.
    assert [(c.start, c.start + c.num_tokens) for c in s.schedule(hold_pending=True).chunks
            ] == [(4, 6)]


def test_a_step_takes_at_most_its_share_of_the_requests() -> None:
    """Pipeline parallelism: with a share of two, four requests make two steps of two."""
    s = make(max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [seq(f"s{i}", 3, start=10 * i) for i in range(4)]
    for q in seqs:
        s.add(q)
    first = s.schedule(hold_pending=True, max_seqs=2)
    assert [c.seq.request_id for c in first.chunks] == ["s0", "s1"]
    s.commit(first)
    for c in first.chunks:
        c.seq.num_pending += 1
    second = s.schedule(hold_pending=True, max_seqs=2)
    assert [c.seq.request_id for c in second.chunks] == ["s2", "s3"]
    s.commit(second)
    for q in seqs[:2]:  # the first step's tokens come back: those two run again
        q.num_pending -= 1
        q.output_ids.append(5)
    assert [c.seq.request_id for c in s.schedule(hold_pending=True, max_seqs=2).chunks] == [
        "s0", "s1"]


def test_a_request_waits_a_step_for_a_long_prefix_another_is_prefilling() -> None:
    """Two requests sharing a prompt of HOLD_MIN_TOKENS and more, arriving together: the
    second waits for the first's prefill and takes its blocks from the cache, instead of
    computing them beside it."""
    s = make(num_blocks=400, max_num_seqs=4, max_num_batched_tokens=1024)
    a, b = seq("a", HOLD_MIN_TOKENS + 9), seq("b", HOLD_MIN_TOKENS + 9)
    s.add(a)
    s.add(b)
    assert shape(step(s)) == [("a", 0, HOLD_MIN_TOKENS + 9)]
    assert b.status is SeqStatus.WAITING
    cached = (HOLD_MIN_TOKENS + 8) // 4 * 4
    assert shape(step(s)) == [("a", HOLD_MIN_TOKENS + 9, 1), ("b", cached, 9 + HOLD_MIN_TOKENS
                                                                 - cached)]
    assert s.prefix_hit_tokens == cached


def test_a_shorter_shared_prefix_is_computed_beside_rather_than_waited_for() -> None:
    s = make(num_blocks=400, max_num_seqs=4, max_num_batched_tokens=1024)
    a, b = seq("a", HOLD_MIN_TOKENS), seq("b", HOLD_MIN_TOKENS)  # one block short of it
    s.add(a)
    s.add(b)
    assert shape(step(s)) == [("a", 0, HOLD_MIN_TOKENS), ("b", 0, HOLD_MIN_TOKENS)]


def test_a_waiter_goes_on_when_the_request_it_waited_for_is_gone() -> None:
    s = make(num_blocks=400, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq("a", 2 * HOLD_MIN_TOKENS), seq("b", 2 * HOLD_MIN_TOKENS)
    s.add(a)
    s.add(b)
    assert shape(step(s)) == [("a", 0, 64)]  # a prefills in chunks; b waits for its blocks
    assert shape(step(s)) == [("a", 64, 64)] and b.status is SeqStatus.WAITING
    s.remove(a)  # cancelled: b computes the rest itself, from what a left in the cache
    assert shape(step(s)) == [("b", 128, 64)]


def test_requests_held_for_a_prefill_are_counted_apart() -> None:
    s = make(num_blocks=400, max_num_seqs=4, max_num_batched_tokens=1024)
    for name in "abc":
        s.add(seq(name, HOLD_MIN_TOKENS + 9))
    step(s)
    assert (len(s.waiting), s.num_held) == (2, 2)  # both wait for a's blocks, not for room
    step(s)
    assert (len(s.waiting), s.num_held) == (0, 0)


def test_step_budget_bounds_the_tokens_of_steps_that_decode() -> None:
    """``step_budget`` is asked with the step's decode count; its answer caps the step."""
    s = make(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64)
    asked: list[int] = []

    def budget(decodes: int) -> int:
        asked.append(decodes)
        return 64 if decodes == 0 else decodes + 10

    s.step_budget = budget
    s.add(seq("a", 6))
    s.add(seq("b", 6))
    assert shape(step(s)) == [("a", 0, 6), ("b", 0, 6)]  # nothing decodes: the whole budget
    s.add(seq("c", 40, start=100))
    # Two decodes and ten prompt tokens of c: c's prompt advances ten tokens a step.
    assert shape(step(s)) == [("a", 6, 1), ("b", 6, 1), ("c", 0, 10)]
    assert shape(step(s)) == [("a", 7, 1), ("b", 7, 1), ("c", 10, 10)]
    assert asked == [0, 2, 2]


def test_a_budget_above_the_engines_is_capped_by_it() -> None:
    s = make(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=16)
    s.step_budget = lambda decodes: 1000
    s.add(seq("a", 40))
    assert shape(step(s)) == [("a", 0, 16)]


def test_out_of_room_tells_a_token_budget_wait_from_a_memory_or_seat_wait() -> None:
    """Waiting for the step's token budget is not being out of room: the worker keeps reading
    jobs then. Waiting for KV blocks or for a seat is."""
    s = make(num_blocks=100, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    s.add(seq("a", 8))
    s.add(seq("b", 8, start=50))
    step(s)
    assert len(s.waiting) == 1 and not s.out_of_room  # b waits for budget only
    step(s)
    s.add(seq("c", 4, start=90))
    step(s)
    assert [q.request_id for q in s.waiting] == ["c"] and s.out_of_room  # two seats, both taken
    tight = make(num_blocks=3, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    tight.add(seq("x", 8))
    tight.add(seq("y", 8, start=50))
    step(tight)
    assert [q.request_id for q in tight.waiting] == ["y"] and tight.out_of_room  # no blocks
