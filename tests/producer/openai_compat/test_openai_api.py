"""The OpenAI-compatible routes, driven by the official ``openai`` client (sync and async) over
real HTTP, against a real Redis and a scripted worker that writes events as the real one does."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI, OpenAI

from tests.conftest import RedisServer
from tests.producer.conftest import MODEL, SERVED, serve_stack
from tidegate import keys
from tidegate.events.event_log import add_event
from tidegate.jobstore import JOB_FIELD, set_status
from tidegate.producer.submit.admission import Admission
from tidegate.protocol import (
    DoneEvent,
    ErrorEvent,
    Job,
    RejectedEvent,
    RestartedEvent,
    StartedEvent,
    Timings,
    TokenEvent,
    TopLogprob,
    Usage,
)

pytestmark = pytest.mark.timeout(30)

USER = [{"role": "user", "content": "the quick brown fox"}]
AnyEvent = StartedEvent | TokenEvent | DoneEvent | ErrorEvent | RejectedEvent | RestartedEvent


class ScriptedWorker:
    """Serves the interactive lane, writing events as the real worker does. The prompt (or the
    last message) is echoed one word per token, honouring ``max_tokens`` (``length``), ``stop``
    and ``logprobs``; a leading command word changes the script:

    ``reject R`` a ``rejected`` event with reason R; ``fail C`` an ``error`` event with code C;
    ``break C ...`` some tokens, then an ``error``; ``finish R ...`` done with finish_reason R;
    ``restart same|diff ...`` the words, ``restarted``, then the same words (or others);
    ``slow ...`` a token every 0.2 s, ending ``cancelled`` once a cancel is requested.
    """

    def __init__(self, redis: aioredis.Redis):
        self.redis = redis
        self.next_id: dict[str, int] = {}
        self.jobs: set[asyncio.Task[None]] = set()  # served concurrently, as by a real batch

    async def run(self) -> None:
        last = "0"
        while True:
            for _, entries in await self.redis.xread(
                    {keys.lane_stream(SERVED, "interactive"): last}, block=1000):
                for entry_id, fields in entries:
                    last = entry_id
                    job = Job.model_validate_json(fields[JOB_FIELD])
                    self.jobs.add(task := asyncio.create_task(self.serve(job)))
                    task.add_done_callback(self.jobs.discard)

    async def serve(self, job: Job) -> None:
        text = job.prompt if job.prompt is not None else job.messages[-1].content  # type: ignore[index]
        command, _, rest = text.partition(" ")
        if command == "reject":
            return await self.emit(job, RejectedEvent, "rejected", reason=rest, message="busy")
        if command == "fail":
            return await self.emit(job, ErrorEvent, "error", code=rest, message="no good")
        await self.emit(job, StartedEvent, "running", worker="fake", prompt_tokens=3)
        words = [w + " " for w in rest.split()]
        if command == "break":
            await self.tokens(job, words[1:])
            return await self.emit(job, ErrorEvent, "error", code=words[0].strip(),
                                   message="died")
        if command == "finish":
            return await self.finish(job, await self.tokens(job, words[1:]), words[0].strip())
        if command == "restart":
            await self.tokens(job, words[1:])
            await self.emit(job, RestartedEvent, None, attempt=2)
            again = words[1:] if words[0] == "same " else [w.upper() for w in words[1:]]
            return await self.finish(job, await self.tokens(job, again), "stop")
        if command == "slow":
            return await self.slow(job)
        pieces, reason = self.echo(job, text.split())
        await self.finish(job, await self.tokens(job, pieces), reason)

    @staticmethod
    def echo(job: Job, words: list[str]) -> tuple[list[str], str]:
        """The word pieces the job may keep, cut at max_tokens and at the first stop string."""
        pieces = [w + " " for w in words][:job.sampling.max_tokens]
        reason = "length" if len(words) > job.sampling.max_tokens else "stop"
        text = "".join(pieces)
        cut = min([text.find(s) for s in job.sampling.stop if s in text], default=-1)
        if cut < 0:
            return pieces, reason
        kept: list[str] = []
        for piece in pieces:
            room = cut - sum(map(len, kept))
            kept.append(piece[:max(room, 0)])
        return kept, "stop"

    async def tokens(self, job: Job, pieces: list[str]) -> str:
        top_n = job.sampling.logprobs
        for i, piece in enumerate(pieces):
            extra = {}
            if top_n is not None:
                extra = {"logprob": -(i + 1) / 10, "top_logprobs": [
                    TopLogprob(token_id=ord("a") + k, logprob=-k - 0.5) for k in range(top_n)]}
            await self.emit(job, TokenEvent, None, index=i, text=piece,
                            token_ids=list((piece or "?").encode()), **extra)
            await asyncio.sleep(0.002)
        return "".join(pieces)

    async def slow(self, job: Job) -> None:
        for i in range(150):
            if await self.redis.hget(keys.job_hash(job.id), "cancel_requested") == "1":
                return await self.finish(job, "", "cancelled")
            await self.emit(job, TokenEvent, None, index=i, text="w ", token_ids=[119])
            await asyncio.sleep(0.2)

    async def finish(self, job: Job, text: str, reason: str) -> None:
        n = len(text.split())
        usage = Usage(prompt_tokens=3, completion_tokens=n, total_tokens=3 + n)
        timings = Timings(queue_ms=1, ttft_ms=2, total_ms=3, decode_tokens_per_s=4)
        result = {"text": text, "finish_reason": reason, "usage": usage.model_dump(),
                  "timings": timings.model_dump()}
        await self.emit(job, DoneEvent, "done", result=json.dumps(result), finish_reason=reason,
                        text=text, usage=usage, timings=timings)

    async def emit(self, job: Job, kind: type[AnyEvent], status: str | None,
                   result: str | None = None, **fields: object) -> None:
        event_id = self.next_id.get(job.id, 2)
        self.next_id[job.id] = event_id + 1
        event = kind(id=event_id, job_id=job.id, **fields)
        pipe = self.redis.pipeline(transaction=True)
        add_event(pipe, job.id, event.model_dump_json())
        if status is not None:
            set_status(pipe, job.id, status, **({"result": result} if result else {}))
        await pipe.execute()


@pytest.fixture(scope="module")
def server(redis_server: RedisServer, admission: Admission) -> Iterator[str]:
    with serve_stack(redis_server, admission) as url:
        yield url


@pytest.fixture
def base_url(server: str, redis_url: str) -> str:
    """The OpenAI base URL, over a freshly flushed Redis."""
    return f"{server}/v1"


@pytest.fixture
async def worker(aredis: aioredis.Redis) -> AsyncIterator[ScriptedWorker]:
    fake = ScriptedWorker(aredis)
    task = asyncio.create_task(fake.run())
    yield fake
    for running in [task, *fake.jobs]:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=base_url, api_key="sk-unused", max_retries=0,
                           timeout=10) as aclient:
        yield aclient


def sync_client(base_url: str, api_key: str = "sk-unused") -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=10)


async def in_thread(script: Callable[[], object]) -> object:
    """Run a synchronous client script off the event loop the scripted worker runs on."""
    return await asyncio.wait_for(asyncio.to_thread(script), 20)


async def queued_job(aredis: aioredis.Redis) -> Job:
    [(_, fields)] = await aredis.xrange(keys.lane_stream(SERVED, "interactive"))
    return Job.model_validate_json(fields[JOB_FIELD])


# ---------------------------------------------------------------- models


async def live_worker(aredis: aioredis.Redis, model: str = SERVED) -> None:
    """A worker's heartbeat, as a live worker of ``model`` writes it."""
    await aredis.set(keys.worker_heartbeat(f"w-{model}"), json.dumps({"model": model}), ex=60)


