"""Prefix-aware routing through the whole stack: redis-server, `tidegate api`, `tidegate gateway`
and N `tidegate worker` processes, routing on against routing off, side by side in one run.

The workload is the issue's: ``--prompts`` system prompts of ``--prefix-tokens`` tokens each,
``--jobs`` chats in shuffled order, each a system prompt and a short question of its own,
submitted by ``--concurrency`` clients (each submits, follows its job to the end, submits the
next). Each mode starts a fresh stack (cold caches). Reported per mode: the prefix-cache hit
rate over all workers (prompt tokens found cached / prompt tokens), each worker's share of the
jobs and how it took them (routed, shared, stolen), time to first token (created -> first
token, from the job's result), wall time; and routing's gain over off.

    python -m tidegate.benchmarks.serving.prefix_routing --model random:tiny --workers 4 \\
        --out benchmarks/results/serving/prefix_routing_tiny.json
    python -m tidegate.benchmarks.serving.prefix_routing --model smollm2 --workers 2 --kv-cache-gb 0.15 \\
        --torch-threads 1 --out benchmarks/results/serving/prefix_routing_smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis as redis_sync
from prometheus_client.parser import text_string_to_metric_families

from tidegate import keys  # noqa: E402
from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.benchmarks.harness.run.stack import Stack, StackConfig  # noqa: E402
from tidegate.model_files.model_source import resolve_model  # noqa: E402
from tidegate.model_files.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from tidegate.producer.client import Client  # noqa: E402
from tidegate.routing.prefix_hashes import prompt_block_hashes  # noqa: E402

WORDS = ("harbour bridge council river market garden engine library winter summer letter "
         "station mountain village doctor teacher kitchen window museum ocean forest signal "
         "company report budget customer ticket archive server folder command setting history "
         "sailor island weather lantern morning evening silver copper paper pencil journey").split()


def system_prompt(tokenizer: Tokenizer, index: int, tokens: int, rng: random.Random) -> str:
    """A system prompt of about ``tokens`` tokens (as rendered alone), distinct from its first
    words on."""
    words = [f"You are assistant number {index} of the {rng.choice(WORDS)} desk."]
    while len(tokenizer.encode_prompt(None, [{"role": "system", "content": " ".join(words)}])
              ) < tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def workload(tokenizer: Tokenizer, *, prompts: int, prefix_tokens: int, jobs: int,
             seed: int) -> list[dict]:
    rng = random.Random(seed)
    systems = [system_prompt(tokenizer, i, prefix_tokens, rng) for i in range(prompts)]
    bodies = []
    for j in range(jobs):
        question = f"{rng.choice(WORDS)} {j}?"
        bodies.append({"messages": [{"role": "system", "content": systems[j % prompts]},
                                    {"role": "user", "content": question}]})
    rng.shuffle(bodies)
    return bodies


def ideal_hit_rate(tokenizer: Tokenizer, bodies: list[dict], block_size: int) -> dict:
    """The hit rate if every block were computed once in all (each job finding every block an
    earlier job computed), and if each of ``n`` workers computed each prompt's blocks once."""
    seen: set[bytes] = set()
    total = hits = 0
    for body in bodies:
        ids = tokenizer.encode_prompt(None, body["messages"])
        blocks = prompt_block_hashes(ids, block_size)
        total += len(ids)
        for h in blocks:
            if h not in seen:
                break
            hits += block_size
        seen.update(blocks)
    return {"once_in_all": round(hits / total, 4), "prompt_tokens": total}


async def drive(api: str, bodies: list[dict], *, concurrency: int, max_tokens: int,
                timeout_s: float, progress: Callable[[int], None] | None = None) -> list[dict]:
    """Each body as a job, ``concurrency`` at a time; each job's result. ``progress`` is
    called with the number of jobs ended so far, after each."""
    queue = list(enumerate(bodies))
    results: list[dict] = [{} for _ in bodies]
    ended = 0

    async def client_loop(client: Client) -> None:
        nonlocal ended
        while queue:
            index, body = queue.pop(0)
            handle = await client.submit(**body, max_tokens=max_tokens, temperature=0.0)
            result = await handle.result(timeout_s=timeout_s)
            results[index] = result.model_dump()
            ended += 1
            if progress is not None:
                progress(ended)

    async with Client(api) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results


