"""Chaos benchmark: the whole stack under fire, every accepted job checked as its client saw it.

Starts redis-server (``appendonly yes``, ``appendfsync always``, its own directory and port),
``tidegate api``, ``tidegate gateway`` and ``--workers`` workers as separate processes, then:

1. chaos: jobs are submitted through the API (``--concurrency`` at a time; half greedy, half
   sampled with a seed; ``--max-tokens`` long enough to be mid-generation when a kill lands),
   each followed by a client over the gateway's WebSocket (every ``--sse-every``-th over SSE)
   that reconnects with its last event id after any drop, as a careful user's code does
   (``tidegate.benchmarks.harness.load.patient_client``). Meanwhile ``ChaosMonkey`` SIGKILLs workers
   (starting another each time), SIGKILLs Redis and starts it again from its AOF, and
   SIGKILLs the gateway and starts it again. Submitting goes on until ``--jobs`` jobs were
   accepted and the whole chaos plan was carried out;
2. reference: the same requests again on the now calm stack, uninterrupted.

Checked for every accepted job: its client saw exactly one final event, event ids 1, 2, 3...
with no gap and no duplicate, token indices with no token duplicated or missing (across
``restarted``: indices start again at 0; across ``migrated``: they go on from ``kept_tokens``,
which must be the tokens the client held), the ``done`` text equal to the streamed texts, the
stored result (``GET /v1/jobs/{id}``) equal to it; the job was not lost (it ended) and not
dead-lettered; and its text equals the reference run's for the same request (greedy and seeded
requests are deterministic). Redis is checked at the end too: no entry pending, no dead letter,
and every job's stored event stream replayed through the same checker.

    # the benchmark (benchmarks/results/serving/chaos.md, run C)
    python -m tidegate.benchmarks.serving.chaos --jobs 500 --workers 3 --concurrency 48 --max-tokens 150 1000 \\
        --worker-kills 24 --redis-restarts 4 --gateway-restarts 3 --chaos-s 240 \\
        --visibility-timeout-s 8 --out benchmarks/results/serving/chaos.json
    # a short run (tests/e2e/test_chaos.py runs one like it)
    python -m tidegate.benchmarks.serving.chaos --jobs 40 --workers 3 --concurrency 24 --max-tokens 80 400 \\
        --worker-kills 4 --redis-restarts 2 --gateway-restarts 1 --chaos-s 20 \\
        --visibility-timeout-s 8

With the default visibility timeout here, 4 s, a Redis outage of under 2 s can hand a live
worker's job to a second worker (chaos.md, run B).

Exit status 0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import redis  # noqa: E402

from tidegate import keys  # noqa: E402
from tidegate.benchmarks.harness.load.patient_client import GaveUp, PatientClient  # noqa: E402
from tidegate.benchmarks.harness.load.stream_check import StreamCheck  # noqa: E402
from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.benchmarks.harness.run.chaos_monkey import ChaosMonkey, ChaosPlan  # noqa: E402
from tidegate.benchmarks.harness.run.chaos_stack import ChaosStack  # noqa: E402
from tidegate.benchmarks.harness.run.stack import StackConfig  # noqa: E402
from tidegate.events.event_log import EVENT_FIELD  # noqa: E402

WORDS = ("tide", "gate", "river", "stone", "lamp", "owl", "cedar", "north", "salt", "copper")


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    plan: ChaosPlan
    jobs: int = 500  # at least this many accepted; more if the plan is not done by then
    concurrency: int = 48  # jobs submitted and followed at a time
    max_tokens: tuple[int, int] = (150, 1200)
    sse_every: int = 4  # every n-th job is followed over SSE, the rest over the WebSocket
    workers: int = 2
    max_num_seqs: int = 16
    model: str = "random:tiny"
    visibility_timeout_s: float = 4.0  # how long a dead worker's jobs wait to be reclaimed
    max_deliveries: int = 3  # the service's default
    patience_s: float = 300.0  # a client gives up on a job after this long
    seed: int = 0
    startup_timeout_s: float = 300.0


@dataclass(slots=True)
class JobOutcome:
    """One job as its client saw it, and what the API stored for it."""

    index: int
    via: str  # ws | sse
    sampled: bool  # temperature > 0 (with a seed) rather than greedy
    job_id: str | None = None
    submits: int = 0
    reconnects: int = 0
    final: str | None = None  # the final event's type
    code: str | None = None  # an error's code or a rejection's reason
    finish_reason: str | None = None
    text: str | None = None
    tokens: int = 0
    restarts: int = 0
    migrations: int = 0
    kept: list[int] = field(default_factory=list)  # kept_tokens of each migration
    duplicate_tokens: int = 0
    missing_tokens: int = 0
    duplicate_events: int = 0
    missing_events: int = 0
    stalls: int = 0
    stalled_at: list[float] = field(default_factory=list)  # time.monotonic()
    problems: list[str] = field(default_factory=list)  # protocol breaches, stored != streamed
    gave_up: str | None = None  # the client's patience ran out (submit, follow or result)


def job_body(cfg: ChaosConfig, i: int) -> dict:
    """Request ``i``: the same for the chaos run and the reference run."""
    rng = random.Random(cfg.seed * 1_000_003 + i)
    body: dict = {"prompt": f"job {i}: " + " ".join(rng.choice(WORDS)
                                                   for _ in range(rng.randint(3, 30))),
                  "max_tokens": rng.randint(*cfg.max_tokens), "ignore_eos": True,
                  "timeout_s": cfg.patience_s * 2}
    if i % 2:  # seeded sampling: the same seed gives the same tokens whatever is batched
        body.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(2**32),
                    top_k=rng.choice([0, 40]), top_p=rng.choice([1.0, 0.9]))
    return body


async def run_job(client: PatientClient, cfg: ChaosConfig, i: int, key: str,
                  in_flight: dict[int, StreamCheck]) -> JobOutcome:
    """Submit request ``i``, follow it to its end, read its stored result (its check sits in
    ``in_flight`` meanwhile, for the progress lines)."""
    via = "sse" if cfg.sse_every and i % cfg.sse_every == cfg.sse_every - 1 else "ws"
    out = JobOutcome(index=i, via=via, sampled=bool(i % 2))
    try:
        job = await client.submit(job_body(cfg, i), key)
    except GaveUp as exc:
        out.gave_up = str(exc)
        return out
    out.job_id, out.submits = job.job_id, job.submits
    check = StreamCheck(job.job_id)
    in_flight[i] = check
    try:
        follow = client.follow_sse if via == "sse" else client.follow_ws
        out.reconnects = await follow(job, check)
        check.finish()
        stored = await client.result(job.job_id)
    except GaveUp as exc:
        out.gave_up = str(exc)
        check.finish()
        stored = None
    in_flight.pop(i, None)
    _record(out, check, stored)
    return out


def _record(out: JobOutcome, check: StreamCheck, stored: dict | None) -> None:
    final = check.final or {}
    out.final, out.code = final.get("type"), final.get("code") or final.get("reason")
    out.finish_reason, out.text = final.get("finish_reason"), final.get("text")
    out.tokens = check.tokens
    out.restarts, out.migrations, out.kept = check.restarts, check.migrations, list(check.kept)
    out.duplicate_tokens, out.missing_tokens = check.duplicate_tokens, check.missing_tokens
    out.duplicate_events, out.missing_events = check.duplicate_events, check.missing_events
    out.stalls, out.stalled_at = check.stalls, list(check.stalled_at)
    out.problems = list(check.problems)
    if stored is None or not check.done:
        return
    if stored["status"] != out.final:  # the statuses of final jobs are their events' types
        out.problems.append(f"stored status {stored['status']}, final event {out.final}")
    if out.final == "done" and stored.get("text") != out.text:
        out.problems.append("stored text differs from the done event's")


async def run_load(client: PatientClient, cfg: ChaosConfig, prefix: str,
                   more: asyncio.Event | None = None, count: int | None = None
                   ) -> list[JobOutcome]:
    """Jobs 0, 1, 2... ``cfg.concurrency`` at a time: ``count`` of them, or at least
    ``cfg.jobs`` and on while ``more`` is set."""
    sem = asyncio.Semaphore(cfg.concurrency)
    tasks: list[asyncio.Task[JobOutcome]] = []
    in_flight: dict[int, StreamCheck] = {}

    async def one(i: int) -> JobOutcome:
        try:
            return await run_job(client, cfg, i, f"{prefix}-{i}", in_flight)
        finally:
            sem.release()

    async def progress() -> None:
        t0 = time.monotonic()
        while True:
            await asyncio.sleep(10)
            oldest = sorted(in_flight.items())[:3]
            print(f"[{prefix} {time.monotonic() - t0:5.0f} s] submitted {len(tasks)}, "
                  f"finished {sum(t.done() for t in tasks)}, in flight {len(in_flight)}; "
                  f"oldest (index, job, last event): "
                  f"{[(i, c.job_id, c.last_id) for i, c in oldest]}",
                  file=sys.stderr, flush=True)

    reporter = asyncio.create_task(progress())
    i = 0
    while (i < count) if count is not None else (i < cfg.jobs or (more and more.is_set())):
        await sem.acquire()
        tasks.append(asyncio.create_task(one(i)))
        i += 1
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        reporter.cancel()


def stack_config(cfg: ChaosConfig) -> StackConfig:
    extra = {"TIDEGATE_VISIBILITY_TIMEOUT_S": str(cfg.visibility_timeout_s),
             "TIDEGATE_MAX_DELIVERIES": str(cfg.max_deliveries),
             "TIDEGATE_DRAIN_TIMEOUT_S": "2", "TIDEGATE_MAX_BACKLOG": "100000"}
    return StackConfig(model=cfg.model, device="cpu", dtype="auto",
                       max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=512,
                       kv_cache_gb=0.25, workers=cfg.workers, torch_threads=1,
                       cuda_graphs=False, aof=True, redis_server="redis-server", api_key=None,
                       default_timeout_s=cfg.patience_s * 2,
                       startup_timeout_s=cfg.startup_timeout_s, extra_env=extra)


async def run_chaos(cfg: ChaosConfig, logdir: Path) -> dict:
    """The whole benchmark on a fresh stack; returns its report (``summarize``)."""
    logdir.mkdir(parents=True, exist_ok=True)
    stack = ChaosStack(stack_config(cfg), logdir)
    t0 = time.monotonic()
    try:
        await asyncio.to_thread(stack.start_front)
        await asyncio.to_thread(stack.start_workers)
        client = PatientClient(f"http://127.0.0.1:{stack.api_port}",
                               f"ws://127.0.0.1:{stack.gateway_port}", patience_s=cfg.patience_s)
        try:
            started = time.monotonic()
            monkey = ChaosMonkey(stack, cfg.plan)
            stop, plan_left = asyncio.Event(), asyncio.Event()
            plan_left.set()

            async def chaos() -> None:
                await monkey.carry_out(stop)
                plan_left.clear()
                await monkey.keep_up(stop)

            chaos_task = asyncio.create_task(chaos())
            outcomes = await run_load(client, cfg, "chaos", more=plan_left)
            stop.set()
            await chaos_task
            chaos_s = time.monotonic() - started
            answers = dict(client.answers)
            client.answers.clear()
            started = time.monotonic()
            reference = await run_load(client, cfg, "reference", count=len(outcomes))
            reference_s = time.monotonic() - started
            reference_answers = dict(client.answers)
        finally:
            await client.close()
        server = await asyncio.to_thread(server_side, stack, outcomes + reference)
    finally:
        await asyncio.to_thread(stack.close)
    report = summarize(cfg, outcomes, reference, monkey, server)
    report.update(chaos_s=round(chaos_s, 1), reference_s=round(reference_s, 1),
                  total_s=round(time.monotonic() - t0, 1), answers=answers,
                  reference_answers=reference_answers,
                  # a 5xx other than an outage's 503 is a bug whatever the chaos
                  server_errors={f"{run} {k}": n
                                 for run, got in (("chaos", answers),
                                                  ("reference", reference_answers))
                                 for k, n in got.items()
                                 if k.split()[-1].startswith("5") and not k.endswith("503")},
                  unexpected_exits=stack.exits, logs=log_findings(logdir))
    (logdir / "report.json").write_text(json.dumps(report, indent=1))
    return report


def server_side(stack: ChaosStack, outcomes: list[JobOutcome]) -> dict:
    """What Redis holds at the end: lane entries still pending, dead letters, and each job's
    stored event stream as a client replaying it now would see it (its live client stopped
    at the first final event; a second one, or anything after it, shows only here)."""
    r = redis.Redis(port=stack.redis_port, decode_responses=True)
    try:
        pending = sum(r.xpending(stream, keys.CONSUMER_GROUP)["pending"]
                      for stream in r.scan_iter(match=keys.LANE_STREAM_PATTERN))
        dead = sum(r.xlen(keys.dead_letter_stream(lane)) for lane in keys.LANES)
        replays = {}
        for o in outcomes:
            if o.job_id is None:
                continue
            check = StreamCheck(o.job_id)
            for _, fields in r.xrange(keys.job_events(o.job_id)):
                check.on_raw(fields[EVENT_FIELD])
            check.finish()
            if check.problems:
                replays[o.job_id] = check.problems
    finally:
        r.close()
    return {"pending_entries": pending, "dead_letters_stored": dead,
            "stored_stream_problems": replays}


def log_findings(logdir: Path) -> dict[str, int]:
    """Tracebacks per process log (a SIGKILLed process leaves none; a crash does)."""
    found = {}
    for path in sorted(logdir.glob("*.log")):
        n = len(re.findall(r"^Traceback", path.read_text(errors="replace"), re.M))
        if n:
            found[path.stem] = n
    return found


def mismatch(got: JobOutcome, ref: JobOutcome) -> dict:
    """How a job's result differs from the reference run's."""
    a, b = got.text or "", ref.text or ""
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
    return {"index": got.index, "job_id": got.job_id, "sampled": got.sampled,
            "tokens": got.tokens, "reference_tokens": ref.tokens, "chars": len(a),
            "first_differing_char": first, "restarts": got.restarts,
            "migrations": got.migrations, "finish_reason": got.finish_reason,
            "reference_finish_reason": ref.finish_reason}


def quantiles(values: list[int]) -> dict[str, int]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = {"min": 0.0, "p50": 0.5, "p90": 0.9, "max": 1.0}
    return {name: ordered[round(q * (len(ordered) - 1))] for name, q in pick.items()}


def summarize(cfg: ChaosConfig, outcomes: list[JobOutcome], reference: list[JobOutcome],
              monkey: ChaosMonkey, server: dict) -> dict:
    log = monkey.log
    accepted = [o for o in outcomes if o.job_id is not None]
    ended = [o for o in accepted if o.final is not None]
    finals = Counter(o.final if o.final != "error" else f"error:{o.code}" for o in ended)
    mismatches = [mismatch(o, ref) for o, ref in zip(outcomes, reference, strict=True)
                  if o.final == "done" and ref.final == "done"
                  and (o.text != ref.text or o.tokens != ref.tokens)]
    broken = {o.index: o.problems for o in outcomes if o.problems}
    broken_reference = {o.index: o.problems or [f"final {o.final}"] for o in reference
                        if o.problems or o.final != "done"}
    return {
        "config": {**asdict(cfg), "plan": asdict(cfg.plan)},
        "jobs_submitted": len(outcomes),
        "accepted": len(accepted),
        "not_accepted": [o.index for o in outcomes if o.job_id is None],
        "lost": [o.index for o in accepted if o.final is None or o.gave_up],
        "finals": dict(finals),
        "dead_lettered": finals.get("error:dead_lettered", 0),
        "not_done": [o.index for o in ended if o.final != "done"],
        "worker_kills": log.worker_kills,
        "redis_restarts": log.redis_restarts,
        "gateway_restarts": log.gateway_restarts,
        "worker_pauses": log.worker_pauses,
        "redis_outages_s": log.outages_s,
        "replaced": log.replaced,
        "jobs_migrated": sum(1 for o in accepted if o.migrations),
        "jobs_restarted": sum(1 for o in accepted if o.restarts),
        "migrated_events": sum(o.migrations for o in accepted),
        "restarted_events": sum(o.restarts for o in accepted),
        "migrated_greedy_jobs": sum(1 for o in accepted if o.migrations and not o.sampled),
        "migrated_seeded_jobs": sum(1 for o in accepted if o.migrations and o.sampled),
        "jobs_migrated_twice_or_more": sum(1 for o in accepted if o.migrations > 1),
        "most_migrations_of_a_job": max((o.migrations for o in accepted), default=0),
        # generated tokens kept across each migration: how far into its run a job was
        "kept_tokens": quantiles([k for o in accepted for k in o.kept]),
        "reconnects": sum(o.reconnects for o in accepted),
        "submit_retries": sum(o.submits - 1 for o in accepted),
        "duplicate_tokens": sum(o.duplicate_tokens for o in accepted),
        "missing_tokens": sum(o.missing_tokens for o in accepted),
        "duplicate_events": sum(o.duplicate_events for o in accepted),
        "missing_events": sum(o.missing_events for o in accepted),
        "stalls": sum(o.stalls for o in accepted),
        # (seconds after the chaos began, job index, via): to set beside the timeline
        "stalled": [(round(at - monkey.t0, 1), o.index, o.via) for o in accepted
                    for at in o.stalled_at],
        "stream_problems": broken,
        "reference_mismatches": mismatches,
        "reference_problems": broken_reference,
        "tokens_streamed": sum(o.tokens for o in accepted),
        "server": server,
        "timeline": log.timeline,
        "outcomes": [asdict(o) | {"text": None} for o in outcomes],
    }


def passed(report: dict) -> bool:
    """Every check held (what the exit status and the tests go by)."""
    return not (report["not_accepted"] or report["lost"] or report["not_done"]
                or report["stream_problems"] or report["reference_mismatches"]
                or report["reference_problems"] or report["duplicate_tokens"]
                or report["missing_tokens"] or report["dead_lettered"]
                or report["server"]["pending_entries"] or report["server"]["dead_letters_stored"]
                or report["server"]["stored_stream_problems"]
                or report["server_errors"])


def headline(report: dict) -> str:
    r = report
    return "\n".join([
        f"jobs {r['accepted']} accepted of {r['jobs_submitted']}; finals {r['finals']}",
        f"chaos: {r['worker_kills']} worker kills, {r['redis_restarts']} Redis restarts "
        f"(outages {r['redis_outages_s']} s), {r['gateway_restarts']} gateway restarts, "
        f"{r['worker_pauses']} worker pauses; "
        f"replaced after exiting by themselves: {r['replaced'] or 'none'}",
        f"jobs migrated {r['jobs_migrated']} ({r['migrated_greedy_jobs']} greedy, "
        f"{r['jobs_migrated_twice_or_more']} twice or more, kept tokens {r['kept_tokens']}), "
        f"restarted {r['jobs_restarted']}; reconnects {r['reconnects']}, "
        f"submit retries {r['submit_retries']}",
        f"lost {len(r['lost'])}, not accepted {len(r['not_accepted'])}, "
        f"dead-lettered {r['dead_lettered']}, duplicate/missing tokens "
        f"{r['duplicate_tokens']}/{r['missing_tokens']}, duplicate/missing events "
        f"{r['duplicate_events']}/{r['missing_events']}, stalled streams {r['stalls']}, "
        f"jobs with stream problems "
        f"{len(r['stream_problems'])}, reference mismatches {len(r['reference_mismatches'])}",
        *([f"mismatches: {r['reference_mismatches'][:5]}"] if r["reference_mismatches"] else []),
        f"server: {r['server']}; tracebacks in logs: {r['logs'] or 'none'}; answers other than "
        f"2xx: {r['answers'] or 'none'}",
        f"time: chaos {r['chaos_s']} s, reference {r['reference_s']} s, total {r['total_s']} s",
        f"{'PASS' if passed(r) else 'FAIL'}",
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ChaosConfig(plan=ChaosPlan(0, 0, 0, 0))
    ap.add_argument("--jobs", type=int, default=d.jobs)
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--max-tokens", type=int, nargs=2, default=d.max_tokens,
                    metavar=("LO", "HI"))
    ap.add_argument("--sse-every", type=int, default=d.sse_every)
    ap.add_argument("--workers", type=int, default=d.workers)
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--visibility-timeout-s", type=float, default=d.visibility_timeout_s)
    ap.add_argument("--max-deliveries", type=int, default=d.max_deliveries)
    ap.add_argument("--patience-s", type=float, default=d.patience_s)
    ap.add_argument("--chaos-s", type=float, default=420, help="the plan is spread over this")
    ap.add_argument("--worker-kills", type=int, default=24)
    ap.add_argument("--redis-restarts", type=int, default=3)
    ap.add_argument("--gateway-restarts", type=int, default=3)
    ap.add_argument("--worker-pauses", type=int, default=0,
                    help="SIGSTOP a worker for --pause-s, then SIGCONT (0: none)")
    ap.add_argument("--pause-s", type=float, default=0.0,
                    help="default: twice the visibility timeout")
    ap.add_argument("--outage-s", type=float, nargs=2, default=(0.5, 1.5), metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="the report as JSON, without per-job outcomes")
    ap.add_argument("--logdir", type=Path, help="process logs (default: a temporary directory)")
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> ChaosConfig:
    plan = ChaosPlan(duration_s=args.chaos_s, worker_kills=args.worker_kills,
                     redis_restarts=args.redis_restarts, gateway_restarts=args.gateway_restarts,
                     worker_pauses=args.worker_pauses,
                     pause_s=args.pause_s or 2 * args.visibility_timeout_s,
                     outage_s=tuple(args.outage_s), min_ready_workers=min(2, args.workers),
                     seed=args.seed)
    return ChaosConfig(plan=plan, jobs=args.jobs, concurrency=args.concurrency,
                       max_tokens=tuple(args.max_tokens), sse_every=args.sse_every,
                       workers=args.workers, max_num_seqs=args.max_num_seqs, model=args.model,
                       visibility_timeout_s=args.visibility_timeout_s,
                       max_deliveries=args.max_deliveries, patience_s=args.patience_s,
                       seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from(args)
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="tidegate-chaos-"))
    report = asyncio.run(run_chaos(cfg, logdir))
    report["record"] = record.record(argv, __spec__.name)
    report["command"] = report["record"]["command"]
    report["machine"] = f"{platform.node()} {platform.machine()}, {_cores()} cores"
    if args.out:  # the figures; every job's outcome stays in the log directory's report.json
        args.out.write_text(json.dumps({k: v for k, v in report.items() if k != "outcomes"},
                                       indent=1) + "\n")
    print(headline(report))
    print(f"logs: {logdir}")
    return 0 if passed(report) else 1


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