async def test_models_lists_the_served_model_under_every_name(
        base_url: str, aredis: aioredis.Redis) -> None:
    def script(live: int) -> None:
        with sync_client(base_url) as client:
            listed = client.models.list()
            assert [(m.id, m.object, m.owned_by, m.live_workers) for m in listed.data] == [
                (SERVED, "model", "tidegate", live)]
            for name in ("tidegate", MODEL, SERVED):
                assert client.models.retrieve(name).id == SERVED
            with pytest.raises(openai.NotFoundError):
                client.models.retrieve("gpt-4o")

    await in_thread(lambda: script(0))  # listed before a live worker serves it
    await live_worker(aredis)
    await in_thread(lambda: script(1))


# ---------------------------------------------------------------- answers


async def test_chat_completion_answers_with_text_and_usage(
        client: AsyncOpenAI, worker: ScriptedWorker) -> None:
    answer = await client.chat.completions.create(model="tidegate", messages=USER)
    job_id = answer.id.removeprefix("chatcmpl-")
    assert answer.id != job_id and keys.is_valid_job_id(job_id)
    assert (answer.object, answer.model) == ("chat.completion", "tidegate")  # as sent
    [choice] = answer.choices
    assert (choice.message.role, choice.message.content) == ("assistant", "the quick brown fox ")
    assert (choice.finish_reason, choice.logprobs) == ("stop", None)
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens,
            answer.usage.total_tokens) == (3, 4, 7)


