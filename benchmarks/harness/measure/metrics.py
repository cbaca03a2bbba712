"""From what the clients saw to a run's numbers, in the manner of ``vllm bench serve``.

Per job (times on the generator's monotonic clock, latencies in ms):
* TTFT: submit request written -> first token event received;
* TPOT: (E2E - TTFT) / (output tokens - 1), jobs with more than one token;
* ITL: each gap between consecutive token events of a job (an event may carry several tokens:
  ``tokens_per_event`` says how many on average);
* E2E: submit written -> final event received.
The offered load of a Poisson run is its nominal rate x the mean output length; a finite
sample's arrivals come to ``arrival_rate``, a few percent off the nominal one.
Latencies come from followed jobs only (polled ones are counted by their stored result).
Per run: duration is first submit -> last final event; throughputs divide by it; output tokens
are every token delivered by a ``done`` job; goodput counts jobs that finished complete (``done``,
all their tokens) within their deadline, SLO goodput those also within the TTFT/TPOT targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tidegate.benchmarks.harness.load.loadgen import JobRecord, LoadResult

MAX_EXAMPLES = 5
GENERATOR_BUSY = 0.8  # a generator process above this share of a core may be the limit


@dataclass(frozen=True, slots=True)
class Dist:
    """mean / p50 / p90 / p99 of one latency, ms (None without samples)."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    n: int

    @classmethod
    def of(cls, xs: Sequence[float]) -> Dist:
        if not len(xs):
            return cls(None, None, None, None, 0)
        p50, p90, p99 = (float(v) for v in np.percentile(xs, [50, 90, 99]))
        return cls(round(float(np.mean(xs)), 3), round(p50, 3), round(p90, 3), round(p99, 3),
                   len(xs))


@dataclass(frozen=True, slots=True)
class Slo:
    deadline_s: float  # each job's timeout_s
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    deadline_given: bool = False  # a deadline was asked for: shed or cut jobs are legitimate


@dataclass(slots=True)
class RunSummary:
    kind: str  # "burst" | "rate"
    label: str
    request_rate: float | None  # offered requests/s (None: burst)
    arrival_rate: float | None  # what this sample of arrivals came to: (jobs - 1) / last arrival
    jobs: int
    followed: dict[str, int]  # jobs per follow mode
    completed: int  # done with exactly their output length (constrained: or grammar complete)
    failed: int  # accepted but not completed (error, cut at the deadline, lost)
    rejected: int  # refused at submit, or ended ``rejected`` by a worker
    duration_s: float
    request_throughput: float  # completed jobs / s
    input_tokens: int
    output_tokens: int
    output_tok_s: float
    total_tok_s: float
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    tokens_per_event: float | None
    submit_ms: Dist  # submit written -> its 202
    attach_ms: Dist  # 202 -> the follower's first event (connected, replay begun)
    # scheduled arrival -> submit written: the generator keeping up, and in a burst the wait
    # for one of the --submit-concurrency connections
    submit_lag_ms: Dist
    goodput_jobs_s: float
    slo_goodput_jobs_s: float | None
    offered_output_tok_s: float | None
    delivered_share: float | None  # output tok/s over the whole run (its ramp and tail too)
    # Poisson runs: the output tokens/s received while the pipeline was full (from the first
    # arrival plus the median E2E to the last arrival) against the tokens/s the sample's
    # arrivals offered: ~1.0 when the stack keeps up, below when a backlog grows; None when
    # that window is under 2 s.
    steady_delivered_share: float | None
    exact: bool
    exact_failures: int
    failure_examples: list[str]
    resumes: int  # followers that reconnected with last_event_id
    generator: dict[str, float]
    stack_cpu_share: dict[str, float]  # each stack process: CPU seconds / wall seconds
    engine_alone_tok_s: float | None = None
    ratio_to_engine_alone: float | None = None
    same_text_as_engine_alone: float | None = None  # share of jobs with identical text
    # Poisson runs with --engine-alone-rates: the engine alone's TTFT, TPOT, E2E and steady
    # delivered share on the same arrival schedule.
    engine_alone: dict[str, object] = field(default_factory=dict)
    # Per worker, its counters' growth over the run: seconds in engine steps, the engine
    # thread's CPU in them, the event loop thread's CPU, the publisher's share of it, writes,
    # events, tokens (worker/service/metrics.py).
    worker_time: dict[str, dict[str, float]] = field(default_factory=dict)
    # Runs with --response-format: the outputs checked against their schemas
    # (tidegate.benchmarks.harness.measure.json_check.JsonCheck).
    json_outputs: dict[str, object] = field(default_factory=dict)
    # Poisson runs: the first ``cold_jobs`` arrivals (the stack idle before them) apart from
    # the rest: {"jobs", "ttft_ms", "queue_ms"} each, and the cold TTFT p90 over the steady's.
    cold: dict[str, object] = field(default_factory=dict)
    steady: dict[str, object] = field(default_factory=dict)
    cold_ttft_p90_ratio: float | None = None
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- per job


