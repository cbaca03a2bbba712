"""The whole stack through real processes: `tidegate up` (API + gateway + worker) on a real Redis:
one redis-server, and a Redis Cluster of 3 masters and 3 replicas (every test runs on both).

Drives it as users do: the Python client, a raw WebSocket client, and the `tidegate` CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator

import httpx
import pytest
import websockets

from tests.conftest import RedisServer
from tests.redis_cluster import ClusterServers
from tests.stack_process import TIDEGATE, cli, run_batch, tidegate_up
from tidegate.operations.queue_stats import ROUTED
from tidegate.producer.client import Client

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module", params=["server", "cluster"])
def backend(request: pytest.FixtureRequest) -> RedisServer | ClusterServers:
    """Every test here runs on one redis-server and on a Redis Cluster (3 masters, 3
    replicas: ``tidegate up --redis-url redis+cluster://...``)."""
    return request.getfixturevalue("redis_server" if request.param == "server"
                                   else "redis_cluster")


@pytest.fixture(scope="module")
def stack(backend: RedisServer | ClusterServers) -> Iterator[str]:
    with tidegate_up(backend) as url:
        yield url


# The default model (SmolLM2-135M, Q4_1) on 8-bit activations, as llama.cpp runs the same file,
# answers the bare "What is the capital of France?" with "L'Étoile, la ..." (its first token is
# a near tie: "The" leads "L" by 0.1 logit on float activations); asked for a sentence, "The
# capital of France is Paris." either way.
QUESTION = "What is the capital of France? Answer in one sentence."


async def test_twenty_concurrent_jobs_stream_exactly_their_results(stack: str) -> None:
    questions = [f"In one sentence, what is {n} times 3?" for n in range(20)]

    async def one(client: Client, q: str) -> tuple[str, str, str]:
        handle = await client.submit(messages=[{"role": "user", "content": q}], max_tokens=24,
                                     temperature=0.7, seed=len(q))
        streamed = "".join([e.text async for e in handle.events() if e.type == "token"])
        result = await handle.result()
        assert result.status == "done" and result.usage is not None
        return handle.id, streamed, result.text or ""

    async with Client(stack) as client:
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(one(client, q) for q in questions)), 240)
    assert len({job_id for job_id, _, _ in outcomes}) == 20
    for _job_id, streamed, text in outcomes:
        assert streamed == text and text


async def test_late_websocket_client_receives_the_whole_stream(stack: str) -> None:
    async with Client(stack) as client:
        handle = await client.submit(messages=[{"role": "user", "content": "Say hello."}],
                                     max_tokens=12)
        result = await asyncio.wait_for(handle.result(), 120)
    async with websockets.connect(handle.stream_url) as ws:
        frames = [json.loads(f) async for f in ws]
    assert [f["id"] for f in frames] == list(range(1, len(frames) + 1))
    assert frames[0]["type"] == "queued" and frames[-1]["type"] == "done"
    assert "".join(f["text"] for f in frames if f["type"] == "token") == result.text


async def test_submit_over_the_socket_streams_the_stored_result(stack: str) -> None:
    ws_url = stack.replace("http://", "ws://") + "/v1/stream"
    question = [{"role": "user", "content": QUESTION}]
    async with websockets.connect(ws_url) as ws:
        await ws.send(json.dumps({"type": "generate",
                                  "request": {"messages": question, "max_tokens": 16}}))
        accepted = json.loads(await ws.recv())
        frames = [json.loads(f) async for f in ws]
        assert ws.close_code == 1000
    assert accepted["type"] == "accepted"
    assert [f["id"] for f in frames] == list(range(1, len(frames) + 1))
    streamed = "".join(f["text"] for f in frames if f["type"] == "token")
    async with httpx.AsyncClient(base_url=stack) as http:
        stored = (await http.get(f"/v1/jobs/{accepted['id']}")).json()
    assert frames[-1]["type"] == "done" and streamed == frames[-1]["text"] == stored["text"]
    assert "Paris" in streamed


async def test_sse_follows_a_running_job_on_the_real_stack(stack: str) -> None:
    async with httpx.AsyncClient(base_url=stack, timeout=60) as http:
        job = (await http.post("/v1/jobs", json={"prompt": "Count: one, two,",
                                                 "max_tokens": 12})).json()
        async with http.stream("GET", f"/v1/jobs/{job['id']}/events") as resp:
            body = "".join([chunk async for chunk in resp.aiter_text()])
        stored = (await http.get(f"/v1/jobs/{job['id']}")).json()
    events = [json.loads(line[len("data: "):]) for line in body.splitlines()
              if line.startswith("data: ")]
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert "".join(e["text"] for e in events if e["type"] == "token") == stored["text"]


