"""The chaos benchmark's stream checker on hand-made event sequences: what it accepts (restarts,
migrations, resumes) and each breach it must catch."""

from __future__ import annotations

import json

from tidegate.benchmarks.harness.load.stream_check import StreamCheck

JOB = "j1"


class Events:
    """Builds one job's events with ids 1, 2, 3... the way a worker writes them."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def add(self, kind: str, **fields: object) -> Events:
        self.events.append({"id": len(self.events) + 1, "job_id": JOB, "type": kind, **fields})
        return self

    def tokens(self, index: int, *texts: str) -> Events:
        return self.add("token", index=index, text="".join(texts),
                        token_ids=list(range(index, index + len(texts))))

    def done(self, text: str, tokens: int) -> Events:
        return self.add("done", finish_reason="length", text=text, timings={},
                        usage={"prompt_tokens": 3, "completion_tokens": tokens,
                               "total_tokens": 3 + tokens})


def checked(events: list[dict]) -> StreamCheck:
    check = StreamCheck(JOB)
    for event in events:
        check.on_raw(json.dumps(event))
    check.finish()
    return check


def started() -> Events:
    return Events().add("queued", lane="interactive").add("started", worker="w1",
                                                          prompt_tokens=3)


def test_an_exact_stream_has_no_problem() -> None:
    check = checked(started().tokens(0, "a", "b").tokens(2, "c").done("abc", 3).events)
    assert check.problems == [] and check.done and check.tokens == 3 and check.text == "abc"


def test_after_restarted_the_text_and_indices_start_again() -> None:
    events = (started().tokens(0, "x", "y").add("restarted", attempt=2)
              .add("started", worker="w2", prompt_tokens=3).tokens(0, "a").tokens(1, "b")
              .done("ab", 2)).events
    check = checked(events)
    assert check.problems == [] and check.restarts == 1 and check.migrations == 0


def test_after_migrated_the_stream_goes_on_from_the_kept_tokens() -> None:
    events = (started().tokens(0, "a", "b").add("migrated", worker="w2", attempt=2,
                                                  kept_tokens=2)
              .tokens(2, "c").done("abc", 3)).events
    check = checked(events)
    assert check.problems == [] and check.migrations == 1 and check.restarts == 0
    assert check.kept == [2]


def test_a_migration_keeping_other_than_the_tokens_held_is_caught() -> None:
    events = (started().tokens(0, "a", "b", "c").add("migrated", worker="w2", attempt=2,
                                                       kept_tokens=2)
              .tokens(2, "c").done("abcc", 4)).events
    check = checked(events)
    assert check.duplicate_tokens == 1
    assert any("keeping 2 tokens when 3" in p for p in check.problems)


def test_restarting_indices_after_migrated_are_duplicates() -> None:
    events = (started().tokens(0, "a").add("migrated", worker="w2", attempt=2, kept_tokens=1)
              .tokens(0, "a").done("aa", 1)).events
    check = checked(events)
    assert check.duplicate_tokens == 1 and check.problems


def test_duplicated_and_missing_tokens_are_counted() -> None:
    dup = checked(started().tokens(0, "a", "b").tokens(1, "b").done("abb", 2).events)
    assert dup.duplicate_tokens == 1 and dup.problems
    gap = checked(started().tokens(0, "a").tokens(3, "d").done("ad", 4).events)
    assert gap.missing_tokens == 2 and gap.problems


def test_duplicate_and_missing_event_ids_are_caught() -> None:
    events = started().tokens(0, "a").tokens(1, "b").done("ab", 2).events
    again = checked(events[:3] + [events[2]] + events[3:])
    assert again.duplicate_events == 1 and again.problems and again.text == "ab"
    skipped = checked(events[:2] + events[3:])
    assert skipped.missing_events == 1 and skipped.problems


def test_a_resumed_stream_is_one_sequence() -> None:
    events = started().tokens(0, "a").tokens(1, "b").done("ab", 2).events
    check = StreamCheck(JOB)
    for event in events[:3]:
        check.on_event(event)
    resume_after = check.last_id  # a new connection with last_event_id=3 gets what follows
    for event in events[resume_after:]:
        check.on_event(event)
    check.finish()
    assert check.problems == [] and check.text == "ab"


def test_final_event_breaches() -> None:
    events = started().tokens(0, "a").done("a", 1).events
    assert any("no final event" in p for p in checked(events[:-1]).problems)
    twice = checked(events + [{**events[-1], "id": len(events) + 1}])
    assert twice.finals == 1 and any("after the final event" in p for p in twice.problems)
    wrong_text = checked(events[:-1] + [{**events[-1], "text": "b"}])
    assert any("done text" in p for p in wrong_text.problems)
    wrong_count = started().tokens(0, "a").done("a", 2).events
    assert any("done says 2 tokens" in p for p in checked(wrong_count).problems)


def test_other_jobs_events_and_bad_frames_are_caught() -> None:
    events = started().tokens(0, "a").done("a", 1).events
    foreign = checked(events[:2] + [{**events[2], "job_id": "other"}] + events[2:])
    assert any("of job other" in p for p in foreign.problems)
    check = StreamCheck(JOB)
    check.on_raw("not json")
    check.on_raw(json.dumps({"type": "token"}))
    assert len(check.problems) == 2
    late_start = checked(Events().add("started", worker="w1", prompt_tokens=3)
                         .done("", 0).events)
    assert any("begins with started" in p for p in late_start.problems)


def test_a_stalled_stream_is_a_problem() -> None:
    check = StreamCheck(JOB)
    check.stalled(10, at=5.0)
    assert check.stalls == 1 and check.stalled_at == [5.0] and check.problems