async def test_sync_completion_answers_with_text_and_usage(
        base_url: str, worker: ScriptedWorker) -> None:
    def script() -> None:
        with sync_client(base_url) as client:
            answer = client.completions.create(model=MODEL, prompt=["one two three"])
            assert answer.id.startswith("cmpl-") and answer.object == "text_completion"
            assert [(c.text, c.finish_reason) for c in answer.choices] == [
                ("one two three ", "stop")]
            assert answer.usage is not None and answer.usage.completion_tokens == 3

    await in_thread(script)


async def test_chat_stream_sends_role_then_deltas_then_finish_and_usage(
        client: AsyncOpenAI, worker: ScriptedWorker) -> None:
    stream = await client.chat.completions.create(
        model="tidegate", messages=USER, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content for c in chunks[1:-2]]
    assert deltas == ["the ", "quick ", "brown ", "fox "]
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


async def test_the_stream_is_server_sent_events_ending_with_done(
        base_url: str, worker: ScriptedWorker) -> None:
    body = {"model": "tidegate", "messages": USER, "stream": True}
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(f"{base_url}/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "the "}, {"content": "quick "},
        {"content": "brown "}, {"content": "fox "}, {}]
    assert "usage" not in chunks[0]


async def test_sync_completion_stream_ends_with_the_finish_reason(
        base_url: str, worker: ScriptedWorker) -> None:
    def script() -> None:
        with sync_client(base_url) as client:
            chunks = list(client.completions.create(
                model="tidegate", prompt="a b c d e f", max_tokens=3, stream=True))
            assert "".join(c.choices[0].text for c in chunks) == "a b c "
            assert [c.choices[0].finish_reason for c in chunks] == [None] * 3 + ["length"]
            assert all(c.usage is None for c in chunks)  # include_usage not asked

    await in_thread(script)


async def test_stop_strings_end_the_text(client: AsyncOpenAI, worker: ScriptedWorker,
                                         aredis: aioredis.Redis) -> None:
    answer = await client.completions.create(model="tidegate", prompt="one two three four",
                                             stop=["three"])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("one two ", "stop")
    assert (await queued_job(aredis)).sampling.stop == ["three"]


@pytest.mark.parametrize(("tidegate_reason", "openai_reason"),
                         [("deadline", "length"), ("cancelled", "stop"), ("length", "length")])
async def test_finish_reasons_map_onto_openais(
        client: AsyncOpenAI, worker: ScriptedWorker, tidegate_reason: str,
        openai_reason: str) -> None:
    answer = await client.completions.create(model="tidegate",
                                             prompt=f"finish {tidegate_reason} a b")
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("a b ", openai_reason)


