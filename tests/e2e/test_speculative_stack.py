"""Speculative decoding (n-gram prompt lookup) through real processes, as an operator runs it:
`tidegate api`, `tidegate gateway` and `tidegate worker --speculative ngram` serving the default
model (SmolLM2, float activations) on a real redis-server.

A greedy job gives, token for token, what a plain worker gives; its SSE stream carries every
token once, in order, although a step may now emit several tokens of a request at once; a job
that quotes its prompt has drafts accepted (the worker's /metrics counts them); a job with
``"speculative": false`` is served without drafts and the same tokens; and the CLI refuses, with
exit status 2 and a message naming the reason, a speculative worker it cannot start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RedisServer, free_port
from tests.metric_reference import assert_documented
from tests.stack_process import TIDEGATE, cli, heartbeat_of, stop, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2"
STARTUP_S = 120
# Two cores: one torch thread a process, a small KV cache; the default 8-bit activations, whose
# bits do not depend on how many rows a step has, so a verify chunk reproduces plain decoding
# token for token.
WORKER_ARGS = ("--model", MODEL)
WORKER_ENV = {"TIDEGATE_LOG_LEVEL": "INFO", "TIDEGATE_KV_CACHE_GB": "0.1",
              "TIDEGATE_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SPEC = ("--speculative", "ngram", "--num-speculative-tokens", "4")

PARAGRAPH = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk, carrying a small "
    "brass lamp and a notebook filled with careful observations about the weather, the "
    "passing ships, and the birds that nested along the cliffs. Over forty years he never "
    "missed a single night, and the villagers said the light had become as dependable as the "
    "tides themselves."
)
QUOTE = {"messages": [{"role": "user", "content":
                       f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}"}],
         "max_tokens": 80, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Write two sentences about autumn leaves."}],
        "max_tokens": 40, "temperature": 0}
# The quote cut short by a stop string: a verify chunk may hold the stop and tokens after it.
QUOTE_STOP = {**QUOTE, "stop": ["forty years"]}
JOBS = {"quote": QUOTE, "chat": CHAT, "quote-stop": QUOTE_STOP}
COUNTERS = ("tidegate_spec_draft_tokens_total", "tidegate_spec_accepted_tokens_total",
            "tidegate_spec_verify_chunks_total")


# ---------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A `tidegate` process, its output in a file (read when a test fails or checks a log)."""

    popen: subprocess.Popen
    log: Path
    metrics_port: int = 0

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def assert_running(self) -> None:
        assert self.popen.poll() is None, (
            f"exited with {self.popen.returncode}:\n{self.output()[-4000:]}")

    def metrics(self) -> dict[str, float]:
        """The worker's /metrics: each sample's name -> its value, summed over labels."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        assert_documented(text)
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out


def start(log: Path, *args: str, url: str, **env: str) -> Proc:
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [*TIDEGATE, *args],
            env={**os.environ, "TIDEGATE_REDIS_URL": url, **WORKER_ENV, **env},
            stdout=out, stderr=subprocess.STDOUT)
    return Proc(popen, log, int(env.get("TIDEGATE_METRICS_PORT", "0")))


def start_worker(logs: Path, name: str, *args: str, url: str) -> tuple[Proc, str]:
    """A worker serving MODEL with its own /metrics port, once it heartbeats: (process, id)."""
    proc = start(logs / f"{name}.log", "worker", *WORKER_ARGS, *args, url=url,
                 TIDEGATE_METRICS_PORT=str(free_port()))
    try:
        wait_until(lambda: heartbeat_of(url, proc.popen.pid) or proc.popen.poll() is not None,
                   f"worker {name} to heartbeat")
        proc.assert_running()
    except BaseException:
        stop(proc.popen)
        raise
    worker_id = heartbeat_of(url, proc.popen.pid)
    assert worker_id is not None
    return proc, worker_id


# ---------------------------------------------------------------------------- jobs


@dataclass
class Stack:
    api: str  # `tidegate api`: jobs in, results out
    gateway: str  # `tidegate gateway`: their events, over SSE
    redis_url: str


def ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Outcome:
    """A job's stored result and its events, read as a user follows it (SSE)."""

    result: dict
    events: list[dict]

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if e["type"] == "token" for t in e["token_ids"]]

    @property
    def worker(self) -> str:
        [started] = [e["worker"] for e in self.events if e["type"] == "started"]
        return started


