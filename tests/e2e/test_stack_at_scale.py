"""A thousand jobs through the stack as separate processes (redis-server, `tidegate api`,
`tidegate gateway`, two `tidegate worker`s on `random:tiny`), with cancellations fired while
they run and a late watcher per job: every job's event stream must be exact."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from tests.conftest import RedisServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOBS = 1000
CANCEL_EVERY = 10  # one job in ten is long, and cancelled at a random moment
SEATS = 2 * 16  # two workers, TIDEGATE_MAX_NUM_SEQS each


@contextmanager
def process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tidegate", *args],
                                env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became ready")


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, str]]:
    """The processes' output goes to log files (named in a failure's report)."""
    redis_server.flush()
    logs = tmp_path_factory.mktemp("stack-logs")
    env = {"TIDEGATE_REDIS_URL": redis_server.url, "TIDEGATE_MODEL": "random:tiny",
           "TIDEGATE_LOG_LEVEL": "WARNING", "TIDEGATE_MAX_BACKLOG": "100000"}
    api_port, gateway_port = free_port(), free_port()
    # Few seats: the burst queues up, so cancels reach queued jobs as well as running ones.
    worker_env = {**env, "TIDEGATE_MAX_NUM_SEQS": "16", "TIDEGATE_MAX_NUM_BATCHED_TOKENS": "512",
                  "TIDEGATE_KV_CACHE_GB": "0.25", "TIDEGATE_TORCH_THREADS": "1"}
    with ExitStack() as stack:
        stack.enter_context(process(["api", "--port", str(api_port)], {
            **env, "TIDEGATE_GATEWAY_URL": f"ws://127.0.0.1:{gateway_port}"}, logs / "api.log"))
        stack.enter_context(process(["gateway", "--port", str(gateway_port)], env,
                                    logs / "gateway.log"))
        status_ports = [free_port(), free_port()]
        for i, port in enumerate(status_ports):
            stack.enter_context(process(["worker"], {**worker_env,
                                                     "TIDEGATE_METRICS_PORT": str(port)},
                                        logs / f"worker{i}.log"))
        wait_ready(f"http://127.0.0.1:{api_port}/readyz")
        wait_ready(f"http://127.0.0.1:{gateway_port}/readyz")
        for port in status_ports:
            wait_ready(f"http://127.0.0.1:{port}/readyz")
        yield f"http://127.0.0.1:{api_port}", f"ws://127.0.0.1:{gateway_port}"


def job_body(i: int, rng: random.Random) -> dict:
    body: dict = {"prompt": f"job {i}: " + " ".join(rng.choice("abcdefgh") * 3
                                                    for _ in range(rng.randint(2, 40))),
                  "max_tokens": rng.randint(4, 64), "temperature": rng.choice([0.0, 0.8]),
                  "seed": i}
    if i % 3 == 0:
        body["ignore_eos"] = True
    if i % 7 == 0:
        body["stop"] = [rng.choice("abcdefgh")]
    if i % CANCEL_EVERY == 0:  # far longer than the cancel's delay: it must be what ends it
        body.update(max_tokens=1500, ignore_eos=True, stop=[])
    return body


async def read_stream(url: str) -> list[dict]:
    async with ws_connect(url, max_size=None) as ws:
        frames = [json.loads(raw) async for raw in ws]
        assert ws.close_code == 1000, ws.close_code
    return frames


def check(job_id: str, events: list[dict], stored: dict) -> None:
    assert [e["id"] for e in events] == list(range(1, len(events) + 1)), job_id
    assert all(e["job_id"] == job_id for e in events)
    final = [e for e in events if e["type"] in ("done", "error", "rejected")]
    assert len(final) == 1 and final[0] is events[-1], job_id
    assert events[0]["type"] == "queued"
    tokens = [e for e in events if e["type"] == "token"]
    # A restarted run (not expected here: nothing is killed) would start the text again.
    assert "restarted" not in {e["type"] for e in events}
    assert stored["status"] == "done", (job_id, stored)
    done = events[-1]
    assert done["type"] == "done"
    text = "".join(e["text"] for e in tokens)
    assert text == done["text"] == stored["text"], job_id
    generated = sum(len(e["token_ids"]) for e in tokens)
    assert generated == done["usage"]["completion_tokens"] == stored["usage"]["completion_tokens"]
    indexes = [e["index"] for e in tokens]
    assert indexes == sorted(indexes) and (not tokens or indexes[0] == 0)


async def test_a_thousand_jobs_with_cancellations_and_late_watchers_are_exact(
        stack: tuple[str, str]) -> None:
    api, gateway = stack
    rng = random.Random(13)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    # Cancels on a pool of their own: queued behind the submits and polls, one would arrive
    # after its job finished.
    async with (httpx.AsyncClient(base_url=api, timeout=60, limits=limits) as http,
                httpx.AsyncClient(base_url=api, timeout=60) as canceller):
        accepted: dict[str, dict] = {}
        cancels: dict[str, str] = {}
        finished_first: set[str] = set()  # cancelled too late: done before the cancel came
        live: dict[str, list[dict]] = {}

        async def call(method: str, url: str, *, client: httpx.AsyncClient = http,
                       **kwargs: object) -> tuple[httpx.Response, bool]:
            """The response, and whether it took a retry (the first try may have landed)."""
            for attempt in range(3):  # a keep-alive connection the server just closed
                try:
                    return await client.request(method, url, **kwargs), attempt > 0
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    if attempt == 2:
                        raise
            raise AssertionError("unreachable")

        async def submit(i: int) -> None:
            r, _ = await call("POST", "/v1/jobs", json=job_body(i, rng))
            assert r.status_code == 202, r.text
            body = r.json()
            accepted[body["id"]] = body
            if i % CANCEL_EVERY == 0:  # at once (likely still queued), or while it runs
                await asyncio.sleep(0 if i % (2 * CANCEL_EVERY) else rng.uniform(0.05, 0.4))
                c, retried = await call("POST", f"/v1/jobs/{body['id']}/cancel",
                                        client=canceller)
                # 409 when a retried cancel's first try had ended the queued job, or when the
                # job finished before the cancel came (a short job on a busy machine: the
                # delay above is no promise); that job then ends as if never cancelled.
                if c.status_code == 409 and not retried:
                    assert c.json()["error"]["status"] == "done", c.text
                    finished_first.add(body["id"])
                else:
                    assert c.status_code == 202 or (retried and c.status_code == 409), c.text
                    cancels[body["id"]] = (c.json()["status"] if c.status_code == 202
                                           else "retried")
            if i % 50 == 0:  # some followed live from the start
                live[body["id"]] = await read_stream(f"{body['stream_url']}?token="
                                                     f"{body['stream_token']}")

        async def wait_status(job_ids: list[str], wanted: tuple[str, ...],
                              timeout_s: float = 120) -> list[dict]:
            async def one(job_id: str) -> dict:
                while (r := (await call("GET", f"/v1/jobs/{job_id}"))[0].json())[
                        "status"] not in wanted:
                    await asyncio.sleep(0.2)
                return r
            return await asyncio.wait_for(asyncio.gather(*map(one, job_ids)), timeout_s)

        # Cancels reach queued jobs for certain, whatever the machine's speed: every seat (two
        # workers, 16 each) taken by a long job first, a full worker reads no job until a seat
        # frees; one submitted then and cancelled at once is queued. The long ones, cancelled
        # next, are running.
        long_job = {"prompt": "hold a seat", "max_tokens": 1500, "ignore_eos": True}
        blockers = [(await call("POST", "/v1/jobs", json=long_job))[0].json()["id"]
                    for _ in range(SEATS)]
        await wait_status(blockers, ("running",))
        queued = [(await call("POST", "/v1/jobs", json={"prompt": f"queued {i}",
                                                         "max_tokens": 4}))[0].json()["id"]
                  for i in range(3)]
        first_cancels = {job_id: (await call("POST", f"/v1/jobs/{job_id}/cancel",
                                             client=canceller))[0].json()["status"]
                         for job_id in queued + blockers}
        assert first_cancels == {**dict.fromkeys(queued, "cancelled"),
                                 **dict.fromkeys(blockers, "cancelling")}, first_cancels
        ended = await wait_status(queued + blockers, ("done", "error", "rejected"))
        assert {(r["status"], r["finish_reason"]) for r in ended} == {("done", "cancelled")}
        assert all(r["usage"]["completion_tokens"] == 0 for r in ended[:len(queued)]), ended

        sem = asyncio.Semaphore(200)

        async def bounded(i: int) -> None:
            async with sem:
                await submit(i)

        await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(JOBS))), 180)
        assert len(accepted) == JOBS

        results = await wait_status(list(accepted), ("done", "error", "rejected"), 180)
        stored = dict(zip(accepted, results, strict=True))

        late_sem = asyncio.Semaphore(100)

        async def late(job_id: str) -> list[dict]:
            body = accepted[job_id]
            async with late_sem:
                return await read_stream(f"{gateway}/v1/jobs/{job_id}/stream?token="
                                         f"{body['stream_token']}")

        replays = await asyncio.wait_for(
            asyncio.gather(*(late(job_id) for job_id in accepted)), 180)

    reasons: dict[str, int] = {}
    for job_id, events in zip(accepted, replays, strict=True):
        check(job_id, events, stored[job_id])
        if job_id in live:
            assert live[job_id] == events  # live and replayed: the same events, verbatim
        reason = stored[job_id]["finish_reason"]
        reasons[reason] = reasons.get(reason, 0) + 1
        assert (reason == "cancelled") == (job_id in cancels), (job_id, reason)
    assert len(cancels) + len(finished_first) == JOBS // CANCEL_EVERY
    # In the burst, a cancel finds its job queued or running, as the machine's speed has it.
    assert cancels and set(cancels.values()) <= {"cancelled", "cancelling", "retried"}, cancels
    assert reasons.get("length", 0) > JOBS // 3, reasons