def final_status(rec: JobRecord) -> str | None:
    if rec.trace is not None:
        return rec.trace.final["type"] if rec.trace.final else None
    return (rec.result or {}).get("status")


def tokens_of(rec: JobRecord) -> int:
    if rec.trace is not None:
        return rec.trace.tokens
    usage = (rec.result or {}).get("usage") or {}
    return int(usage.get("completion_tokens") or 0)


def prompt_tokens_of(rec: JobRecord) -> int:
    usage = (rec.result or {}).get("usage") or {}
    return int(usage.get("prompt_tokens") or 0)


def is_complete(rec: JobRecord) -> bool:
    result = rec.result or {}
    if final_status(rec) != "done":
        return False
    if rec.constrained and result.get("finish_reason") == "stop":
        return 0 < tokens_of(rec) <= rec.output_len  # its grammar completed the document
    return result.get("finish_reason") == "length" and tokens_of(rec) == rec.output_len


def e2e_s(rec: JobRecord) -> float | None:
    return rec.t_final - rec.t_sent if rec.t_final is not None else None


def ttft_s(rec: JobRecord) -> float | None:
    if rec.trace is None or not rec.trace.token_times:
        return None
    return rec.trace.token_times[0] - rec.t_sent


def tpot_s(rec: JobRecord) -> float | None:
    e2e, ttft, n = e2e_s(rec), ttft_s(rec), tokens_of(rec)
    if e2e is None or ttft is None or n < 2:
        return None
    return (e2e - ttft) / (n - 1)


def server_latencies_s(rec: JobRecord) -> tuple[float | None, float | None]:
    """A polled job's TTFT and TPOT from its stored timings (server clock, from enqueue)."""
    timings = (rec.result or {}).get("timings") or {}
    if not timings:
        return None, None
    n = tokens_of(rec)
    ttft, total = timings["ttft_ms"] / 1000, timings["total_ms"] / 1000
    return ttft, ((total - ttft) / (n - 1) if n > 1 else None)


def exactness_problem(rec: JobRecord, slo: Slo) -> str | None:
    """Why this accepted job breaks the protocol's promises or its length; None if it holds."""
    result = rec.result or {}
    if result.get("fetch_error"):
        return f"stored result unreadable: {result['fetch_error']}"
    shed = slo.deadline_given and (result.get("status") == "rejected"
                                   or result.get("finish_reason") == "deadline")
    if rec.trace is not None:
        if problem := _stream_problem(rec, result):
            return problem
    if shed:
        return None
    return _length_problem(rec, result)