async def run_job(stack: Stack, body: dict) -> Outcome:
    """Submit ``body`` and follow it over SSE from its submission to its end; then its result.
    The stream is checked whole: ids 1..N, one queued, one started, token events whose
    indices continue one another, and a done event last whose text the tokens spell."""
    async with (httpx.AsyncClient(base_url=stack.api, timeout=120) as http,
                httpx.AsyncClient(base_url=stack.gateway, timeout=120) as gateway):
        r = await http.post("/v1/jobs", json={"timeout_s": 600, **body})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        async with gateway.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            assert resp.status_code == 200, resp.status_code
            body_text = "".join([chunk async for chunk in resp.aiter_text()])
        result = (await http.get(f"/v1/jobs/{job_id}")).json()
    events = [json.loads(line[len("data: "):]) for line in body_text.splitlines()
              if line.startswith("data: ")]
    assert result["status"] == "done", result
    assert [e["id"] for e in events] == list(range(1, len(events) + 1)), events
    assert {e["job_id"] for e in events} == {job_id}
    types = [e["type"] for e in events]
    assert types[:2] == ["queued", "started"] and types[-1] == "done", types
    assert set(types[2:-1]) == {"token"}, types
    index = 0
    for e in events[2:-1]:
        assert e["index"] == index and e["token_ids"], (index, e)
        index += len(e["token_ids"])
    done = events[-1]
    assert index == done["usage"]["completion_tokens"] == result["usage"]["completion_tokens"]
    streamed = "".join(e["text"] for e in events if e["type"] == "token")
    assert streamed == done["text"] == result["text"], (streamed, done["text"], result["text"])
    return Outcome(result, events)


def same_output(got: Outcome, want: Outcome, what: str) -> None:
    """Token for token, the same text, the same end."""
    assert got.token_ids == want.token_ids, (
        f"{what}: token ids differ from the plain worker's at generated position "
        f"{_first_difference(got.token_ids, want.token_ids)}:\n"
        f"  speculative: {got.token_ids}\n  plain:       {want.token_ids}\n"
        f"  speculative text: {got.result['text']!r}\n  plain text:       {want.result['text']!r}")
    assert got.result["text"] == want.result["text"], what
    assert got.result["finish_reason"] == want.result["finish_reason"], what
    assert got.result["usage"] == want.result["usage"], what


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speculative-logs")


@contextlib.contextmanager
def api_and_gateway(redis_server: RedisServer, logs: Path) -> Iterator[Stack]:
    """`tidegate api` serving MODEL and `tidegate gateway` on a flushed Redis, once both
    are ready (workers come and go); stopped on the way out."""
    redis_server.flush()
    url = redis_server.url
    api_port, gateway_port = free_port(), free_port()
    procs = [start(logs / "api.log", "api", "--model", MODEL, "--port", str(api_port),
                   url=url, TIDEGATE_LOG_LEVEL="WARNING"),
             start(logs / "gateway.log", "gateway", "--port", str(gateway_port),
                   url=url, TIDEGATE_LOG_LEVEL="WARNING")]
    out = Stack(f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{gateway_port}", url)
    try:
        for proc, base in zip(procs, (out.api, out.gateway), strict=True):
            wait_until(lambda p=proc, b=base: ready(b) or p.popen.poll() is not None, base)
            proc.assert_running()
        yield out
    finally:
        for proc in procs:
            stop(proc.popen)


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logs: Path) -> Iterator[Stack]:
    with api_and_gateway(redis_server, logs) as out:
        yield out


@pytest.fixture(scope="module")
def reference(stack: Stack, logs: Path) -> dict[str, Outcome]:
    """JOBS on a plain worker (one at a time), stopped before the speculative one starts."""
    worker, worker_id = start_worker(logs, "plain", url=stack.redis_url)
    try:
        outcomes = {name: asyncio.run(run_job(stack, body)) for name, body in JOBS.items()}
        # A plain worker exports no speculative counters.
        assert not [m for m in worker.metrics() if m.startswith("tidegate_spec_")]
    finally:
        stop(worker.popen)
    assert worker.popen.returncode == 0, worker.output()[-4000:]
    assert {o.worker for o in outcomes.values()} == {worker_id}
    return outcomes


@pytest.fixture(scope="module")
def spec_worker(stack: Stack, reference: dict[str, Outcome],
                logs: Path) -> Iterator[tuple[Proc, str]]:
    """A `--speculative ngram` worker on the same API and Redis, once the plain one stopped."""
    worker, worker_id = start_worker(logs, "speculative", *SPEC, url=stack.redis_url)
    try:
        yield worker, worker_id
    finally:
        stop(worker.popen)
    assert worker.popen.returncode == 0, worker.output()[-4000:]
    log = worker.output()
    assert "Traceback" not in log and "ERROR" not in log, log[-4000:]


# ---------------------------------------------------------------------------- tests


async def test_speculative_worker_serves_the_plain_workers_tokens_and_streams_each_once(
        stack: Stack, reference: dict[str, Outcome],
        spec_worker: tuple[Proc, str]) -> None:
    worker, worker_id = spec_worker
    worker.assert_running()
    assert {m: v for m, v in worker.metrics().items() if m in COUNTERS} == dict.fromkeys(
        COUNTERS, 0.0)
    # One at a time, as the plain worker ran them.
    for name, body in JOBS.items():
        before = worker.metrics()
        got = await run_job(stack, body)
        after = worker.metrics()
        assert got.worker == worker_id, name
        same_output(got, reference[name], name)
        if name.startswith("quote"):
            # It did decode speculatively: drafts went through verify chunks.
            assert after["tidegate_spec_verify_chunks_total"] > before[
                "tidegate_spec_verify_chunks_total"], (name, before, after)
    # All at once: verify chunks and plain decodes share the worker's steps.
    together = await asyncio.gather(*(run_job(stack, body) for body in JOBS.values()))
    for name, got in zip(JOBS, together, strict=True):
        same_output(got, reference[name], f"{name}, batched")
    # Real answers: the quote is the paragraph, the stop ends it where the stop string began.
    quote, stopped = reference["quote"].result, reference["quote-stop"].result
    assert PARAGRAPH[:40] in quote["text"], quote
    assert reference["chat"].result["text"].strip(), reference["chat"].result
    assert stopped["finish_reason"] == "stop" and "forty" not in stopped["text"], stopped
    assert quote["text"].startswith(stopped["text"]) and "forty years" in quote["text"]