async def test_http_api_contract(stack: str) -> None:
    async with httpx.AsyncClient(base_url=stack) as http:
        assert (await http.get("/healthz")).status_code == 200
        r = await http.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 0})
        assert r.status_code == 422 and "max_tokens" in r.text
        r = await http.post("/v1/jobs", content=b"{oops", headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = await http.post("/v1/jobs", json={"prompt": "word " * 9000, "max_tokens": 5})
        assert r.status_code == 422 and "prompt" in r.text
        assert (await http.get("/v1/jobs/doesnotexist")).status_code == 404


def test_cli_submit_streams_a_sensible_answer(stack: str) -> None:
    out = cli("submit", QUESTION, "--stream", "--url", stack)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_cli_bad_input_exits_2_with_a_message(stack: str) -> None:
    out = cli("submit", "hi", "--max-tokens", "-5", "--url", stack)
    assert out.returncode == 2 and "max_tokens" in out.stderr and "Traceback" not in out.stderr
    out = cli("up", "--model", "/no/such/model", "--port", "0")
    assert out.returncode == 2 and "/no/such/model" in out.stderr and "Traceback" not in out.stderr
    out = cli("worker", "--device", "gpu")
    assert out.returncode == 2 and "device" in out.stderr and "Traceback" not in out.stderr
    out = cli("worker", "--kv-cache-dtype", "fp8")  # on the CPU
    assert out.returncode == 2 and "--kv-cache-dtype fp8" in out.stderr
    assert "Traceback" not in out.stderr
    out = cli("worker", "--kv-cache-dtype", "int4")
    assert out.returncode == 2 and "invalid choice: 'int4'" in out.stderr
    out = cli("worker", "--quantize", "fp8", "--dtype", "bfloat16")  # on the CPU
    assert out.returncode == 2 and "--quantize fp8" in out.stderr
    # Found while loading, not before: the default model is a (packed) GGUF already.
    out = subprocess.run([*TIDEGATE, "worker", "--quantize", "rtn-int8"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "TIDEGATE_METRICS_PORT": "0"})
    assert out.returncode == 2 and "quantized already" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cli_worker_on_cuda_without_a_gpu_exits_2() -> None:
    out = cli("worker", "--device", "cuda")
    assert out.returncode == 2 and "no CUDA device" in out.stderr and "Traceback" not in out.stderr


def test_official_openai_client_against_the_real_worker(stack: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack}/v1", api_key="unused-auth-is-off", max_retries=0)
    [model] = [m.id for m in client.models.list().data]
    question = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=model, messages=question, temperature=0,
                                           max_tokens=20)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0 and reply.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=model, messages=question, temperature=0,
                                                 max_tokens=20, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    text = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=5, temperature=0)
    assert text.choices[0].text and text.usage.prompt_tokens > 0


def test_queue_stats_shows_the_live_worker_and_the_backlog(
        stack: str, backend: RedisServer | ClusterServers) -> None:
    jobs = [httpx.post(f"{stack}/v1/jobs", json={"prompt": f"Count to {n}.", "max_tokens": 64,
                                                 "lane": "batch"}, timeout=30)
            for n in range(6)]
    assert all(r.status_code in (200, 201, 202) for r in jobs), [r.text for r in jobs]
    out = cli("queue", "stats", "--json", "--redis-url", backend.url)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert {lane["lane"] for lane in stats["lanes"]} == {"interactive", "batch"}
    # Per lane its partition, and (prefix routing, on by default) the sum over the workers'
    # own streams; these prompts are shorter than a KV block: nothing to route, the lane.
    batch = {lane["partition"]: lane for lane in stats["lanes"] if lane["lane"] == "batch"}
    assert set(batch) == {0, ROUTED}
    assert batch[0]["length"] >= 6  # acknowledged entries stay until trimmed
    assert batch[0]["consumers"] == 1  # the worker that read them
    waiting = sum(lane["lag"] + lane["pending"] for lane in batch.values())
    assert 0 <= waiting <= 6
    assert len(stats["workers"]) == 1  # its heartbeat: running, waiting, tok/s, KV usage
    worker = stats["workers"][0]
    assert 0 <= worker["kv_usage"] <= 1 and worker["running"] >= 0
    table = cli("queue", "stats", "--redis-url", backend.url)
    assert table.returncode == 0, table.stderr
    assert "batch" in table.stdout and "workers: 1 live" in table.stdout
    assert " rtd " in table.stdout  # the routed row
    assert worker["worker_id"] in table.stdout


def test_queue_stats_errors_exit_with_a_message() -> None:
    out = cli("queue", "stats", "--partitions", "0")
    assert out.returncode == 2 and "--partitions" in out.stderr and "Traceback" not in out.stderr
    out = cli("queue", "stats", "--redis-url", "redis://:hunter2@127.0.0.1:1/0", timeout=60)
    assert out.returncode == 1 and "cannot read the queue" in out.stderr
    assert "hunter2" not in out.stderr and "Traceback" not in out.stderr


def test_up_runs_batches(stack: str, backend: RedisServer | ClusterServers,
                        tmp_path) -> None:  # noqa: ANN001
    lines = [{"custom_id": f"q{i}", "body": {"messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"}], "max_tokens": 8}}
        for i in range(12)]
    rows = run_batch(lines, backend.url, tmp_path)
    assert [r["custom_id"] for r in rows] == [f"q{i}" for i in range(12)]
    assert all(r["error"] is None and r["response"]["body"]["text"] for r in rows)

