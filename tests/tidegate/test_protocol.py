"""The wire protocol rejects what it must and round-trips what it carries."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tidegate import keys
from tidegate.protocol import (
    MAX_TOKENS_LIMIT,
    Job,
    JobRequest,
    TokenEvent,
    is_final,
    parse_event,
)


def test_job_request_defaults_and_deadline_from_timeout() -> None:
    req = JobRequest(prompt="hi", timeout_s=5)
    job = req.to_job(default_timeout_s=300)
    assert job.deadline_ms - job.created_ms == 5000
    assert job.sampling.temperature == 0.0 and job.lane == "interactive"
    assert JobRequest(prompt="hi").to_job(default_timeout_s=2).deadline_ms - job.created_ms < 2100


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "hi", "colour": "blue"}, "colour"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
        ({"prompt": "hi", "temperature": 3}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "lane": "vip"}, "lane"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages"),
    ],
)
def test_bad_job_requests_name_the_field(body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        JobRequest.model_validate(body)
    assert any(field in map(str, e["loc"]) for e in info.value.errors()), info.value.errors()


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt": "  "}, {"messages": []}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
     {"prompt": "a", "timeout_s": 1, "deadline_ms": 5}],
)
def test_prompt_and_deadline_shape_errors(body: dict) -> None:
    with pytest.raises(ValidationError):
        JobRequest.model_validate(body)


def test_stop_accepts_a_single_string() -> None:
    assert JobRequest(prompt="x", stop="\n").stop == ["\n"]


def test_job_round_trips_through_json() -> None:
    job = JobRequest(messages=[{"role": "user", "content": "é"}], seed=3).to_job(default_timeout_s=1)
    assert Job.model_validate_json(job.model_dump_json()) == job


def test_events_parse_by_type_and_final_types() -> None:
    raw = TokenEvent(id=3, job_id="j", index=0, text="Pa", token_ids=[42]).model_dump_json()
    event = parse_event(raw)
    assert isinstance(event, TokenEvent) and event.text == "Pa"
    assert json.loads(raw)["type"] == "token"
    assert not is_final(event) and is_final({"type": "done"}) and is_final({"type": "rejected"})


def test_all_keys_of_a_job_share_one_hash_tag() -> None:
    tags = {k.split("{")[1].split("}")[0] for k in
            (keys.job_hash("abc"), keys.job_events("abc"), keys.job_channel("abc"))}
    assert tags == {"abc"}
    assert keys.lane_stream("batch", 0) != keys.lane_stream("batch", 1)
    assert keys.is_valid_job_id("a-b_c") and not keys.is_valid_job_id("a b") and not keys.is_valid_job_id("")
