"""Goodput under overload: load shedding against plain FIFO, one real worker, one real Redis.

A `tidegate worker` process (default model) serves jobs enqueued straight into Redis by an
open-loop Poisson arrival process at 0.5x, 1x, 2x and 4x the worker's measured capacity. Every
job has the same size and deadline. Goodput = jobs that finished within their deadline per
second of arrivals. "FIFO" is the same worker with load shedding off: it still never starts an
expired job and stops a running one at its deadline, but admits whatever arrives while seats
are free. Reported per rate and mode: goodput, share admitted, rejection latency (submit ->
rejected event) p50/p99, TTFT p99 of the jobs that finished in time.

Usage:  python -m tidegate.benchmarks.serving.goodput [--seconds 25] [--deadline-s 6] [--max-tokens 32]
                                     [--modes shedding fifo] [--capacity JOBS_PER_S]
                                     [--out benchmarks/results/serving/goodput.json] [--plot PNG]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.benchmarks.harness.measure import record
from tidegate.benchmarks.harness.run.processes import safe_env, stop_processes
from tidegate.benchmarks.harness.run.redis_server import RedisServer
from tidegate.jobstore import enqueue, read_result
from tidegate.model_files.model_source import DEFAULT_MODEL
from tidegate.model_files.served_model import default_name
from tidegate.protocol import JobRequest, JobResult

SERVED = default_name(DEFAULT_MODEL)  # the worker's default model, by its served name


@dataclass(frozen=True, slots=True)
class Outcome:
    submitted_ms: int
    deadline_ms: int
    result: JobResult
    final_event_ms: int  # when the job's last event was stored (stream entry time)

    @property
    def in_time(self) -> bool:
        r = self.result
        return (r.status == "done" and r.finish_reason == "length" and r.timings is not None
                and r.timings.total_ms <= self.deadline_ms - self.submitted_ms)


def pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


class Stack:
    """redis-server + one worker process, started for one mode."""

    def __init__(self, shedding: bool, max_num_seqs: int) -> None:
        self.redis = RedisServer()
        env = safe_env(TIDEGATE_REDIS_URL=self.url, TIDEGATE_LOAD_SHEDDING=str(shedding).lower(),
                       TIDEGATE_MAX_NUM_SEQS=str(max_num_seqs), TIDEGATE_LOG_LEVEL="WARNING",
                       TIDEGATE_KV_CACHE_GB="0.5")
        self.worker = subprocess.Popen([sys.executable, "-m", "tidegate", "worker"], env=env,
                                       stdout=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return self.redis.url

    async def ready(self, r: aioredis.Redis) -> None:
        while True:
            assert self.worker.poll() is None, "worker died"
            try:
                if [k async for k in r.scan_iter(match=keys.worker_heartbeat("*"))]:
                    return
            except aioredis.ConnectionError:
                pass  # Redis busy: try again
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        stop_processes([self.worker], timeout_s=30)
        self.redis.stop()


async def final(r: aioredis.Redis, job_id: str) -> tuple[JobResult, int]:
    while True:
        res = await read_result(r, job_id)
        if res is not None and res.status in ("done", "rejected", "error"):
            newest = await r.xrevrange(keys.job_events(job_id), count=1)
            return res, int(newest[0][0].split("-")[0])
        await asyncio.sleep(0.1)


async def offer(r: aioredis.Redis, rate: float, seconds: float, args: argparse.Namespace,
                seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    jobs: list[tuple[str, int, int]] = []
    start = time.monotonic()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            break
        await asyncio.sleep(max(0.0, start + t - time.monotonic()))
        job = JobRequest(prompt=f"request {len(jobs)}: describe the sea in detail",
                         max_tokens=args.max_tokens, ignore_eos=True,
                         timeout_s=args.deadline_s).to_job(model=SERVED,
                                                           default_timeout_s=args.deadline_s)
        await enqueue(r, job)
        jobs.append((job.id, job.created_ms, job.deadline_ms))
    finals = await asyncio.gather(*(final(r, job_id) for job_id, _, _ in jobs))
    return [Outcome(created, deadline, res, at)
            for (_, created, deadline), (res, at) in zip(jobs, finals, strict=True)]


async def capacity(r: aioredis.Redis, args: argparse.Namespace) -> float:
    """Jobs per second one worker completes with a full batch and no deadline pressure."""
    n = args.max_num_seqs * 2
    ids = []
    for i in range(n):
        job = JobRequest(prompt=f"warm {i}: describe the sea in detail", max_tokens=args.max_tokens,
                         ignore_eos=True, timeout_s=600).to_job(model=SERVED, default_timeout_s=600)
        await enqueue(r, job)
        ids.append(job.id)
    t0 = time.monotonic()
    await asyncio.gather(*(final(r, i) for i in ids))
    return n / (time.monotonic() - t0)


def summarize(outcomes: list[Outcome], seconds: float) -> dict[str, float | int | None]:
    in_time = [o for o in outcomes if o.in_time]
    rejected = [o for o in outcomes if o.result.status == "rejected"]
    late = [o for o in outcomes if o.result.status == "done" and not o.in_time]
    return {
        "offered": len(outcomes),
        "goodput_jobs_s": round(len(in_time) / seconds, 3),
        "in_time": len(in_time), "late_or_cut": len(late), "rejected": len(rejected),
        "admitted_share": round(1 - len(rejected) / len(outcomes), 3) if outcomes else None,
        "reject_latency_p50_ms": pct([o.final_event_ms - o.submitted_ms for o in rejected], 50),
        "reject_latency_p99_ms": pct([o.final_event_ms - o.submitted_ms for o in rejected], 99),
        "ttft_p99_ms": pct([o.result.timings.ttft_ms for o in in_time if o.result.timings], 99),
    }


async def run_mode(shedding: bool, cap: float | None, args: argparse.Namespace
                   ) -> tuple[float, dict[str, dict]]:
    stack = Stack(shedding, args.max_num_seqs)
    r = aioredis.Redis.from_url(stack.url, decode_responses=True)
    try:
        await stack.ready(r)
        cap = cap or await capacity(r, args)
        rows = {}
        for mult in args.multipliers:
            outcomes = await offer(r, mult * cap, args.seconds, args, seed=int(mult * 100))
            rows[f"{mult}x"] = summarize(outcomes, args.seconds)
            print(("shedding" if shedding else "fifo"), f"{mult}x", json.dumps(rows[f"{mult}x"]),
                  flush=True)
        return cap, rows
    finally:
        await r.aclose()
        stack.stop()


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mults = results["multipliers"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("shedding", "o-"), ("fifo", "s--")):
        rows = results[mode]
        axes[0].plot(mults, [rows[f"{m}x"]["goodput_jobs_s"] for m in mults], style, label=mode)
        axes[1].plot(mults, [rows[f"{m}x"]["admitted_share"] for m in mults], style, label=mode)
    axes[0].set_xlabel("offered load (x measured capacity)")
    axes[0].set_ylabel("goodput (jobs finished in time / s)")
    axes[0].set_title("goodput")
    axes[1].set_xlabel("offered load (x measured capacity)")
    axes[1].set_title("share of jobs admitted")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=25.0, help="arrival window per rate")
    ap.add_argument("--deadline-s", type=float, default=6.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--multipliers", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--modes", nargs="+", default=["shedding", "fifo"],
                    choices=["shedding", "fifo"])
    ap.add_argument("--capacity", type=float,
                    help="jobs/s, skip measuring it (and merge into an existing --out)")
    ap.add_argument("--out", default="benchmarks/results/serving/goodput.json")
    ap.add_argument("--plot", default="benchmarks/results/serving/goodput.png")
    args = ap.parse_args()
    results = {**record.record(), "multipliers": args.multipliers,
               "job": {"max_tokens": args.max_tokens, "deadline_s": args.deadline_s}}
    if args.capacity is not None and os.path.exists(args.out):  # add modes to an earlier run
        with open(args.out) as f:
            results = json.load(f)
    cap = args.capacity
    for mode in args.modes:
        cap, results[mode] = await run_mode(mode == "shedding", cap, args)
    results["capacity_jobs_s"] = round(cap, 3)
    shed, fifo = results.get("shedding"), results.get("fifo")
    if not (shed and fifo):
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        return
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    base = shed["1.0x"]["goodput_jobs_s"] or 1e-9
    for m in args.multipliers:
        print(f"{m}x: shedding {shed[f'{m}x']['goodput_jobs_s']:.2f} "
              f"({shed[f'{m}x']['goodput_jobs_s'] / base:.0%} of 1x)  "
              f"fifo {fifo[f'{m}x']['goodput_jobs_s']:.2f} jobs/s")


if __name__ == "__main__":
    asyncio.run(main())
