"""Structured outputs, tool calls and the rest of the OpenAI surface through the whole stack
(`tidegate up`: API, gateway, worker and Redis as processes), driven by the official ``openai``
client as a backend service drives it.

Every fixture schema (tests/fixtures/json_schemas.json) on the real default model and on
``random:tiny``: a random model writes noise, so only the grammar's token mask makes its output
parse and validate. Every other constraint kind stream and not; tool calls read back by the
client's own parsers and sent back as ``role: tool`` turns; ``n`` choices (greedy identical,
seeded reproducible per choice); ``logit_bias``; ``echo``; a schema the engine cannot compile is
a 422 naming its part; the Python client and the batch lane carry the same fields.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.conftest import RedisServer
from tests.stack_process import run_batch, tidegate_up
from tidegate.producer.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FIXTURES = json.loads((Path(__file__).parents[1] / "fixtures/json_schemas.json").read_text())
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module", params=["random:tiny", "smollm2"])
def stack(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    with tidegate_up(redis_server, model=request.param) as url:
        yield request.param, url


def _format(fixture: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": fixture["name"], "schema": fixture["schema"], "strict": True}}


def _ask(fixture: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give one example of a {fixture['name']} as JSON."}]


def _budget(model: str) -> dict[str, Any]:
    """Sampling for a model: a random one samples (seeded) so that each string ends, with
    room for a byte-level vocabulary's long spellings; the real one is greedy. A generous
    deadline: two CPU cores run these, and the worker sheds what it cannot finish in time."""
    if model.startswith("random"):
        return {"max_tokens": 1500, "temperature": 1.0, "extra_body": {"timeout_s": 1800}}
    return {"max_tokens": 600, "temperature": 0.0, "extra_body": {"timeout_s": 1800}}


async def _every_fixture(url: str, model: str) -> list[tuple[str, str, str]]:
    """(name, finish_reason, text) of every fixture, sixteen in flight at a time."""
    gate = asyncio.Semaphore(16)
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                           timeout=1800) as client:
        async def one(i: int, fixture: dict[str, Any]) -> tuple[str, str, str]:
            async with gate:
                r = await client.chat.completions.create(
                    model="tidegate", messages=_ask(fixture), response_format=_format(fixture),
                    seed=i, **_budget(model))
            return fixture["name"], r.choices[0].finish_reason, r.choices[0].message.content or ""

        return await asyncio.gather(*(one(i, f) for i, f in enumerate(FIXTURES)))


def test_every_fixture_schema_gives_valid_json(stack: tuple[str, str]) -> None:
    model, url = stack
    answers = asyncio.run(_every_fixture(url, model))
    assert len(answers) >= 50
    for (name, reason, text), fixture in zip(answers, FIXTURES, strict=True):
        assert reason == "stop", (name, reason, text)
        jsonschema.validate(json.loads(text), fixture["schema"])


async def _streamed_and_whole(url: str, model: str) -> list[tuple[list[Any], str]]:
    """Every tenth fixture asked twice at once, streamed and whole: (chunks, whole text) each.
    All in flight together, as a service's clients ask: a job's tokens do not depend on what
    else shares its batch."""
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                           timeout=300) as client:
        async def both(i: int, fixture: dict[str, Any]) -> tuple[list[Any], str]:
            kwargs: dict[str, Any] = dict(model="tidegate", messages=_ask(fixture),
                                          response_format=_format(fixture), seed=i,
                                          **_budget(model))

            async def streamed() -> list[Any]:
                return [c async for c in await client.chat.completions.create(stream=True,
                                                                              **kwargs)]

            chunks, whole = await asyncio.gather(streamed(),
                                                 client.chat.completions.create(**kwargs))
            return chunks, whole.choices[0].message.content or ""

        return await asyncio.gather(*(both(i, f) for i, f in enumerate(FIXTURES[::10])))


def test_streamed_schemas_equal_their_answers(stack: tuple[str, str]) -> None:
    model, url = stack
    answers = asyncio.run(_streamed_and_whole(url, model))
    assert len(answers) == len(FIXTURES[::10])
    for (chunks, whole), fixture in zip(answers, FIXTURES[::10], strict=True):
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(streamed), fixture["schema"])
        # Seeded: the same request answered whole gives the same text.
        assert whole == streamed


@pytest.mark.parametrize("stream", [False, True])
def test_every_constraint_kind(stack: tuple[str, str], stream: bool) -> None:
    model, url = stack
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    kinds: list[tuple[str, dict[str, Any], Any]] = [
        ("Describe the planet Mars as a JSON object.", {"type": "json_object"},
         lambda t: isinstance(json.loads(t), dict)),
        ("Give a product code.", {"type": "regex", "pattern": r"[A-Z]{2}-[0-9]{3,5}"},
         lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3,5}", t)),
        ("Is 'I love it' positive?",
         {"type": "choice", "choices": ["positive", "negative", "neutral"]},
         lambda t: t in ("positive", "negative", "neutral")),
        # At most three columns: the grammar itself ends the text. With (", " COL)* the end
        # was the model's choice, and greedy decoding on an AVX2 CPU (other float rounding
        # than AVX-512's) wrote "t, t, t, ..." until max_tokens.
        ("Write a SQL query that selects two columns from table t.",
         {"type": "grammar", "syntax": "lark",
          "grammar": 'start: "SELECT " COL (", " COL)? (", " COL)? " FROM t"\n'
                     'COL: /[a-z]{1,8}/'},
         lambda t: re.fullmatch(r"SELECT [a-z]{1,8}(, [a-z]{1,8}){0,2} FROM t", t)),
        ("Will it rain?", {"type": "grammar", "syntax": "gbnf",
                           "grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'},
         lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
    ]
    for i, (question, fmt, valid) in enumerate(kinds):
        budget = _budget(model)
        kwargs: dict[str, Any] = dict(model="tidegate", seed=i,
                                      messages=[{"role": "user", "content": question}], **budget)
        if fmt["type"] in ("json_object", "json_schema"):
            kwargs["response_format"] = fmt
        else:  # tidegate's kinds beyond OpenAI's: the client sends them as extra fields
            kwargs["extra_body"] = {**budget["extra_body"], "response_format": fmt}
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, reason = choice.message.content or "", choice.finish_reason
        if fmt["type"] == "json_object" and model.startswith("random") and reason == "length":
            continue  # any object: noise may write keys until the budget (no bound to end on)
        assert reason == "stop" and valid(text), (fmt, text)


def test_a_schema_the_engine_cannot_compile_is_a_422_naming_its_part(
        stack: tuple[str, str]) -> None:
    _, url = stack
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    schema = {"type": "object", "properties": {
        "when": {"type": "object", "properties": {"day": {"type": "string",
                                                          "format": "lunar-date"}}}}}
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(
            model="tidegate", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": schema}})
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == "response_format.json_schema.schema.properties.when.properties.day"
    assert "lunar-date" in body["message"]


def test_forced_tool_calls_round_trip_through_the_clients_parsers(
        stack: tuple[str, str]) -> None:
    model, url = stack
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    if model == "smollm2":  # its template renders no tools: refused by name
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tidegate", messages=ask, tools=[WEATHER])
        assert info.value.param == "tools" and "tool-call format" in info.value.message
        return
    params = WEATHER["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = client.chat.completions.create(
            model="tidegate", messages=ask, tools=[WEATHER, TIME], tool_choice=choice,
            parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=1)
        message = response.choices[0].message
        assert response.choices[0].finish_reason == "tool_calls"
        calls = message.tool_calls or []
        assert len(calls) == 1 and calls[0].id.startswith("call_")
        if isinstance(choice, dict):
            assert calls[0].function.name == "get_weather"
        spec = WEATHER if calls[0].function.name == "get_weather" else TIME
        jsonschema.validate(json.loads(calls[0].function.arguments),
                            spec["function"]["parameters"])
        # Streamed: the openai client's stream accumulator rebuilds the same call.
        with client.chat.completions.stream(
                model="tidegate", messages=ask, tools=[WEATHER, TIME], tool_choice=choice,
                parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=1) as events:
            final = events.get_final_completion()
        streamed = final.choices[0].message.tool_calls or []
        assert final.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in calls]
    # The answer goes back as a tool turn, and the conversation goes on.
    call = calls[0]
    follow = client.chat.completions.create(
        model="tidegate", tools=[WEATHER], max_tokens=8, temperature=0, messages=[
            *ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # With tool_choice "auto" the reply is free; "none" renders no tools and forces nothing.
    free = client.chat.completions.create(model="tidegate", messages=ask, tools=[WEATHER],
                                          tool_choice="none", max_tokens=8, temperature=0)
    assert free.choices[0].message.tool_calls is None
    assert json.loads(call.function.arguments).keys() == params["properties"].keys()


def test_n_choices_logit_bias_and_echo(stack: tuple[str, str]) -> None:
    model, url = stack
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "Name a fruit."}]
    greedy = client.chat.completions.create(model="tidegate", messages=ask, n=4, max_tokens=12,
                                            temperature=0)
    texts = [c.message.content for c in greedy.choices]
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert len(set(texts)) == 1 and texts[0]
    assert greedy.usage is not None and greedy.usage.completion_tokens % 4 == 0
    seeded = client.chat.completions.create(model="tidegate", messages=ask, n=3, max_tokens=12,
                                            temperature=1.0, seed=40, logprobs=True,
                                            top_logprobs=2)
    alone = client.chat.completions.create(model="tidegate", messages=ask, max_tokens=12,
                                           temperature=1.0, seed=41)
    # Choice k draws from seed + k: choice 1 of seed 40 is seed 41 on its own.
    assert seeded.choices[1].message.content == alone.choices[0].message.content
    assert all(c.logprobs and c.logprobs.content for c in seeded.choices)
    chunks = list(client.chat.completions.create(model="tidegate", messages=ask, n=3,
                                                 max_tokens=12, temperature=1.0, seed=40,
                                                 stream=True))
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[k] for k in range(3)] == [c.message.content for c in seeded.choices]
    # logit_bias: a banned token is never picked, a +100 one always is.
    prompt = "The capital of France is"
    plain = client.completions.create(model="tidegate", prompt=prompt, max_tokens=6,
                                      temperature=0)
    first = plain.choices[0].text
    ids = asyncio.run(_greedy_ids(url, prompt, {}))
    banned = asyncio.run(_greedy_ids(url, prompt, {ids[0]: -100}))
    assert ids[0] not in banned
    forced_id = _token_ids(model, "a")[-1]
    assert asyncio.run(_greedy_ids(url, prompt, {forced_id: 100})) == [forced_id] * 6
    forced = client.completions.create(model="tidegate", prompt=prompt, max_tokens=6,
                                       temperature=0, logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == "a" * 6
    echoed = client.completions.create(model="tidegate", prompt="The capital of France is",
                                       max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + first


async def _greedy_ids(url: str, prompt: str, bias: dict[int, float]) -> list[int]:
    """The token ids of a greedy job through the Python client (its events carry them)."""
    async with Client(url) as client:
        handle = await client.submit(prompt, max_tokens=6, temperature=0, ignore_eos=True,
                                     logit_bias=bias or None)
        return [i async for e in handle.events() if e.type == "token" for i in e.token_ids]


def _token_ids(model: str, text: str) -> list[int]:
    from tidegate.model_files.model_source import resolve_model
    from tidegate.model_files.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(model))
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def test_the_python_client_and_the_batch_lane_carry_the_fields(
        stack: tuple[str, str], redis_server: RedisServer, tmp_path: Path) -> None:
    model, url = stack
    fixture = FIXTURES[0]
    fmt = _format(fixture)

    async def run() -> None:
        async with Client(url) as client:
            handle = await client.submit(messages=_ask(fixture), response_format=fmt, n=2,
                                         max_tokens=1500, temperature=1.0, seed=7)
            result = await handle.result()
            assert result.status == "done" and result.choices is not None
            assert [c.index for c in result.choices] == [0, 1]
            for choice in result.choices:
                jsonschema.validate(json.loads(choice.text), fixture["schema"])
            assert result.text == result.choices[0].text

    asyncio.run(asyncio.wait_for(run(), 300))
    lines = [{"custom_id": f"s{i}", "body": {
        "messages": _ask(f), "response_format": _format(f), "max_tokens": 1500,
        "temperature": 1.0, "seed": i}} for i, f in enumerate(FIXTURES[:6])]
    if model.startswith("random"):
        lines.append({"custom_id": "tool", "body": {
            "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
            "tool_choice": "required", "max_tokens": 300, "temperature": 1.0, "seed": 3}})
    rows = run_batch(lines, redis_server.url, tmp_path, timeout_s=600)
    for row, line in zip(rows, lines, strict=True):
        body = row["response"]["body"]
        if row["custom_id"] == "tool":
            assert body["tool_calls"][0]["function"]["name"] == "get_weather"
            continue
        schema = line["body"]["response_format"]["json_schema"]["schema"]
        jsonschema.validate(json.loads(body["text"]), schema)

