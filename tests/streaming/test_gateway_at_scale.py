"""The gateway under the conditions issue 5 names: one pub/sub connection for every watcher,
exact resume from any disconnect point while a worker publishes, stalled clients that must not
hurt others, keepalive and malformed frames, a pub/sub connection lost mid-stream, a gateway
restarted mid-stream, and the same contract over Server-Sent Events."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.asgi_server import serve
from tests.conftest import RedisServer
from tests.metric_reference import assert_documented
from tests.streaming.test_gateway import (
    ids,
    job_events,
    publish,
    read_all,
    stored,
    stream_url,
    subscribers,
)
from tidegate import keys
from tidegate.jobstore import enqueue
from tidegate.protocol import JobRequest, TokenEvent
from tidegate.settings import Settings
from tidegate.streaming.gateway import create_app

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gateway_http(redis_server: RedisServer) -> Iterator[str]:
    with serve(create_app(Settings(redis_url=redis_server.url))) as url:
        yield url


@pytest.fixture
def gateway(gateway_http: str, redis_url: str) -> str:
    return gateway_http.replace("http://", "ws://")


async def new_job(redis: aioredis.Redis, *, shard: int | None = None) -> str:
    """A queued job; with ``shard``, one whose events travel on that live channel."""
    while True:
        job = JobRequest(prompt="hello").to_job(model="random_tiny", default_timeout_s=60)
        if shard is None or keys.live_shard(job.id) == shard:
            break
    await enqueue(redis, job)
    return job.id


async def pubsub_clients(redis: aioredis.Redis) -> int:
    return len(await redis.client_list(_type="pubsub"))


# ---------------------------------------------------------------- multiplexing


async def test_every_watcher_of_every_job_shares_one_pubsub_connection(
        gateway: str, aredis: aioredis.Redis) -> None:
    # Jobs on five live channels, and a sixth sharing the first one's channel.
    jobs = [await new_job(aredis, shard=shard) for shard in range(5)]
    jobs.append(await new_job(aredis, shard=0))
    # All at once: the first watchers of different jobs subscribe concurrently.
    opened = await asyncio.gather(*(ws_connect(stream_url(gateway, job)).__aenter__()
                                    for job in jobs for _ in range(6)))
    clients = {job: opened[i * 6:(i + 1) * 6] for i, job in enumerate(jobs)}
    for conns in clients.values():
        for ws in conns:
            assert ids([await ws.recv()]) == [1]
    assert await pubsub_clients(aredis) == 1
    # Live delivery, not the once-a-second stream poll that covers a lost message.
    for job, conns in clients.items():
        started = time.perf_counter()
        await publish(aredis, job, job_events(job, 3)[:1])
        for ws in conns:
            assert ids([await ws.recv()]) == [2]
        assert time.perf_counter() - started < 0.5
    assert sorted(await aredis.pubsub_channels()) == sorted(
        f"tidegate:live:{{s{shard}}}" for shard in range(5))
    # The first job's watchers leave: its channel stays (the sixth job needs it).
    for ws in clients[jobs[0]]:
        await ws.close()
    await asyncio.sleep(0.2)
    assert all([await subscribers(aredis, job) == 1 for job in jobs])
    # Then the second's: its channel, which no other watched job needs, is unsubscribed.
    for ws in clients[jobs[1]]:
        await ws.close()
    async with asyncio.timeout(5):
        while await subscribers(aredis, jobs[1]):
            await asyncio.sleep(0.01)
    assert all([await subscribers(aredis, job) == 1 for job in jobs[2:]])
    for job in jobs[2:]:
        await publish(aredis, job, job_events(job, 3)[1:])
        for ws in clients[job]:
            frames, code = await read_all(ws)
            assert (ids(frames), code) == ([3, 4, 5, 6], 1000)


async def test_live_events_are_written_as_shared_frames_of_any_size(
        redis_server: RedisServer, aredis: aioredis.Redis) -> None:
    """Live events to idle watchers go out as one frame built per event and written straight
    to every watcher's socket (no per-client wake-up); frames of every length class decode in
    a standard client, in order, with the final event still closing the socket with 1000."""
    app = create_app(Settings(redis_url=redis_server.url))
    with serve(app) as url:
        gateway = url.replace("http://", "ws://")
        job = await new_job(aredis)
        texts = ["x", "y" * 200, "z" * 70_000]  # 7-bit, 16-bit and 64-bit payload lengths
        raws = [TokenEvent(id=3 + i, job_id=job, index=i, text=t, token_ids=[i])
                .model_dump_json() for i, t in enumerate(texts)]
        async with ws_connect(stream_url(gateway, job), max_size=None) as a, \
                ws_connect(stream_url(gateway, job), max_size=None) as b:
            for ws in (a, b):
                assert ids([await ws.recv()]) == [1]
            await publish(aredis, job, [job_events(job, 0)[0]])  # started, id 2
            for ws in (a, b):
                assert ids([await ws.recv()]) == [2]
            hub = app.state.gateway.hub
            before = hub.direct_sends
            for raw in raws:
                await asyncio.sleep(0.05)  # both senders are idle, parked for the next event
                await publish(aredis, job, [raw])
            for ws in (a, b):
                assert [await ws.recv() for _ in raws] == raws
            assert hub.direct_sends - before == 2 * len(raws)
            await publish(aredis, job, [job_events(job, len(raws))[-1]])  # done
            for ws in (a, b):
                frames, code = await read_all(ws)
                assert (ids(frames), code) == ([len(raws) + 3], 1000)


# ---------------------------------------------------------------- resume


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=0, max_value=25), min_size=1, max_size=6))
def test_resume_from_any_disconnect_point_is_exact_while_publishing(
        gateway: str, redis_url: str, cuts: list[int]) -> None:
    """A client reads ``cut`` frames, drops, reconnects with the last id it got; repeatedly,
    while the worker keeps publishing: the ids it sees are 1..N, each exactly once."""

    async def scenario() -> None:
        redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            job = await new_job(redis)
            n_tokens = 60
            publisher = asyncio.create_task(publish(redis, job, job_events(job, n_tokens), 0.004))
            seen: list[int] = []
            for cut in [*cuts, None]:  # the last connection reads to the end
                query = f"?last_event_id={seen[-1]}" if seen else ""
                async with ws_connect(stream_url(gateway, job, query)) as ws:
                    try:
                        while cut is None or cut > 0:
                            seen.append(json.loads(await ws.recv())["id"])
                            cut = None if cut is None else cut - 1
                    except ConnectionClosed:
                        assert ws.close_code == 1000
                        break
            await publisher
            assert seen == list(range(1, n_tokens + 4))
        finally:
            await redis.aclose()

    asyncio.run(scenario())


async def test_resume_point_past_the_end_gets_nothing_but_the_close(
        gateway: str, aredis: aioredis.Redis) -> None:
    job = await new_job(aredis)
    await publish(aredis, job, job_events(job, 2))
    async with ws_connect(stream_url(gateway, job, "?last_event_id=5")) as ws:
        # Event 5 was the final one: nothing follows it, so the gateway closes at once.
        async with asyncio.timeout(3):
            frames, code = await read_all(ws)
    assert (frames, code) == ([], 1000)


# ---------------------------------------------------------------- slow clients


def big_token(job_id: str, event_id: int) -> str:
    return TokenEvent(id=event_id, job_id=job_id, index=event_id - 3, text="x" * 32_000,
                      token_ids=[event_id]).model_dump_json()


async def test_a_stalled_client_is_cut_with_1013_and_others_keep_their_latency(
        redis_server: RedisServer, redis_url: str) -> None:
    """One client stops reading; the others on the same job keep receiving every event
    promptly, and the stalled one is closed with 1013 once its queue overflows."""
    app = create_app(Settings(redis_url=redis_server.url, watcher_queue_size=32))
    with serve(app) as http:
        base = http.replace("http://", "ws://")
        redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        job = await new_job(redis)
        url = stream_url(base, job)
        # A tiny receive buffer and max_queue=1: this client's socket fills up almost at once.
        port = int(base.rsplit(":", 1)[1])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        stalled = await ws_connect(url, sock=sock, max_queue=1, max_size=None,
                                   compression=None).__aenter__()
        assert ids([await stalled.recv()]) == [1]
        fast = [await ws_connect(url, max_size=None).__aenter__() for _ in range(3)]
        for ws in fast:
            assert ids([await ws.recv()]) == [1]
        latencies: list[float] = []
        sent_at: dict[int, float] = {}

        async def read_fast(ws) -> list[int]:  # noqa: ANN001
            got = []
            async for raw in ws:
                event_id = json.loads(raw)["id"]
                got.append(event_id)
                if event_id in sent_at:
                    latencies.append(time.perf_counter() - sent_at[event_id])
            return got

        readers = [asyncio.create_task(read_fast(ws)) for ws in fast]
        n = 400  # 400 x 32 kB: far more than the socket buffers between hold
        for i in range(2, n + 2):
            raw = big_token(job, i) if i > 2 else job_events(job, 0)[0]
            sent_at[i] = time.perf_counter()
            await publish(redis, job, [raw])
            await asyncio.sleep(0.002)
        await publish(redis, job, [job_events(job, n - 1)[-1]])  # done, id n + 2
        got = await asyncio.wait_for(asyncio.gather(*readers), 30)
        for g in got:
            assert g == list(range(2, n + 3))
        latencies.sort()
        assert latencies[int(len(latencies) * 0.99)] < 0.5, latencies[-5:]
        # The stalled client now reads: some frames, then the 1013 close.
        frames = []
        with pytest.raises(ConnectionClosed):
            async with asyncio.timeout(20):
                while True:
                    frames.append(json.loads(await stalled.recv())["id"])
        assert stalled.close_code == 1013
        assert "resume after event" in (stalled.close_reason or "")
        assert frames == list(range(2, 2 + len(frames))) and len(frames) < n
        await redis.aclose()


# ---------------------------------------------------------------- protocol


async def test_ping_gets_pong_among_events(gateway: str, aredis: aioredis.Redis) -> None:
    job = await new_job(aredis)
    async with ws_connect(stream_url(gateway, job)) as ws:
        assert ids([await ws.recv()]) == [1]
        await ws.send(json.dumps({"type": "ping", "data": {"n": 7}}))
        assert json.loads(await ws.recv()) == {"type": "pong", "data": {"n": 7}}
        await publish(aredis, job, job_events(job, 1))
        frames, code = await read_all(ws)
    assert (ids(frames), code) == ([2, 3, 4], 1000)


@pytest.mark.parametrize(("frame", "reason"), [
    ("not json", "not valid JSON"),
    (b"\x00\x01", "binary"),
    ('["ping"]', "JSON object"),
    ('{"type": "subscribe"}', "unexpected frame type"),
])
async def test_malformed_frames_get_an_error_frame_and_4400(
        gateway: str, aredis: aioredis.Redis, frame: str | bytes, reason: str) -> None:
    job = await new_job(aredis)
    async with ws_connect(stream_url(gateway, job)) as ws:
        assert ids([await ws.recv()]) == [1]
        await ws.send(frame)
        frames, code = await read_all(ws)
    assert code == 4400
    error = json.loads(frames[-1])
    assert error["type"] == "error" and error["code"] == "bad_frame"
    assert reason in error["message"]


# ---------------------------------------------------------------- failures


async def test_pubsub_connection_killed_mid_stream_loses_nothing(
        gateway: str, aredis: aioredis.Redis) -> None:
    job = await new_job(aredis)
    events = job_events(job, 40)
    async with ws_connect(stream_url(gateway, job)) as ws:
        assert ids([await ws.recv()]) == [1]
        await publish(aredis, job, events[:10])
        await aredis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        await publish(aredis, job, events[10:])  # some published while nobody listens
        frames, code = await read_all(ws)
    assert (ids(frames), code) == (list(range(2, 44)), 1000)
    # The hub works on as before: one pub/sub connection, live events.
    job2 = await new_job(aredis)
    async with ws_connect(stream_url(gateway, job2)) as ws:
        assert ids([await ws.recv()]) == [1]
        assert await pubsub_clients(aredis) == 1
        await publish(aredis, job2, job_events(job2, 2))
        frames, code = await read_all(ws)
    assert (ids(frames), code) == ([2, 3, 4, 5], 1000)


async def test_gateway_restart_mid_stream_clients_resume_on_the_new_process(
        redis_server: RedisServer, redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    job = await new_job(redis)
    events = job_events(job, 30)
    seen: list[int] = []
    with serve(create_app(Settings(redis_url=redis_server.url))) as first:
        ws = await ws_connect(stream_url(first.replace("http", "ws"), job)).__aenter__()
        await publish(redis, job, events[:12])
        while len(seen) < 13:
            seen.append(json.loads(await ws.recv())["id"])
    # The first process is gone (its clients were closed); the worker keeps publishing.
    with pytest.raises(ConnectionClosed):
        while True:
            seen.append(json.loads(await ws.recv())["id"])
    assert ws.close_code in (1001, 1012, 1006)
    await publish(redis, job, events[12:20])
    with serve(create_app(Settings(redis_url=redis_server.url))) as second:
        url = stream_url(second.replace("http", "ws"), job, f"?last_event_id={seen[-1]}")
        async with ws_connect(url) as ws2:
            await publish(redis, job, events[20:])
            frames, code = await read_all(ws2)
    assert seen + ids(frames) == list(range(1, 34)) and code == 1000
    await redis.aclose()


# ---------------------------------------------------------------- Server-Sent Events


def sse_events(text: str) -> list[tuple[int, dict]]:
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines()
                     if ": " in line and not line.startswith(":"))
        if "data" in lines:
            out.append((int(lines["id"]), json.loads(lines["data"])))
    return out


async def test_sse_honours_last_event_id_and_ends_after_the_final_event(
        gateway_http: str, redis_url: str, aredis: aioredis.Redis) -> None:
    job = await new_job(aredis)
    await publish(aredis, job, job_events(job, 6)[:4])
    async with httpx.AsyncClient(timeout=10) as http:
        async with http.stream("GET", f"{gateway_http}/v1/jobs/{job}/events",
                               headers={"Last-Event-ID": "3"}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            publisher = asyncio.create_task(publish(aredis, job, job_events(job, 6)[4:], 0.01))
            body = "".join([chunk async for chunk in resp.aiter_text()])
        await publisher
    got = sse_events(body)
    assert [i for i, _ in got] == list(range(4, 10))
    assert [e["id"] for _, e in got] == [i for i, _ in got]
    assert got[-1][1]["type"] == "done"
    assert [json.dumps(e) for _, e in got] == [
        json.dumps(json.loads(raw)) for raw in (await stored(aredis, job))[3:]]


async def test_sse_errors_are_json(gateway_http: str, aredis: aioredis.Redis) -> None:
    job = await new_job(aredis)
    async with httpx.AsyncClient(timeout=10) as http:
        unknown = await http.get(f"{gateway_http}/v1/jobs/0123456789abcdef/events")
        bad = await http.get(f"{gateway_http}/v1/jobs/{job}/events",
                             headers={"Last-Event-ID": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found"
    assert bad.status_code == 400
    assert bad.json()["error"]["fields"][0]["field"] == "last_event_id"


# ---------------------------------------------------------------- queue view


async def test_queue_view_counts_waiting_jobs_and_live_workers(
        gateway_http: str, aredis: aioredis.Redis) -> None:
    for _ in range(3):
        await new_job(aredis)
    await aredis.set("tidegate:worker:{w-1}", json.dumps(
        {"running": 2, "waiting": 1, "tokens_per_s": 41.5, "kv_usage": 0.25,
         "model": "random_tiny", "adapters": ["a1"]}), ex=15)
    async with httpx.AsyncClient(timeout=10) as http:
        body = (await http.get(f"{gateway_http}/v1/queue")).json()
    lanes = {lane["lane"]: lane for lane in body["lanes"]}
    assert {lane["model"] for lane in body["lanes"]} == {"random_tiny"}  # the model Redis names
    assert lanes["interactive"]["lag"] == 3 and lanes["interactive"]["pending"] == 0
    assert lanes["interactive"]["oldest_waiting_s"] is not None
    assert lanes["batch"]["lag"] == 0 and lanes["batch"]["oldest_waiting_s"] is None
    assert body["workers"] == [{"worker_id": "w-1", "running": 2, "waiting": 1,
                                "tokens_per_s": 41.5, "kv_usage": 0.25,
                                "model": "random_tiny", "adapters": ["a1"],
                                "prefix_hit_rate": 0.0}]
    assert (body["running"], body["tokens_per_s"]) == (2, 41.5)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_and_readiness_follow_the_queue_and_redis(
        gateway_http: str, aredis: aioredis.Redis, redis_server: RedisServer) -> None:
    """What Prometheus scrapes and a readiness probe sees, with Redis up and then down."""
    await aredis.delete(keys.lane_stream("random_tiny", "interactive"))
    for _ in range(3):
        await new_job(aredis)
    await aredis.set("tidegate:worker:{w-2}", json.dumps({"running": 1}), ex=15)
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"{gateway_http}/readyz")).json() == {"ready": True,
                                                                      "reason": "ready"}
        r = await http.get(f"{gateway_http}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert_documented(r.text)
        m = samples(r.text)
        interactive = (("lane", "interactive"), ("model", "random_tiny"), ("partition", "0"))
        assert m[("tidegate_queue_lag", interactive)] == 3
        assert m[("tidegate_queue_length", interactive)] == 3
        assert m[("tidegate_queue_pending", interactive)] == 0
        assert m[("tidegate_queue_oldest_waiting_seconds", interactive)] >= 0
        assert m[("tidegate_redis_up", ())] == 1 and m[("tidegate_workers_live", ())] >= 1
        assert ("tidegate_gateway_watchers", ()) in m
        redis_server.stop()
        try:
            started = time.perf_counter()
            r = await http.get(f"{gateway_http}/readyz")
            assert r.status_code == 503 and r.json()["reason"] == "Redis is unreachable"
            m = samples((await http.get(f"{gateway_http}/metrics")).text)
            assert m[("tidegate_redis_up", ())] == 0
            assert time.perf_counter() - started < 8  # probes answer during an outage
        finally:
            redis_server.start()
        async with asyncio.timeout(20):
            while (await http.get(f"{gateway_http}/readyz")).status_code != 200:
                await asyncio.sleep(0.1)