# ---------------------------------------------------------------- logprobs


async def test_chat_logprobs_name_each_token_and_its_alternatives(
        client: AsyncOpenAI, worker: ScriptedWorker, aredis: aioredis.Redis) -> None:
    answer = await client.chat.completions.create(
        model="tidegate", messages=[{"role": "user", "content": "héllo world"}], logprobs=True,
        top_logprobs=2)
    assert (await queued_job(aredis)).sampling.logprobs == 2
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [(t.token, t.bytes, t.logprob) for t in content] == [
        ("héllo ", list("héllo ".encode()), -0.1), ("world ", list(b"world "), -0.2)]
    assert [(a.token, a.logprob) for a in content[0].top_logprobs] == [("a", -0.5), ("b", -1.5)]


async def test_chat_stream_carries_logprobs_per_chunk(
        client: AsyncOpenAI, worker: ScriptedWorker) -> None:
    stream = await client.chat.completions.create(
        model="tidegate", messages=USER, logprobs=True, stream=True)
    chunks = [c async for c in stream]
    tokens = [t.token for c in chunks if c.choices[0].logprobs
              for t in c.choices[0].logprobs.content or []]
    assert tokens == ["the ", "quick ", "brown ", "fox "]
    assert all(not t.top_logprobs for c in chunks if c.choices[0].logprobs
               for t in c.choices[0].logprobs.content or [])


async def test_completion_logprobs_have_offsets(
        client: AsyncOpenAI, worker: ScriptedWorker) -> None:
    answer = await client.completions.create(model="tidegate", prompt="ab cd", logprobs=1)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None
    assert (logprobs.tokens, logprobs.token_logprobs, logprobs.text_offset) == (
        ["ab ", "cd "], [-0.1, -0.2], [0, 3])
    assert logprobs.top_logprobs == [{"a": -0.5}, {"a": -0.5}]


# ---------------------------------------------------------------- the job's fields


async def test_request_fields_map_onto_the_job(
        client: AsyncOpenAI, worker: ScriptedWorker, aredis: aioredis.Redis) -> None:
    await client.chat.completions.create(
        model="tidegate", max_completion_tokens=9, top_p=0.5, seed=3, stop="x",
        presence_penalty=0.25, frequency_penalty=-0.5, user="someone", metadata={"k": "v"},
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "hi "},
                                               {"type": "text", "text": "there"}]}],
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "timeout_s": 60,
                    "priority": 7, "ignore_eos": True})
    job = await queued_job(aredis)
    assert [m.model_dump(exclude_none=True) for m in job.messages or []] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    s = job.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (9, 1.0, 0.5, 3, ["x"])
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs) == (0.25, -0.5, None)
    assert (s.top_k, s.min_p, s.repetition_penalty, job.priority) == (5, 0.1, 1.2, 7)
    assert s.ignore_eos
    assert 59_000 <= job.deadline_ms - job.created_ms <= 60_000


async def test_completions_default_to_16_tokens_at_temperature_1(
        client: AsyncOpenAI, worker: ScriptedWorker, aredis: aioredis.Redis) -> None:
    await client.completions.create(model="tidegate", prompt="hi", temperature=None)
    job = await queued_job(aredis)
    assert (job.prompt, job.sampling.max_tokens, job.sampling.temperature) == ("hi", 16, 1.0)


# ---------------------------------------------------------------- refusals


