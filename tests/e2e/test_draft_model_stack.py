"""Speculative decoding with a draft model through real processes: `tidegate worker
--speculative draft:smollm2` serving the default model with itself as the draft (the ceiling:
every draft is the target's own argmax), beside `tidegate api` and `tidegate gateway` on a real
redis-server.

Greedy jobs give, token for token, what a plain worker gives, over SSE as a user follows them;
the draft's passes and its kept drafts show in the worker's /metrics; and the CLI refuses, with
exit status 2 and a message naming the reason, a draft it cannot use.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RedisServer, free_port
from tests.e2e.test_speculative_stack import (
    CHAT,
    QUOTE,
    QUOTE_STOP,
    Outcome,
    Proc,
    Stack,
    api_and_gateway,
    run_job,
    same_output,
    start_worker,
)
from tests.stack_process import TIDEGATE, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2"
JOBS = {"quote": QUOTE, "chat": CHAT, "quote-stop": QUOTE_STOP}
DRAFT = ("--speculative", "draft:smollm2", "--num-speculative-tokens", "3")


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Stack, Path]]:
    logs = tmp_path_factory.mktemp("draft-logs")
    with api_and_gateway(redis_server, logs) as out:
        yield out, logs


def serve_jobs(stack: Stack, logs: Path, name: str, *args: str
               ) -> tuple[dict[str, Outcome], dict[str, float], Proc]:
    """JOBS one at a time, then all at once, on a worker of its own, stopped after."""
    worker, worker_id = start_worker(logs, name, *args, url=stack.redis_url)
    try:
        outcomes = {n: asyncio.run(run_job(stack, body)) for n, body in JOBS.items()}
        together = asyncio.run(_together(stack))
        metrics = worker.metrics()
    finally:
        stop(worker.popen)
    assert worker.popen.returncode == 0, worker.output()[-4000:]
    assert {o.worker for o in outcomes.values()} == {worker_id}
    outcomes.update({f"{n}, batched": o for n, o in together.items()})
    return outcomes, metrics, worker


async def _together(stack: Stack) -> dict[str, Outcome]:
    got = await asyncio.gather(*(run_job(stack, body) for body in JOBS.values()))
    return dict(zip(JOBS, got, strict=True))


def test_a_draft_model_worker_serves_the_plain_workers_tokens(
        stack: tuple[Stack, Path]) -> None:
    api, logs = stack
    plain, _, _ = serve_jobs(api, logs, "plain")
    drafted, metrics, worker = serve_jobs(api, logs, "draft", *DRAFT)
    for name, want in plain.items():
        same_output(drafted[name], want, name)
    log = worker.output()
    assert "draft model SmolLM2-135M-Instruct loaded" in log, log[-4000:]
    assert "Traceback" not in log and "ERROR" not in log, log[-4000:]
    # The target drafting for itself: its drafts are kept, bar those after a stop; several
    # tokens came out of each verify chunk.
    draft, kept = (metrics["tidegate_spec_draft_tokens_total"],
                   metrics["tidegate_spec_accepted_tokens_total"])
    chunks = metrics["tidegate_spec_verify_chunks_total"]
    assert kept >= 0.8 * draft > 0, metrics
    assert (kept + chunks) / chunks > 2.5, metrics
    assert metrics["tidegate_spec_draft_passes_total"] > 0
    assert 0 < metrics["tidegate_spec_steps_total"]


@pytest.mark.parametrize(("args", "reason"), [
    (("--speculative", "draft:/no/such/model"),
     "--speculative draft:/no/such/model: model '/no/such/model': path /no/such/model does "
     "not exist"),
    (("--speculative", "draft:random:tiny"),
     "--speculative draft:random:tiny: the draft's tokenizer is not SmolLM2-135M-Instruct's"),
    (("--speculative", "eagle"), "speculative: String should match pattern"),
    (("--speculative", "ngram", "--speculative-max-batch", "0"),
     "speculative_max_batch: Input should be greater than or equal to 1"),
], ids=["missing", "other-tokenizer", "unknown", "max-batch-0"])
def test_cli_refuses_a_draft_it_cannot_use(args: tuple[str, ...], reason: str) -> None:
    out = subprocess.run(
        [*TIDEGATE, "worker", "--model", MODEL, "--redis-url",
         f"redis://127.0.0.1:{free_port()}/0", *args],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "TIDEGATE_METRICS_PORT": "0"})
    assert out.returncode == 2, (out.returncode, out.stderr[-4000:])
    assert reason in out.stderr and "Traceback" not in out.stderr, out.stderr