def _stream_problem(rec: JobRecord, result: dict) -> str | None:
    trace = rec.trace
    assert trace is not None
    if trace.problems:
        return trace.problems[0]
    if trace.finals != 1:
        return f"{trace.finals} final events"
    if trace.final is None or trace.final["type"] != "done":
        return None  # an error or rejection carries no text to compare
    usage = result.get("usage") or {}
    if trace.text != result.get("text"):
        return f"token texts ({len(trace.text)} chars) != stored text " \
               f"({len(result.get('text') or '')} chars)"
    if trace.final.get("text") != result.get("text"):
        return "the done event's text != stored text"
    if trace.tokens != usage.get("completion_tokens"):
        return f"{trace.tokens} tokens received, usage.completion_tokens " \
               f"{usage.get('completion_tokens')}"
    if trace.final.get("usage") != usage:
        return "the done event's usage != stored usage"
    if trace.started_prompt_tokens != usage.get("prompt_tokens"):
        return f"started.prompt_tokens {trace.started_prompt_tokens} != usage.prompt_tokens " \
               f"{usage.get('prompt_tokens')}"
    return None


def _length_problem(rec: JobRecord, result: dict) -> str | None:
    if result.get("status") != "done":
        return f"status {result.get('status')} ({(result.get('error') or {}).get('code', '')})"
    usage = result.get("usage") or {}
    n = usage.get("completion_tokens")
    if rec.constrained and result.get("finish_reason") == "stop":
        # Its grammar completed the document before max_tokens (json_check checks the text).
        if not isinstance(n, int) or not 0 < n <= rec.output_len:
            return f"usage.completion_tokens {n} outside 1..{rec.output_len}"
    elif result.get("finish_reason") != "length":
        return f"finish_reason {result.get('finish_reason')}"
    elif n != rec.output_len:
        return f"usage.completion_tokens {n} != output length {rec.output_len}"
    if rec.trace is not None and rec.trace.tokens != n:
        return f"{rec.trace.tokens} tokens received != usage.completion_tokens {n}"
    if (p := usage.get("prompt_tokens")) != rec.input_len:
        return f"usage.prompt_tokens {p} != prompt length {rec.input_len}"
    return None


# ---------------------------------------------------------------- per run


def summarize(kind: str, label: str, rate: float | None, load: LoadResult,
              slo: Slo, cold_jobs: int = 50) -> RunSummary:
    recs = load.records
    accepted = [r for r in recs if r.job_id is not None]
    done = [r for r in accepted if final_status(r) == "done"]
    complete = [r for r in accepted if is_complete(r)]
    followed = [r for r in accepted if r.trace is not None]
    duration = _duration(recs)
    out_tokens = sum(tokens_of(r) for r in done)
    in_tokens = sum(prompt_tokens_of(r) for r in done)
    problems = [(r, p) for r in accepted if (p := exactness_problem(r, slo))]
    rejected = len(recs) - len(accepted) + sum(final_status(r) == "rejected" for r in accepted)
    in_time = [r for r in complete if _within_deadline(r, slo)]
    summary = RunSummary(
        kind=kind, label=label, request_rate=rate, arrival_rate=_arrival_rate(recs),
        jobs=len(recs),
        followed=_count_modes(recs), completed=len(complete),
        failed=len(accepted) - len(complete) - sum(final_status(r) == "rejected"
                                                   for r in accepted),
        rejected=rejected, duration_s=round(duration, 3),
        request_throughput=round(len(complete) / duration, 3),
        input_tokens=in_tokens, output_tokens=out_tokens,
        output_tok_s=round(out_tokens / duration, 1),
        total_tok_s=round((in_tokens + out_tokens) / duration, 1),
        ttft_ms=_ms(ttft_s(r) for r in followed), tpot_ms=_ms(tpot_s(r) for r in followed),
        itl_ms=_ms(g for r in followed for g in np.diff(r.trace.token_times)),  # type: ignore[union-attr]
        e2e_ms=_ms(e2e_s(r) for r in followed if final_status(r) == "done"),
        tokens_per_event=_tokens_per_event(followed),
        submit_ms=_ms(r.t_accepted - r.t_sent for r in recs if r.t_accepted is not None),
        attach_ms=_ms(r.trace.first_event_at - r.t_accepted for r in followed  # type: ignore[union-attr]
                      if r.trace.first_event_at and r.t_accepted),  # type: ignore[union-attr]
        submit_lag_ms=_ms(r.t_sent - r.t_scheduled for r in recs if r.t_sent),
        goodput_jobs_s=round(len(in_time) / duration, 3),
        slo_goodput_jobs_s=_slo_goodput(in_time, slo, duration),
        offered_output_tok_s=None, delivered_share=None, steady_delivered_share=None,
        # Without a deadline every job must be accepted and complete exactly.
        exact=not problems and (slo.deadline_given or len(accepted) == len(recs)),
        exact_failures=len(problems),
        failure_examples=[f"job {r.index} ({r.job_id}): {p}" for r, p in problems[:MAX_EXAMPLES]],
        resumes=sum(r.trace.resumes for r in followed),  # type: ignore[union-attr]
        generator=generator_use(load), stack_cpu_share=stack_shares(load),
    )
    if summary.generator["busiest_process_share"] > GENERATOR_BUSY:
        summary.notes.append("a generator process was busy most of the run: it may have been "
                             "the limit (use more --client-procs)")
    refused = [r for r in recs if r.job_id is None]
    if refused and not slo.deadline_given:
        summary.failure_examples += [f"job {r.index}: submit refused ({r.submit_status}): "
                                     f"{r.submit_error}" for r in refused[:MAX_EXAMPLES]]
    if rate is not None:
        offered = rate * float(np.mean([r.output_len for r in recs]))
        summary.offered_output_tok_s = round(offered, 1)
        summary.delivered_share = round(summary.output_tok_s / offered, 3)
        # Against the sample's own arrivals: a short Poisson sample comes off its rate.
        actual = (summary.arrival_rate or rate) * float(np.mean([r.output_len for r in recs]))
        summary.steady_delivered_share = _steady_share(recs, followed, actual)
        _split_cold(summary, recs, cold_jobs)
    return summary


