"""The load generator's own ceiling, measured against the real API and gateway with no worker.

* submit: K trivial jobs (batch lane, ``max_tokens: 1``) submitted as fast as the generator's
  pools allow; submits/s = 202s received / (last 202 - first request). No worker runs, so the
  jobs only queue; Redis is flushed afterwards and the workers start on an empty queue.
* follow: M complete jobs written straight into Redis as a worker would have left them (job
  hash with ``status: done`` and its ``result``; the event stream ``queued``, ``started``, the
  token events, ``done``), then all followed through the gateway at once (replay), with the same
  follower and exactness checks as real jobs; events/s and tokens/s received.

The pre-written layout (``tidegate.jobstore``, ``tidegate.keys``): each event is an entry of
``keys.job_events(id)`` whose one field ``e`` holds the event JSON, under the explicit entry id
``<event id>-0``; the hash ``keys.job_hash(id)`` holds ``job``, ``status``, ``owner``,
``stream_token_hash`` and ``result``. If that layout changes, this is the one place to follow it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import redis

from tidegate import keys
from tidegate.benchmarks.harness.load.loadgen import (
    ClientPlan,
    Endpoints,
    JobSpec,
    LoadResult,
    run_load,
    shard,
)
from tidegate.benchmarks.harness.load.workload import WORDS
from tidegate.benchmarks.harness.measure.metrics import (
    Dist,
    Slo,
    exactness_problem,
    generator_use,
    stack_shares,
)
from tidegate.events.event_log import EVENT_FIELD
from tidegate.http.auth import ANONYMOUS, new_stream_token, tenant_of, token_hash
from tidegate.protocol import (
    DoneEvent,
    JobRequest,
    QueuedEvent,
    StartedEvent,
    Timings,
    TokenEvent,
    Usage,
)

PROMPT_TOKENS = 16  # what the pre-written jobs' usage says their prompts were


@dataclass(frozen=True, slots=True)
class Runner:
    """What a capacity measurement needs from the benchmark: processes, pools, the stack."""

    endpoints: Endpoints
    procs: int
    pool_size: int
    sample_cpu: Callable[[], dict[str, float]]
    check_stack: Callable[[], None]

    def load(self, jobs: list[JobSpec], timeout_s: float = 300) -> LoadResult:
        plans = [ClientPlan(self.endpoints, part, self.pool_size, timeout_s)
                 for part in shard(jobs, self.procs)]
        return run_load(plans, self.sample_cpu, self.check_stack)


def submit_capacity(runner: Runner, count: int) -> dict[str, object]:
    jobs = [JobSpec(i, json.dumps({"prompt": f"capacity probe {i}", "max_tokens": 1,
                                   "lane": "batch", "timeout_s": 600}).encode(), 0, 1, 0.0,
                    "none") for i in range(count)]
    load = runner.load(jobs)
    accepted = [r for r in load.records if r.submit_status == 202]
    window = (max(r.t_accepted for r in accepted) - min(r.t_sent for r in load.records)
              if accepted else float("nan"))
    return {"jobs": count, "accepted": len(accepted),
            "submits_per_s": round(len(accepted) / window, 1),
            "submit_ms": asdict(Dist.of([1000 * (r.t_accepted - r.t_sent) for r in accepted])),
            "generator": generator_use(load), "stack_cpu_share": stack_shares(load)}


def follow_capacity(runner: Runner, redis_port: int, *, streams: int, tokens: int,
                    tokens_per_event: int, follow: list[str]) -> dict[str, object]:
    owner = tenant_of(runner.endpoints.api_key) if runner.endpoints.api_key else ANONYMOUS
    jobs = prewrite(redis_port, streams, tokens, tokens_per_event, owner, follow)
    load = runner.load(jobs)
    slo = Slo(deadline_s=600)
    problems = [(r, p) for r in load.records if (p := exactness_problem(r, slo))]
    traces = [r.trace for r in load.records if r.trace is not None]
    start = min(r.t_sent for r in load.records)
    window = max((r.t_final for r in load.records if r.t_final), default=start) - start
    events, received = sum(t.events for t in traces), sum(t.tokens for t in traces)
    return {"streams": streams, "tokens_per_stream": tokens,
            "tokens_per_event": tokens_per_event, "follow": sorted(set(follow)),
            "events": events, "tokens": received, "seconds": round(window, 3),
            "events_per_s": round(events / window, 1), "tokens_per_s": round(received / window, 1),
            "exact": not problems and len(traces) == streams,
            "failure_examples": [f"{r.job_id}: {p}" for r, p in problems[:5]],
            "generator": generator_use(load), "stack_cpu_share": stack_shares(load)}


def prewrite(redis_port: int, streams: int, tokens: int, per_event: int, owner: str,
             follow: list[str]) -> list[JobSpec]:
    """``streams`` finished jobs of ``tokens`` tokens each, stored as a worker leaves them."""
    client = redis.Redis(port=redis_port)
    specs = []
    try:
        for i in range(streams):
            job_id, token = f"capacity-{i:06d}", new_stream_token()
            pipe = client.pipeline(transaction=False)
            _write_job(pipe, job_id, token, tokens, per_event, owner)
            pipe.execute()
            specs.append(JobSpec(i, b"", PROMPT_TOKENS, tokens, 0.0, follow[i % len(follow)],
                                 job_id=job_id, stream_token=token))
    finally:
        client.close()
    return specs


def _write_job(pipe: redis.client.Pipeline, job_id: str, token: str, tokens: int,
               per_event: int, owner: str) -> None:
    job = JobRequest(prompt=f"capacity stream {job_id}", max_tokens=tokens, ignore_eos=True
                     ).to_job(model="capacity", default_timeout_s=600, job_id=job_id)
    events = [QueuedEvent(id=1, job_id=job_id, lane=job.lane),
              StartedEvent(id=2, job_id=job_id, worker="capacity-check",
                           prompt_tokens=PROMPT_TOKENS)]
    texts = [" " + WORDS[k % len(WORDS)] for k in range(tokens)]
    for first in range(0, tokens, per_event):
        ids = list(range(first, min(first + per_event, tokens)))
        events.append(TokenEvent(id=len(events) + 1, job_id=job_id, index=first,
                                 text="".join(texts[k] for k in ids), token_ids=ids))
    usage = Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=tokens,
                  total_tokens=PROMPT_TOKENS + tokens)
    timings = Timings(queue_ms=0, ttft_ms=0, total_ms=0, decode_tokens_per_s=0)
    text = "".join(texts)
    events.append(DoneEvent(id=len(events) + 1, job_id=job_id, finish_reason="length",
                            text=text, usage=usage, timings=timings))
    result = {"text": text, "finish_reason": "length", "usage": usage.model_dump(),
              "timings": timings.model_dump()}
    pipe.hset(keys.job_hash(job_id), mapping={
        "job": job.model_dump_json(), "status": "done", "owner": owner,
        "stream_token_hash": token_hash(token), "result": json.dumps(result)})
    for event in events:
        pipe.xadd(keys.job_events(job_id), {EVENT_FIELD: event.model_dump_json(exclude_none=True)},
                  id=f"{event.id}-0")