async def test_metrics_count_accepted_drafts_of_a_quoting_job(
        stack: Stack, reference: dict[str, Outcome],
        spec_worker: tuple[Proc, str]) -> None:
    worker, _ = spec_worker
    before = worker.metrics()
    got = await run_job(stack, QUOTE)
    same_output(got, reference["quote"], "quote")
    after = worker.metrics()
    drafted, accepted, chunks = (after[c] - before[c] for c in COUNTERS)
    assert after["tidegate_spec_accepted_tokens_total"] > 0, after
    assert 0 < accepted <= drafted and chunks > 0, (drafted, accepted, chunks)
    # Quoting its prompt, a good share of the job's tokens come as accepted drafts.
    assert accepted >= got.result["usage"]["completion_tokens"] // 3, (drafted, accepted, chunks)


async def test_accepted_drafts_are_never_more_than_the_tokens_they_gave(
        stack: Stack, reference: dict[str, Outcome],
        spec_worker: tuple[Proc, str]) -> None:
    """Every verify chunk gives its kept drafts and one token more, all after the first token
    (the prefill's): accepted + chunks <= completion_tokens - 1, as the metric's help says."""
    worker, _ = spec_worker
    before = worker.metrics()
    got = await run_job(stack, QUOTE)
    same_output(got, reference["quote"], "quote")
    after = worker.metrics()
    _, accepted, chunks = (after[c] - before[c] for c in COUNTERS)
    assert accepted + chunks <= got.result["usage"]["completion_tokens"] - 1, (
        accepted, chunks, got.result["usage"])


async def test_a_job_that_turns_speculation_off_gets_no_drafts_and_the_same_tokens(
        stack: Stack, reference: dict[str, Outcome],
        spec_worker: tuple[Proc, str]) -> None:
    worker, worker_id = spec_worker
    before = worker.metrics()
    got = await run_job(stack, {**QUOTE, "speculative": False})
    after = worker.metrics()
    assert got.worker == worker_id
    same_output(got, reference["quote"], "quote, speculative false")
    for counter in COUNTERS:
        assert after[counter] == before[counter], (counter, before[counter], after[counter])
    # The same job, drafting again: the counters move (the opt-out, not an idle drafter).
    got = await run_job(stack, QUOTE)
    same_output(got, reference["quote"], "quote")
    assert worker.metrics()["tidegate_spec_draft_tokens_total"] > after[
        "tidegate_spec_draft_tokens_total"]


@pytest.mark.parametrize(("args", "env", "reason"), [
    (("--speculative", "bogus"), {}, "speculative: String should match pattern"),
    ((), {"TIDEGATE_SPECULATIVE": "bogus"}, "speculative: String should match pattern"),
    (("--speculative", "ngram", "--tensor-parallel-size", "2", "--model", "random:tiny"), {},
     "--speculative: not served by tensor- or pipeline-parallel workers"),
    (("--speculative", "ngram", "--pipeline-parallel-size", "2", "--model", "random:tiny"), {},
     "--speculative: not served by tensor- or pipeline-parallel workers"),
    (("--tensor-parallel-size", "2", "--model", "random:tiny"), {"TIDEGATE_SPECULATIVE": "ngram"},
     "--speculative: not served by tensor- or pipeline-parallel workers"),
    (("--speculative", "ngram", "--num-speculative-tokens", "0"), {},
     "num_speculative_tokens: Input should be greater than or equal to 1"),
], ids=["bogus", "bogus-env", "tp2", "pp2", "tp2-env", "k0"])
def test_cli_refuses_a_speculative_worker_it_cannot_start(
        args: tuple[str, ...], env: dict[str, str], reason: str) -> None:
    # An unreachable Redis: the refusal comes before anything is started or connected.
    out = subprocess.run(
        [*TIDEGATE, "worker", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert out.returncode == 2, (out.returncode, out.stderr[-4000:])
    assert reason in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stdout == ""


def test_up_refuses_a_parallel_speculative_worker() -> None:
    out = cli("up", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--speculative", "ngram",
              "--tensor-parallel-size", "2", "--model", "random:tiny")
    assert out.returncode == 2, (out.returncode, out.stderr[-4000:])
    assert out.stderr.strip() == ("tidegate: error: --speculative: not served by tensor- or "
                                  "pipeline-parallel workers yet"), out.stderr