def _split_cold(summary: RunSummary, recs: list[JobRecord], cold_jobs: int) -> None:
    """The run's first ``cold_jobs`` arrivals apart from the rest (``RunSummary.cold``): a stack
    that was idle must admit a wave as fast as a busy one does."""
    ordered = sorted(recs, key=lambda r: r.t_scheduled)
    if len(ordered) < 2 * cold_jobs:
        return
    parts = {"cold": ordered[:cold_jobs], "steady": ordered[cold_jobs:]}
    for name, part in parts.items():
        queue = [((r.result or {}).get("timings") or {}).get("queue_ms") for r in part]
        setattr(summary, name, {
            "jobs": len(part), "ttft_ms": _ms(ttft_s(r) for r in part),
            "queue_ms": Dist.of([q for q in queue if q is not None])})
    cold, steady = summary.cold["ttft_ms"].p90, summary.steady["ttft_ms"].p90  # type: ignore[union-attr]
    if cold is not None and steady:
        summary.cold_ttft_p90_ratio = round(cold / steady, 3)


STEADY_MIN_S = 2.0


def _steady_share(recs: list[JobRecord], followed: list[JobRecord], offered: float
                  ) -> float | None:
    """Tokens received per second while the pipeline was full, over the tokens/s offered to
    the followed jobs (``steady_delivered_share``)."""
    e2e = [e2e_s(r) for r in followed if final_status(r) == "done"]
    if not e2e or not followed:
        return None
    t0 = min(r.t_scheduled for r in recs) + float(np.median(e2e))
    t1 = max(r.t_scheduled for r in recs)
    if t1 - t0 < STEADY_MIN_S:
        return None
    received = sum(n for r in followed
                   for t, n in zip(r.trace.token_times, r.trace.token_counts, strict=True)  # type: ignore[union-attr]
                   if t0 <= t <= t1)
    return round(received / (t1 - t0) / (offered * len(followed) / len(recs)), 3)


def _arrival_rate(recs: list[JobRecord]) -> float | None:
    span = max(r.t_scheduled for r in recs) - min(r.t_scheduled for r in recs)
    return round((len(recs) - 1) / span, 3) if span > 0 else None