async def test_an_unknown_model_is_404_model_not_found(
        client: AsyncOpenAI, aredis: aioredis.Redis) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-4o", messages=USER)
    assert (info.value.code, info.value.param, info.value.type) == (
        "model_not_found", "model", "not_found_error")
    assert await aredis.dbsize() == 0


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [({"n": 17}, "n", "invalid_value"),
     ({"tools": [{"type": "function", "function": {"name": "f"}}],
       "tool_choice": {"type": "function", "function": {"name": "g"}}},
      "tool_choice.function.name", "invalid_value"),
     ({"functions": [{"name": "f"}]}, "functions", "unsupported_value"),
     ({"extra_body": {"colour": "blue"}}, "colour", "unknown_parameter"),
     ({"temperature": 9}, "temperature", "invalid_value"),
     ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
     ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "invalid_value"),
     ({"max_tokens": 0}, "max_tokens", "invalid_value"),
     ({"max_completion_tokens": 5000}, "max_completion_tokens", "context_length_exceeded"),
     ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
      "messages.0.content", "invalid_value"),
     ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "invalid_value"),
     ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages",
      "context_length_exceeded"),
     ({"stop": 5}, "stop", "invalid_value")],
)
async def test_bad_chat_params_are_400_naming_the_param(
        client: AsyncOpenAI, aredis: aioredis.Redis, kwargs: dict, param: str, code: str) -> None:
    kwargs = {"model": "tidegate", "messages": USER, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(**kwargs)
    assert (info.value.param, info.value.code, info.value.type) == (
        param, code, "invalid_request_error"), info.value.message
    assert await aredis.dbsize() == 0


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 2]}, "prompt"), ({"echo": True, "logprobs": 1}, "echo"),
    ({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"), ({"logprobs": 21}, "logprobs"),
    ({"extra_body": {"messages": USER}}, "messages")])
