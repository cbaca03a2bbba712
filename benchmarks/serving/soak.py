"""Soak: the whole stack as processes at several times the worker's capacity, memory sampled.

Starts redis-server, ``tidegate api``, ``tidegate gateway`` and one worker (``benchmarks/harness/
stack.py``), then submits jobs over HTTP at ``--rate`` per second for ``--duration-s``: most
with a short deadline (so the overloaded worker sheds them: ``rejected``), ``--cancel-fraction``
cancelled right after their 202, ``--idempotent-fraction`` with an Idempotency-Key, and
``--follow-fraction`` followed over WebSocket to their final event. Every ``--sample-s`` it
records Redis ``used_memory`` (INFO memory), the key count, the lane streams' length and each
process's RSS. At the end it measures every key's ``MEMORY USAGE`` by kind and final status
(``tidegate.benchmarks.harness.run.footprint``) and fits a line to each memory series after ``--warmup-s``:
flat memory has a slope near zero next to its level.

Retention is short here (``--result-ttl-s`` and the rest, passed as ``TIDEGATE_*_TTL_S``) so
the level is reached within the run: in the steady state Redis holds about
``sum over final statuses of rate x retention x bytes per job`` above its empty size.

    python -m tidegate.benchmarks.serving.soak --duration-s 600 --out benchmarks/results/serving/soak.json \\
        --plot benchmarks/results/serving/soak.png
    python -m tidegate.benchmarks.serving.soak --duration-s 20 --sample-s 1   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import redis  # noqa: E402

from tidegate import keys  # noqa: E402
from tidegate.benchmarks.harness.load.follow import Trace, follow_ws  # noqa: E402
from tidegate.benchmarks.harness.load.http import HttpError, Pool  # noqa: E402
from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.benchmarks.harness.run import footprint  # noqa: E402
from tidegate.benchmarks.harness.run.stack import Stack, StackConfig  # noqa: E402

WORDS = ("tide", "gate", "harbor", "swell", "current", "ebb", "flow", "moon", "shore", "reef")


@dataclass(slots=True)
class Tally:
    offered: int = 0
    skipped: int = 0  # the generator's in-flight bound was full: never sent
    answers: dict[str, int] = field(default_factory=dict)  # HTTP status -> count
    cancels: dict[str, int] = field(default_factory=dict)
    followed: int = 0
    follow_problems: int = 0
    errors: list[str] = field(default_factory=list)

    def note(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def sample(stack: Stack, client: redis.Redis, t0: float) -> dict:
    info = client.info("memory")
    streams = [(keys.parse_lane_stream(s), s) for s in client.scan_iter(
        match=keys.LANE_STREAM_PATTERN)]
    lanes = {lane: sum(client.xlen(s) for parsed, s in streams if parsed and parsed[1] == lane)
             for lane in keys.LANES}  # every model's
    rss = {name: rss_bytes(p.pid) for name, p in stack.procs.items() if p.poll() is None}
    return {"t_s": round(time.monotonic() - t0, 2), "used_memory": int(info["used_memory"]),
            "used_memory_rss": int(info["used_memory_rss"]), "dbsize": int(client.dbsize()),
            "lane_len": lanes, "rss": rss}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (units per second)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def body(args: argparse.Namespace, rng: random.Random) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
    job = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True,
           "timeout_s": args.job_timeout_s}
    if rng.random() < args.idempotent_fraction:
        job["idempotency_key"] = uuid.uuid4().hex
    return job


async def one_job(args: argparse.Namespace, api: Pool, stack: Stack, rng: random.Random,
                  tally: Tally) -> None:
    try:
        answer = await api.request("POST", "/v1/jobs", json.dumps(body(args, rng)).encode())
    except (HttpError, OSError) as exc:
        tally.note(tally.answers, "no answer")
        if len(tally.errors) < 5:
            tally.errors.append(repr(exc))
        return
    tally.note(tally.answers, str(answer.status))
    if answer.status != 202:
        return
    created = answer.json()
    if rng.random() < args.cancel_fraction:
        cancel = await api.request("POST", f"/v1/jobs/{created['id']}/cancel")
        tally.note(tally.cancels, str(cancel.json().get("status", cancel.status)))
    elif rng.random() < args.follow_fraction:
        trace = Trace()
        await follow_ws(created["stream_url"], created["stream_token"], trace)
        tally.followed += 1
        tally.follow_problems += bool(trace.problems)


async def load(args: argparse.Namespace, stack: Stack, tally: Tally,
               samples: list[dict]) -> None:
    api = Pool("127.0.0.1", stack.api_port, size=64)
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    rng = random.Random(args.seed)
    inflight: set[asyncio.Task] = set()
    t0 = time.monotonic()
    next_sample = t0
    interval = 1 / args.rate
    n = 0
    try:
        while (now := time.monotonic()) - t0 < args.duration_s:
            if now >= next_sample:
                samples.append(await asyncio.to_thread(sample, stack, client, t0))
                stack.check_alive()
                next_sample += args.sample_s
            due = t0 + n * interval
            if due > now:
                await asyncio.sleep(min(due - now, max(0.0, next_sample - now)))
                continue
            n += 1
            tally.offered += 1
            if len(inflight) >= args.max_inflight:
                tally.skipped += 1
                continue
            task = asyncio.create_task(one_job(args, api, stack, rng, tally))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        if inflight:
            await asyncio.wait(inflight, timeout=60)
        samples.append(await asyncio.to_thread(sample, stack, client, t0))
    finally:
        api.close()
        client.close()


def summarize(args: argparse.Namespace, samples: list[dict], tally: Tally,
              counters: dict[str, float], foot: dict, wall_s: float) -> dict:
    # After warm-up, while the load ran (the last sample is taken after the stragglers).
    late = [s for s in samples if args.warmup_s <= s["t_s"] <= args.duration_s]
    series = {"redis_used_memory": [(s["t_s"], s["used_memory"]) for s in late]}
    for name in samples[0]["rss"]:
        series[f"rss_{name}"] = [(s["t_s"], s["rss"].get(name, 0)) for s in late]
    flat = {}
    for name, points in series.items():
        level = sum(y for _, y in points) / len(points) if points else 0
        per_min = slope(points) * 60
        flat[name] = {"mean_bytes": round(level), "slope_bytes_per_min": round(per_min),
                      "slope_pct_of_mean_per_10min": round(100 * per_min * 10 / level, 2)
                      if level else 0.0,
                      "min_bytes": min((y for _, y in points), default=0),
                      "max_bytes": max((y for _, y in points), default=0)}
    finished = {k.removeprefix("requests_finished_"): v for k, v in counters.items()}
    done = finished.get("completed", 0)
    return {**record.record(), "config": vars(args),
            "wall_s": round(wall_s, 1), "offered": tally.offered, "skipped": tally.skipped,
            "offered_per_s": round(tally.offered / args.duration_s, 1),
            "answers": tally.answers, "cancels": tally.cancels, "followed": tally.followed,
            "follow_problems": tally.follow_problems, "errors": tally.errors,
            "worker_finished": finished,
            "worker_completed_per_s": round(done / args.duration_s, 2),
            "overload": round(tally.offered / done, 1) if done else None,
            "after_warmup": flat, "footprint": foot, "samples": samples}


def finished_counts(port: int) -> dict[str, float]:
    """The worker's ``tidegate_requests_finished_total`` by reason (from its /metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("tidegate_requests_finished_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[f"requests_finished_{reason}"] = float(line.rsplit(" ", 1)[1])
    return found


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t_s"] / 60 for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    top.plot(t, [s["used_memory"] / 2**20 for s in samples], label="Redis used_memory")
    top.plot(t, [s["rss"].get("redis", 0) / 2**20 for s in samples], label="redis-server RSS")
    top.set_ylabel("MiB")
    top.axvline(result["config"]["warmup_s"] / 60, color="grey", linestyle=":")
    top.legend()
    top.set_title(f"soak: {result['offered_per_s']} submits/s offered, "
                  f"{result['worker_completed_per_s']} jobs/s completed "
                  f"({result['overload']}x); retention done "
                  f"{result['config']['result_ttl_s']} s, rejected/cancelled "
                  f"{result['config']['rejected_ttl_s']} s", fontsize=9)
    for name in samples[0]["rss"]:
        if name != "redis":
            bottom.plot(t, [s["rss"].get(name, 0) / 2**20 for s in samples], label=f"{name} RSS")
    bottom.axvline(result["config"]["warmup_s"] / 60, color="grey", linestyle=":")
    bottom.set_ylabel("MiB")
    bottom.set_xlabel("minutes")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600)
    p.add_argument("--warmup-s", type=float, default=None,
                   help="slopes are fitted after this (default: 2 x the longest retention)")
    p.add_argument("--rate", type=float, default=80, help="submits per second offered")
    p.add_argument("--sample-s", type=float, default=5)
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--job-timeout-s", type=float, default=3.0, help="each job's deadline")
    p.add_argument("--cancel-fraction", type=float, default=0.05)
    p.add_argument("--idempotent-fraction", type=float, default=0.2)
    p.add_argument("--follow-fraction", type=float, default=0.05)
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--result-ttl-s", type=int, default=60)
    p.add_argument("--error-ttl-s", type=int, default=30)
    p.add_argument("--rejected-ttl-s", type=int, default=15)
    p.add_argument("--cancelled-ttl-s", type=int, default=15)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="")
    p.add_argument("--logdir", default="")
    args = p.parse_args(argv)
    if args.warmup_s is None:
        args.warmup_s = min(args.duration_s / 2, 2 * max(
            args.result_ttl_s, args.error_ttl_s, args.rejected_ttl_s, args.cancelled_ttl_s))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    ttl_env = {"TIDEGATE_RESULT_TTL_S": str(args.result_ttl_s),
               "TIDEGATE_ERROR_TTL_S": str(args.error_ttl_s),
               "TIDEGATE_REJECTED_TTL_S": str(args.rejected_ttl_s),
               "TIDEGATE_CANCELLED_TTL_S": str(args.cancelled_ttl_s),
               "TIDEGATE_IDEMPOTENCY_TTL_S": str(args.result_ttl_s)}
    cfg = StackConfig(model=args.model, device="cpu", dtype="float32",
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512,
                      kv_cache_gb=0.25, workers=1, torch_threads=args.torch_threads,
                      cuda_graphs=False, aof=False, redis_server="redis-server", api_key=None,
                      default_timeout_s=args.job_timeout_s, startup_timeout_s=300,
                      extra_env=ttl_env)
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="tidegate-soak-"))
    logdir.mkdir(parents=True, exist_ok=True)
    tally, samples = Tally(), []
    with Stack(cfg, logdir) as stack:
        stack.start_front()
        stack.start_workers()
        port = stack.status_ports["worker0"]
        before = finished_counts(port)
        t0 = time.monotonic()
        asyncio.run(load(args, stack, tally, samples))
        wall = time.monotonic() - t0
        after = finished_counts(port)
        counters = {k: after[k] - before.get(k, 0) for k in after}
        foot = footprint.measure(redis.Redis.from_url(stack.redis_url, decode_responses=True))
    result = summarize(args, samples, tally, counters, foot, wall)
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "config")},
                     indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, Path(args.plot))
    return result


if __name__ == "__main__":
    main()