def worker_metrics(port: int) -> dict[str, float]:
    """A worker's prefix-cache counters and its jobs taken, by where."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("tidegate_prefix_cache_queries_total",
                               "tidegate_prefix_cache_hits_total"):
                out[sample.name.removeprefix("tidegate_").removesuffix("_total")] = sample.value
            elif sample.name == "tidegate_jobs_taken_total":
                out[f"taken_{sample.labels['via']}"] = sample.value
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(args: argparse.Namespace, routing: bool, bodies: list[dict], logdir: Path) -> dict:
    env = {"TIDEGATE_PREFIX_ROUTING": str(routing).lower(),
           "TIDEGATE_STEAL_DELAY_MS": str(args.steal_delay_ms),
           "TIDEGATE_BLOCK_SIZE": str(args.block_size)}
    cfg = StackConfig(model=args.model, device="cpu", dtype="auto",
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched,
                      kv_cache_gb=args.kv_cache_gb, workers=args.workers,
                      torch_threads=args.torch_threads, cuda_graphs=False, aof=False,
                      redis_server=args.redis_server, api_key=None, default_timeout_s=600,
                      startup_timeout_s=300, extra_env=env)
    mode_dir = logdir / ("routing-on" if routing else "routing-off")
    mode_dir.mkdir(parents=True, exist_ok=True)
    with Stack(cfg, mode_dir) as stack:
        stack.start_front()
        stack.start_workers()
        time.sleep(1.0)  # the workers' first announcements reach the API's routing table
        t0 = time.perf_counter()
        results = asyncio.run(drive(f"http://127.0.0.1:{stack.api_port}", bodies,
                                    concurrency=args.concurrency, max_tokens=args.max_tokens,
                                    timeout_s=args.timeout_s))
        wall = time.perf_counter() - t0
        per_worker = {name: worker_metrics(port) for name, port in stack.status_ports.items()}
        client = redis_sync.Redis.from_url(stack.redis_url, decode_responses=True)
        ran_on = [client.hget(keys.job_hash(r["id"]), "worker") for r in results]
        client.close()
    done = [r for r in results if r.get("status") == "done"]
    ttft = [r["timings"]["ttft_ms"] for r in done if r.get("timings")]
    queries = sum(m.get("prefix_cache_queries", 0) for m in per_worker.values())
    hits = sum(m.get("prefix_cache_hits", 0) for m in per_worker.values())
    jobs_by_worker: dict[str, int] = {}
    for worker_id in ran_on:
        jobs_by_worker[worker_id or "?"] = jobs_by_worker.get(worker_id or "?", 0) + 1
    shares = sorted(n / len(results) for n in jobs_by_worker.values())
    return {
        "routing": routing, "jobs": len(results), "done": len(done), "wall_s": round(wall, 2),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prompt_tokens": queries, "cached_tokens": hits,
        "computed_prompt_tokens": queries - hits,
        "ttft_ms": {"p50": round(percentile(ttft, 0.5), 1), "p90": round(percentile(ttft, 0.9), 1),
                    "p99": round(percentile(ttft, 0.99), 1),
                    "mean": round(statistics.fmean(ttft), 1)},
        "ttft_ms_sorted": sorted(ttft),
        "worker_shares": [round(s, 3) for s in shares],
        "workers": per_worker,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-batched", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--steal-delay-ms", type=int, default=200)
    ap.add_argument("--modes", nargs="+", choices=("on", "off"), default=["off", "on"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--redis-server", default="redis-server")
    ap.add_argument("--logdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(resolve_model(args.model))
    bodies = workload(tokenizer, prompts=args.prompts, prefix_tokens=args.prefix_tokens,
                      jobs=args.jobs, seed=args.seed)
    ideal = ideal_hit_rate(tokenizer, bodies, args.block_size)
    print(f"workload: {len(bodies)} jobs, {ideal['prompt_tokens']} prompt tokens; hit rate if "
          f"each block were computed once in all: {ideal['once_in_all']}", flush=True)
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    modes = {}
    for mode in args.modes:
        modes[mode] = run_mode(args, mode == "on", bodies, logdir)
        m = modes[mode]
        print(f"routing {mode}: hit rate {m['hit_rate']:.3f}, TTFT p50 {m['ttft_ms']['p50']} ms "
              f"p90 {m['ttft_ms']['p90']} ms, shares {m['worker_shares']}, wall {m['wall_s']} s, "
              f"done {m['done']}/{m['jobs']}", flush=True)
    out: dict = {**record.record(argv, __spec__.name),
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 "ideal": ideal, "modes": modes}
    if "on" in modes and "off" in modes:
        out["ttft_p50_gain"] = round(modes["off"]["ttft_ms"]["p50"]
                                     / max(modes["on"]["ttft_ms"]["p50"], 1e-9), 2)
        print(f"TTFT p50 without routing / with: {out['ttft_p50_gain']}x")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
