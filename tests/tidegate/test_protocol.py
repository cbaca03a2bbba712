"""The wire protocol rejects what it must and round-trips what it carries."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tidegate import keys
from tidegate.protocol import (
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_LIMIT,
    Job,
    JobRequest,
    SamplingParams,
    TokenEvent,
    TopLogprob,
    is_final,
    parse_event,
    token_event_json,
)


def test_job_request_defaults_and_deadline_from_timeout() -> None:
    req = JobRequest(prompt="hi", timeout_s=5)
    job = req.to_job(model="random_tiny", default_timeout_s=300)
    assert job.deadline_ms - job.created_ms == 5000
    assert job.sampling.temperature == 0.0 and job.lane == "interactive"
    assert JobRequest(prompt="hi").to_job(model="random_tiny", default_timeout_s=2).deadline_ms - job.created_ms < 2100


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
        ({"prompt": "hi", "min_p": -0.1}, "min_p"),
        ({"prompt": "hi", "min_p": 1.5}, "min_p"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "hi", "repetition_penalty": 10.5}, "repetition_penalty"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "presence_penalty": -2.5}, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "hi", "logprobs": -1}, "logprobs"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "logprobs": True}, "logprobs"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "hi", "stop_token_ids": ["2"]}, "stop_token_ids"),
        ({"prompt": "hi", "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
        ({"prompt": "hi", "ignore_eos": "maybe"}, "ignore_eos"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "nickname": "bob"}]}, "messages"),
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


def test_sampling_defaults_change_nothing() -> None:
    params = SamplingParams()
    assert (params.min_p, params.repetition_penalty, params.presence_penalty,
            params.frequency_penalty) == (0.0, 1.0, 0.0, 0.0)
    assert params.logprobs is None and params.stop_token_ids == [] and not params.ignore_eos


def test_new_sampling_fields_reach_the_job() -> None:
    fields = {"min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": -2,
              "frequency_penalty": 2, "logprobs": 20, "stop_token_ids": [0, 2], "ignore_eos": True}
    req = JobRequest(prompt="x", **fields)
    assert req.sampling().model_dump(include=set(fields)) == fields
    job = req.to_job(model="random_tiny", default_timeout_s=1)
    assert Job.model_validate_json(job.model_dump_json()).sampling == req.sampling()
    assert SamplingParams(logprobs=0).logprobs == 0


def test_logprobs_true_is_rejected_with_a_reason() -> None:
    with pytest.raises(ValidationError, match="not a boolean"):
        SamplingParams.model_validate({"logprobs": True})


def test_token_event_carries_optional_logprobs() -> None:
    plain = TokenEvent(id=3, job_id="j", index=0, text="a", token_ids=[1])
    assert plain.logprob is None and plain.top_logprobs is None
    top = [{"token_id": 7, "logprob": -0.25}, {"token_id": 9, "logprob": -2.0}]
    event = TokenEvent(id=4, job_id="j", index=1, text="b", token_ids=[7], logprob=-0.25,
                       top_logprobs=top)
    parsed = parse_event(event.model_dump_json())
    assert parsed == event and parsed.top_logprobs[1] == TopLogprob(token_id=9, logprob=-2.0)
    with pytest.raises(ValidationError):
        TopLogprob.model_validate({"token_id": 1, "logprob": -1.0, "text": "x"})


def test_job_round_trips_through_json() -> None:
    job = JobRequest(messages=[{"role": "user", "content": "é"}], seed=3).to_job(model="random_tiny", default_timeout_s=1)
    assert Job.model_validate_json(job.model_dump_json()) == job


def test_events_parse_by_type_and_final_types() -> None:
    raw = TokenEvent(id=3, job_id="j", index=0, text="Pa", token_ids=[42]).model_dump_json()
    event = parse_event(raw)
    assert isinstance(event, TokenEvent) and event.text == "Pa"
    assert json.loads(raw)["type"] == "token"
    assert not is_final(event) and is_final({"type": "done"}) and is_final({"type": "rejected"})


def test_all_keys_of_a_job_share_one_hash_tag() -> None:
    tags = {k.split("{")[1].split("}")[0] for k in (keys.job_hash("abc"), keys.job_events("abc"))}
    assert tags == {"abc"}
    # Live events share a few channels, each with its own tag (sharded pub/sub), by a stable hash.
    shards = {keys.live_shard(f"job{i}") for i in range(1000)}
    assert shards == set(range(keys.LIVE_SHARDS))
    assert keys.live_shard("abc") == 2 and keys.job_live_channel("abc") == "tidegate:live:{s2}"
    assert keys.lane_stream("random_tiny", "batch", 0) != keys.lane_stream("random_tiny", "batch", 1)
    assert keys.is_valid_job_id("a-b_c") and not keys.is_valid_job_id("a b") and not keys.is_valid_job_id("")


@pytest.mark.parametrize("text", ["Pa", "", 'é"\\\n\x01\u2028 😀', "\t<tab> and </script>"])
def test_the_workers_token_encoder_writes_what_the_model_would(text: str) -> None:
    fast = token_event_json(7, "job-1_x", 4, text, [11, 12, 13])
    model = TokenEvent(id=7, job_id="job-1_x", index=4, text=text, token_ids=[11, 12, 13])
    assert fast == model.model_dump_json(exclude_none=True)
    assert parse_event(fast) == model