def _duration(recs: list[JobRecord]) -> float:
    starts = [r.t_sent for r in recs if r.t_sent]
    ends = [r.t_final for r in recs if r.t_final is not None]
    if not starts or not ends:
        return float("nan")
    return max(ends) - min(starts)


def _within_deadline(rec: JobRecord, slo: Slo) -> bool:
    if rec.trace is None:
        total_ms = ((rec.result or {}).get("timings") or {}).get("total_ms")
        return total_ms is not None and total_ms <= 1000 * slo.deadline_s
    e2e = e2e_s(rec)
    return e2e is not None and e2e <= slo.deadline_s


def _slo_goodput(in_time: list[JobRecord], slo: Slo, duration: float) -> float | None:
    if slo.ttft_ms is None and slo.tpot_ms is None:
        return None
    good = 0
    for rec in in_time:
        ttft, tpot = (ttft_s(rec), tpot_s(rec)) if rec.trace else server_latencies_s(rec)
        ok_ttft = slo.ttft_ms is None or (ttft is not None and 1000 * ttft <= slo.ttft_ms)
        ok_tpot = slo.tpot_ms is None or tpot is None or 1000 * tpot <= slo.tpot_ms
        good += ok_ttft and ok_tpot
    return round(good / duration, 3)


def _ms(seconds: object) -> Dist:
    return Dist.of([1000 * float(s) for s in seconds if s is not None])  # type: ignore[attr-defined]


def _tokens_per_event(followed: list[JobRecord]) -> float | None:
    events = sum(len(r.trace.token_counts) for r in followed)  # type: ignore[union-attr]
    return round(sum(r.trace.tokens for r in followed) / events, 3) if events else None  # type: ignore[union-attr]


def _count_modes(recs: list[JobRecord]) -> dict[str, int]:
    modes: dict[str, int] = {}
    for r in recs:
        modes[r.follow] = modes.get(r.follow, 0) + 1
    return modes


def generator_use(load: LoadResult) -> dict[str, float]:
    """The generator's CPU: all its processes (and this one) over the window, in cores."""
    cpu = sum(load.proc_cpu_s) + load.parent_cpu_s
    busiest = max((c / w for c, w in zip(load.proc_cpu_s, load.proc_wall_s, strict=True)
                   if w > 0), default=0.0)
    return {"processes": len(load.proc_cpu_s), "cpu_s": round(cpu, 2),
            "wall_s": round(load.wall_s, 2), "cores": round(cpu / load.wall_s, 3),
            "busiest_process_share": round(busiest, 3)}


def stack_shares(load: LoadResult) -> dict[str, float]:
    return {name: round(cpu / load.wall_s, 3) for name, cpu in load.stack_cpu_s.items()}


def job_details(load: LoadResult) -> list[dict[str, object]]:
    """Per job (``--save-detailed``): what it was, when things happened, what went wrong."""
    rows = []
    for r in load.records:
        t = r.trace
        rows.append({
            "index": r.index, "job_id": r.job_id, "follow": r.follow, "input_len": r.input_len,
            "output_len": r.output_len, "submit_status": r.submit_status,
            "submit_error": r.submit_error, "status": final_status(r), "tokens": tokens_of(r),
            "ttft_ms": _round_ms(ttft_s(r)), "tpot_ms": _round_ms(tpot_s(r)),
            "e2e_ms": _round_ms(e2e_s(r)),
            "attach_ms": _round_ms(t.first_event_at - r.t_accepted
                                   if t and t.first_event_at and r.t_accepted else None),
            "itl_ms": [round(1000 * g, 3) for g in np.diff(t.token_times)] if t else None,
            "tokens_per_event": t.token_counts if t else None,
            "server_timings": (r.result or {}).get("timings"),  # from enqueue, server clock
            "problems": t.problems if t else [], "resumes": t.resumes if t else 0})
    return rows


def _round_ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)