async def test_bad_completion_params_are_400_naming_the_param(
        client: AsyncOpenAI, kwargs: dict, param: str) -> None:
    kwargs = {"model": "tidegate", "prompt": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(**kwargs)
    assert info.value.param == param, info.value.message


async def test_a_body_that_is_not_json_is_400_in_openais_shape(base_url: str) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{base_url}/chat/completions", content=b"{nope")
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------- failed jobs


@pytest.mark.parametrize("stream", [False, True])
async def test_a_busy_rejection_is_429_with_retry_after(
        client: AsyncOpenAI, worker: ScriptedWorker, stream: bool) -> None:
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(
            model="tidegate", messages=[{"role": "user", "content": "reject cannot_meet_deadline"}],
            stream=stream)
    assert info.value.code == "cannot_meet_deadline"
    assert info.value.response.headers["retry-after"] == "2"  # settings.retry_after_s


@pytest.mark.parametrize(("script", "status", "error"), [
    ("reject deadline_exceeded", 504, openai.InternalServerError),
    ("reject shutting_down", 503, openai.InternalServerError),
    ("fail invalid_request", 400, openai.BadRequestError),
    ("fail invalid_job", 500, openai.InternalServerError),
    ("finish error a", 500, openai.InternalServerError)])
async def test_failed_jobs_answer_with_their_status(
        client: AsyncOpenAI, worker: ScriptedWorker, script: str, status: int,
        error: type[openai.APIStatusError]) -> None:
    with pytest.raises(error) as info:
        await client.completions.create(model="tidegate", prompt=script)
    assert info.value.status_code == status


async def test_a_job_failing_mid_stream_ends_it_with_an_error(
        client: AsyncOpenAI, worker: ScriptedWorker) -> None:
    stream = await client.chat.completions.create(
        model="tidegate", messages=[{"role": "user", "content": "break internal a b"}],
        stream=True)
    received: list[str | None] = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert received == ["", "a ", "b "]
    assert info.value.code == "internal"


# ---------------------------------------------------------------- restarts


async def test_a_restart_keeps_only_the_final_text(
        client: AsyncOpenAI, worker: ScriptedWorker) -> None:
    answer = await client.completions.create(model="tidegate", prompt="restart diff a b",
                                             logprobs=0)
    assert answer.choices[0].text == "A B "
    assert answer.choices[0].logprobs and answer.choices[0].logprobs.tokens == ["A ", "B "]


async def test_a_stream_survives_a_restart_that_repeats_its_text(
        client: AsyncOpenAI, worker: ScriptedWorker) -> None:
    stream = await client.completions.create(model="tidegate", prompt="restart same a b",
                                             stream=True)
    assert [c.choices[0].text async for c in stream] == ["a ", "b ", ""]


async def test_a_stream_ends_with_an_error_when_a_restart_changes_its_text(
        client: AsyncOpenAI, worker: ScriptedWorker) -> None:
    stream = await client.completions.create(model="tidegate", prompt="restart diff a b",
                                             stream=True)
    received: list[str] = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            received.append(chunk.choices[0].text)
    assert (received, info.value.code) == (["a ", "b "], "restarted")


# ---------------------------------------------------------------- disconnects


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_stops_following_and_cancels_the_job(
        base_url: str, worker: ScriptedWorker, aredis: aioredis.Redis, stream: bool) -> None:
    body = {"model": "tidegate", "prompt": "slow", "stream": stream}
    async with httpx.AsyncClient(timeout=10) as http:
        if stream:
            async with http.stream("POST", f"{base_url}/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        job_id = json.loads(line[6:])["id"].removeprefix("cmpl-")
                        break
        else:
            request = asyncio.create_task(http.post(f"{base_url}/completions", json=body))
            job_id = await _first_job_id(aredis)
            await asyncio.sleep(0.3)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
    channel = keys.job_live_channel(job_id)
    for _ in range(100):
        [(_, subscribers)] = await aredis.pubsub_numsub(channel)
        if subscribers == 0 and await aredis.hget(keys.job_hash(job_id), "status") == "done":
            break
        await asyncio.sleep(0.05)
    assert subscribers == 0
    result = json.loads(await aredis.hget(keys.job_hash(job_id), "result") or "{}")
    assert result.get("finish_reason") == "cancelled"


async def _first_job_id(aredis: aioredis.Redis) -> str:
    for _ in range(100):
        if entries := await aredis.xrange(keys.lane_stream(SERVED, "interactive")):
            return Job.model_validate_json(entries[0][1][JOB_FIELD]).id
        await asyncio.sleep(0.05)
    raise AssertionError("no job was enqueued")


# ---------------------------------------------------------------- auth and backpressure


async def test_auth_and_a_full_lane_answer_in_openais_shape(
        redis_server: RedisServer, admission: Admission, redis_url: str,
        aredis: aioredis.Redis) -> None:
    with serve_stack(redis_server, admission, api_keys=["sk-good"], max_backlog=1,
                     retry_after_s=3) as url:
        def script() -> None:
            with sync_client(f"{url}/v1", api_key="sk-bad") as stranger:
                with pytest.raises(openai.AuthenticationError) as info:
                    stranger.models.list()
                assert info.value.type == "authentication_error"
            with sync_client(f"{url}/v1", api_key="sk-good") as client:
                assert [m.id for m in client.models.list().data] == [SERVED]
                with pytest.raises(openai.RateLimitError) as full:
                    client.completions.create(model="tidegate", prompt="hi")
                assert (full.value.code, full.value.type) == ("queue_full", "rate_limit_error")
                assert full.value.response.headers["retry-after"] == "3"

        await aredis.xadd(keys.lane_stream(SERVED, "interactive"), {JOB_FIELD: "{}"})  # backlog
        await live_worker(aredis)
        await in_thread(script)


OPENAI_ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "tidegate", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions",
     {"model": "tidegate", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
]


@pytest.mark.parametrize(("method", "path", "body"), OPENAI_ROUTES)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"},
                                     {"Authorization": "Basic c2stZ29vZA=="}],
                         ids=["no key", "wrong key", "not bearer"])
async def test_every_openai_route_refuses_callers_without_a_valid_key(
        redis_server: RedisServer, admission: Admission, redis_url: str, aredis: aioredis.Redis,
        method: str, path: str, body: dict | None, headers: dict[str, str]) -> None:
    with serve_stack(redis_server, admission, api_keys=["sk-good"]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            response = await http.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert "sk-good" not in response.text
    assert await aredis.xlen(keys.lane_stream(SERVED, "interactive")) == 0  # nothing was enqueued
