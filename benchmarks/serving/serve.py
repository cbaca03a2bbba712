"""Serving benchmark through the real stack, in the manner of ``vllm bench serve``.

Starts redis-server, ``tidegate api``, ``tidegate gateway`` and ``--workers`` workers as
separate processes, then drives them with a load generator that submits jobs over HTTP and
follows each one over WebSocket or SSE as a real client would. Runs, in order:

* capacity: how fast the generator itself can submit and follow (no worker running);
* burst: ``--burst N`` jobs submitted at once, and the engine alone on the same prompts (a
  subprocess before the stack starts: same model, same ``EngineConfig`` as the worker);
* rates: a Poisson sweep, ``--rates R ...`` requests/s, each after the previous one drained.

Every followed job is checked for exactness (event ids 1, 2, 3... with no gap or duplicate, one
final event and it is last, token texts == stored text, tokens == usage == the output length).
With ``--response-format FILE`` every job (the warm-up's too) carries a response_format, the
file's formats taken in turn; such a job may also end before its length where its grammar is
complete, and its stored text is checked against its JSON schema
(``tidegate.benchmarks.harness.measure.json_check``).
Prints one row per run and writes everything to ``--out`` (and ``--plot`` with matplotlib).

    # this CPU machine
    python -m tidegate.benchmarks.serving.serve --model random:tiny --max-num-seqs 256 \\
        --max-num-batched-tokens 2048 --burst 600 --input-len 64 --output-len 64
    python -m tidegate.benchmarks.serving.serve --model smollm2 --burst 32 --length-dist uniform \\
        --input-range 16 256 --output-range 16 128
    # one H200, 16 cores
    python -m tidegate.benchmarks.serving.serve --device cuda --model random:llama-3-8b --max-num-seqs 1024 \\
        --max-num-batched-tokens 16384 --burst 1000 --input-len 256 --output-len 256 \\
        --rates 20 30 40 50 60 70 --num-prompts 1000 --client-procs 4
    # a smoke test; the generator's ceiling alone
    python -m tidegate.benchmarks.serving.serve --quick --model random:tiny
    # every job JSON-schema constrained (a schema, a response_format, or a list of either)
    python -m tidegate.benchmarks.serving.serve --quick --model smollm2 --response-format schema.json
    python -m tidegate.benchmarks.serving.serve --capacity-check
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from tidegate.benchmarks.harness.load.loadgen import (  # noqa: E402
    ClientPlan,
    Endpoints,
    JobSpec,
    LoadResult,
    raise_file_limit,
    run_load,
    shard,
)
from tidegate.benchmarks.harness.load.workload import Work, build_work, poisson_offsets  # noqa: E402
from tidegate.benchmarks.harness.measure import (  # noqa: E402
    capacity,  # noqa: E402
    record,
    report,
)
from tidegate.benchmarks.harness.measure.json_check import check_outputs, formats_from_file  # noqa: E402
from tidegate.benchmarks.harness.measure.metrics import (  # noqa: E402
    RunSummary,
    Slo,
    job_details,
    summarize,
)
from tidegate.benchmarks.harness.run.stack import Stack, StackConfig, StackError, run_engine_alone  # noqa: E402
from tidegate.settings import batch_limits  # noqa: E402

SECTIONS = ("capacity", "burst", "rates")
WARM_UP, WARM_UP_JOBS = "warm-up", 4
WARM_UP_MODES = ("ws", "sse")
NO_DEADLINE_S = 600.0  # generous: without --deadline-s nothing should be shed
# (normal, --quick) defaults of the options left unset
DEFAULTS = {"burst": (200, 20), "rates": ([], [10.0]), "num_prompts": (200, 20),
            "input_len": (256, 32), "output_len": (256, 16), "capacity_submits": (2000, 200),
            "capacity_streams": (200, 20), "capacity_stream_tokens": (256, 32)}


@dataclass(frozen=True, slots=True)
class Bench:
    """The resolved options of one benchmark invocation."""

    args: argparse.Namespace
    sections: tuple[str, ...]
    stack: StackConfig

    @property
    def timeout_s(self) -> float:
        return self.args.deadline_s or NO_DEADLINE_S

    @property
    def slo(self) -> Slo:
        a = self.args
        return Slo(self.timeout_s, a.slo_ttft_ms, a.slo_tpot_ms, a.deadline_s is not None)

    def follow_mode(self, i: int) -> str:
        """Evenly spread followed jobs (``--follow-fraction``); ``mixed`` alternates ws/sse."""
        f = self.args.follow_fraction
        if int((i + 1) * f) == int(i * f):
            return "poll"
        if self.args.follow == "mixed":
            return ("ws", "sse")[int(i * f) % 2]
        return self.args.follow


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("stack")
    g.add_argument("--model", default="smollm2")
    g.add_argument("--device", default="cpu", help="cpu | cuda (several workers: cuda:0, :1...)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-num-seqs", type=int, help="default: the worker's for --device")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="default: the worker's for --device")
    g.add_argument("--kv-cache-gb", type=float, help="default: the worker's")
    g.add_argument("--torch-threads", type=int, help="default: the worker's (one per core)")
    g.add_argument("--no-cuda-graphs", action="store_true")
    g.add_argument("--workers", type=int, default=1)
    g.add_argument("--redis-server", default="redis-server", help="the redis-server binary")
    g.add_argument("--no-aof", action="store_true", help="Redis without AOF (default: AOF on, "
                   "appendfsync everysec, as compose/docker-compose.yml)")
    g.add_argument("--auth", action="store_true", help="run with a generated API key")
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every stack process (repeatable)")
    g.add_argument("--worker-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the workers and the engine alone only (their "
                        "settings, e.g. TIDEGATE_MAX_STEP_MS=0, or TIDEGATE_LOG_LEVEL=DEBUG for "
                        "a line per step)")
    g.add_argument("--startup-timeout-s", type=float, default=900)
    g = ap.add_argument_group("workload")
    g.add_argument("--burst", type=int, help="jobs submitted at once (0: no burst run)")
    g.add_argument("--rates", type=float, nargs="*", help="Poisson sweep, requests/s")
    g.add_argument("--num-prompts", type=int, help="jobs per rate")
    g.add_argument("--duration-s", type=float, help="instead of --num-prompts: arrival window")
    g.add_argument("--input-len", type=int)
    g.add_argument("--output-len", type=int)
    g.add_argument("--length-dist", choices=("fixed", "uniform", "chat"), default="fixed",
                   help="chat: a long-tailed chat-like mix (workload.chat_lengths: turns of "
                        "conversations with LMSYS-Chat-1M's averages), clipped to the ranges "
                        "where given")
    g.add_argument("--chat-scale", type=float, default=1.0,
                   help="--length-dist chat: every prompt and response this many times longer")
    g.add_argument("--shared-prefix-share", type=float, default=0.0,
                   help="share of jobs whose prompts begin with one common system prompt")
    g.add_argument("--shared-prefix-len", type=int, default=0,
                   help="that system prompt's length in tokens")
    g.add_argument("--workload", choices=("random", "quote"), default="random",
                   help="prompts of random words, or an instruction to repeat them (quote: "
                        "the text speculative decoding's prompt lookup drafts from)")
    g.add_argument("--input-range", type=int, nargs=2, metavar=("LO", "HI"))
    g.add_argument("--output-range", type=int, nargs=2, metavar=("LO", "HI"))
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--deadline-s", type=float, help=f"each job's timeout_s (default "
                   f"{NO_DEADLINE_S:.0f}: nothing shed)")
    g.add_argument("--slo-ttft-ms", type=float)
    g.add_argument("--slo-tpot-ms", type=float)
    g.add_argument("--slo-sweep", action="store_true",
                   help="the rates in ascending order, stopping after the first that misses "
                        "the SLO (TTFT p99 and TPOT p99 within --slo-ttft-ms and --slo-tpot-ms); "
                        "reports the highest rate that met it (the SLO goodput rate)")
    g.add_argument("--cold-jobs", type=int, default=50,
                   help="a rate run's first jobs (arriving at an idle stack), reported apart "
                        "from the rest")
    g.add_argument("--response-format", metavar="FILE",
                   help="JSON: a response_format object, a JSON schema, or a list of either "
                        "(or of {name, schema}); every job carries one, in turn")
    g.add_argument("--adapters", nargs="+", default=[], metavar="NAME",
                   help="LoRA adapters the jobs run, in turn (the job's lora field); the "
                        "worker loads them (--lora)")
    g.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="an adapter the worker loads at start (its --lora)")
    g = ap.add_argument_group("load generator")
    g.add_argument("--follow", choices=("ws", "sse", "mixed"), default="ws")
    g.add_argument("--follow-fraction", type=float, default=1.0,
                   help="share of jobs followed; the rest are polled at the end")
    g.add_argument("--client-procs", type=int, default=1)
    g.add_argument("--submit-concurrency", type=int, default=64,
                   help="keep-alive connections to the API per generator process")
    g = ap.add_argument_group("what to run")
    g.add_argument("--only", nargs="+", choices=SECTIONS)
    g.add_argument("--capacity-check", action="store_true", help="= --only capacity")
    g.add_argument("--no-engine-alone", action="store_true")
    g.add_argument("--engine-alone-rates", action="store_true",
                   help="also run the engine alone on each Poisson run's arrival schedule")
    g.add_argument("--capacity-submits", type=int)
    g.add_argument("--capacity-streams", type=int)
    g.add_argument("--capacity-stream-tokens", type=int)
    g.add_argument("--capacity-tokens-per-event", type=int, default=1)
    g.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    g = ap.add_argument_group("output")
    g.add_argument("--logdir", help="process logs (default: a new temp dir)")
    g.add_argument("--out", default=str(ROOT / "benchmarks/results/serving/serve.json"))
    g.add_argument("--plot", default=str(ROOT / "benchmarks/results/serving/serve.png"),
                   help="'' for none")
    g.add_argument("--save-detailed", action="store_true",
                   help="per-job timings and checks in the JSON too")
    g.add_argument("--goodput-out", help="also write the run's headline figures here "
                   "(device, slo_rate_req_s, burst_req_s, roofline_req_s, "
                   "cold_wave_ttft_p90_ratio)")
    g.add_argument("--roofline", action="store_true",
                   help="measure the mix's roofline in the engine-alone process (a bf16 matrix "
                        "product's rate and the decode step at the batch the mix fills the KV "
                        "cache with) and report it beside the burst")
    args = ap.parse_args(argv)
    for name, (normal, quick) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else normal)
    _check(ap, args)
    return args


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.length_dist == "uniform" and not (args.input_range and args.output_range):
        ap.error("--length-dist uniform needs --input-range and --output-range")
    if args.slo_sweep and not (args.rates and (args.slo_ttft_ms or args.slo_tpot_ms)):
        ap.error("--slo-sweep needs --rates and --slo-ttft-ms or --slo-tpot-ms")
    if not 0 <= args.shared_prefix_share <= 1 or args.shared_prefix_len < 0:
        ap.error("--shared-prefix-share must be in [0, 1], --shared-prefix-len not negative")
    if args.shared_prefix_share and not args.shared_prefix_len:
        ap.error("--shared-prefix-share needs --shared-prefix-len")
    if args.chat_scale <= 0 or args.cold_jobs < 1:
        ap.error("--chat-scale and --cold-jobs must be positive")
    if args.length_dist == "fixed" and (args.input_range or args.output_range):
        ap.error("--input-range/--output-range need --length-dist uniform")
    if not 0 < args.follow_fraction <= 1:
        ap.error("--follow-fraction must be in (0, 1]")
    if any(r <= 0 for r in args.rates):
        ap.error("--rates must be positive")
    if min(args.client_procs, args.workers, args.submit_concurrency) < 1:
        ap.error("--client-procs, --workers and --submit-concurrency must be at least 1")
    if any("=" not in kv for kv in args.env + args.worker_env):
        ap.error("--env and --worker-env take KEY=VALUE")
    if args.response_format:
        try:
            args.formats = formats_from_file(Path(args.response_format))
        except (OSError, ValueError) as exc:
            ap.error(f"--response-format: {exc}")
    else:
        args.formats = []


def resolve(args: argparse.Namespace) -> Bench:
    only = ("capacity",) if args.capacity_check else tuple(args.only or SECTIONS)
    sections = tuple(s for s in SECTIONS if s in only
                     and not (s == "burst" and args.burst <= 0)
                     and not (s == "rates" and not args.rates))
    # The worker's own defaults for the device, resolved here so the results name them.
    batch = batch_limits(args.device, args.max_num_seqs, args.max_num_batched_tokens)
    args.max_num_seqs, args.max_num_batched_tokens = batch.max_num_seqs, batch.max_num_batched_tokens
    stack = StackConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=batch.max_num_seqs,
        max_num_batched_tokens=batch.max_num_batched_tokens, kv_cache_gb=args.kv_cache_gb,
        workers=args.workers, torch_threads=args.torch_threads,
        cuda_graphs=not args.no_cuda_graphs, aof=not args.no_aof,
        redis_server=args.redis_server,
        api_key=secrets.token_urlsafe(24) if args.auth else None,
        default_timeout_s=args.deadline_s or NO_DEADLINE_S,
        startup_timeout_s=args.startup_timeout_s,
        extra_env=dict(kv.split("=", 1) for kv in args.env),
        worker_extra_env=dict(kv.split("=", 1) for kv in args.worker_env),
        worker_args=tuple(arg for kv in args.lora for arg in ("--lora", kv)))
    return Bench(args, sections, stack)


# ---------------------------------------------------------------- workloads


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    rate: float | None  # requests/s of a Poisson run; None: all at once
    work: Work


def plan_work(bench: Bench) -> list[Run]:
    """The warm-up, the burst and each rate's jobs. Prompts are distinct everywhere (each run
    has its own seed), so no run hits the prefix cache of another."""
    from tidegate.model_files.model_source import resolve_model
    from tidegate.model_files.tokenizer import load_tokenizer

    a = bench.args
    tokenizer = load_tokenizer(resolve_model(a.model))

    def encode(text: str) -> list[int]:
        return tokenizer.encode_prompt(text, None)  # as the worker counts a prompt

    def work(offsets: list[float], seed: int, **lengths: object) -> Work:
        spans = (tuple(a.input_range) if a.input_range else None,
                 tuple(a.output_range) if a.output_range else None)
        shape = {"input_len": a.input_len, "output_len": a.output_len, "input_span": spans[0],
                 "output_span": spans[1], "quote": a.workload == "quote",
                 "chat_scale": a.chat_scale if a.length_dist == "chat" else None,
                 "shared_share": a.shared_prefix_share, "shared_len": a.shared_prefix_len,
                 **lengths}
        built = build_work(encode, offsets, seed=seed, **shape)  # type: ignore[arg-type]
        if a.adapters:
            built = dataclasses.replace(built, adapters=tuple(
                a.adapters[i % len(a.adapters)] for i in range(len(built))))
        if not a.formats:
            return built
        return dataclasses.replace(built, formats=tuple(a.formats[i % len(a.formats)]
                                                        for i in range(len(built))))

    runs = [Run(WARM_UP, None, work([0.0] * WARM_UP_JOBS, a.seed * 1000 + 999,
                                         input_len=16, output_len=4, input_span=None,
                                         output_span=None, chat_scale=None, shared_share=0.0))]
    if "burst" in bench.sections:
        runs.append(Run("burst", None, work([0.0] * a.burst, a.seed * 1000)))
    for k, rate in enumerate(a.rates if "rates" in bench.sections else []):
        count = None if a.duration_s else a.num_prompts
        offsets = poisson_offsets(rate, random.Random(a.seed * 1000 + k + 1), count=count,
                                  duration_s=a.duration_s)
        runs.append(Run(f"rate {rate:g}/s", rate, work(offsets, a.seed * 1000 + 500 + k)))
    return runs


def run_work(bench: Bench, stack: Stack, endpoints: Endpoints, run: Run
             ) -> tuple[RunSummary, LoadResult]:
    a, work = bench.args, run.work
    jobs = [JobSpec(i, work.body(i, timeout_s=bench.timeout_s), work.prompts[i].tokens,
                    work.output_lens[i], work.offsets_s[i],
                    WARM_UP_MODES[i % 2] if run.name == WARM_UP else bench.follow_mode(i),
                    constrained=work.format(i) is not None)
            for i in range(len(work))]
    # A job may queue behind the whole run: allow its deadline plus the run's arrivals.
    job_timeout_s = bench.timeout_s + max(work.offsets_s) + 60
    plans = [ClientPlan(endpoints, part, a.submit_concurrency, job_timeout_s)
             for part in shard(jobs, a.client_procs)]
    before = stack.worker_time()
    load = run_load(plans, stack.cpu, stack.check_alive)
    after = stack.worker_time()
    kind = "rate" if run.rate is not None else run.name
    summary = summarize(kind, run.name, run.rate, load, bench.slo, a.cold_jobs)
    summary.worker_time = {name: {k: round(v - before.get(name, {}).get(k, 0.0), 3)
                                  for k, v in counters.items()}
                           for name, counters in after.items()}
    if work.formats:
        check_json(summary, load, work)
    return summary, load


def check_json(summary: RunSummary, load: LoadResult, work: Work) -> None:
    """Each finished constrained job's stored text against its schema: an invalid one makes
    the run inexact, as a broken stream does."""
    done = sorted((r for r in load.records if (r.result or {}).get("status") == "done"),
                  key=lambda r: r.index)
    check = check_outputs(((f"job {r.index} ({r.job_id})", r.result["text"],  # type: ignore[index]
                            r.result.get("finish_reason"))  # type: ignore[union-attr]
                           for r in done), [work.format(r.index) for r in done])
    summary.json_outputs = {**dataclasses.asdict(check), "line": check.line()}
    if check.invalid:
        summary.exact = False
        summary.exact_failures += check.invalid
        summary.failure_examples += check.examples


def warm_up(bench: Bench, stack: Stack, endpoints: Endpoints, run: Run) -> RunSummary:
    """A few short jobs through every path (submit, WebSocket, SSE, the worker) before anything
    is measured: first connections and first requests cost the servers extra. They must be
    exact, or nothing else is worth measuring."""
    summary, _ = run_work(bench, stack, endpoints, run)
    if not summary.exact or summary.completed != len(run.work):
        raise RuntimeError("the warm-up jobs failed: " + "; ".join(summary.failure_examples))
    wait_drained(stack)
    return summary


def attach_engine_alone(summary: RunSummary, alone: dict, load: LoadResult) -> None:
    """The engine alone's output tok/s beside the stack's, and how many texts are the same
    (greedy either way; batches differ, so a near-tie may break differently)."""
    summary.engine_alone_tok_s = alone["output_tok_s"]
    summary.ratio_to_engine_alone = round(summary.output_tok_s / alone["output_tok_s"], 3)
    if "texts" in alone:  # a burst: the same prompts, all at once
        stored = [(r.result or {}).get("text") for r in load.records]
        same = [t == a for t, a in zip(stored, alone["texts"], strict=True) if t is not None]
        summary.same_text_as_engine_alone = round(sum(same) / len(same), 3) if same else None
    else:  # a Poisson run: the engine's own latencies on the same schedule, to compare
        summary.engine_alone = {k: alone[k] for k in ("ttft_ms", "tpot_ms", "e2e_ms",
                                                      "steady_delivered_share")}


# ---------------------------------------------------------------- the run


def run(bench: Bench, logdir: Path) -> dict:
    a = bench.args
    warm, *runs = plan_work(bench)
    # The config without --response-format's parsed formats: the option names their file.
    out: dict = {**record.record(), "logdir": str(logdir),
                 "config": {k: v for k, v in vars(a).items() if k != "formats"},
                 "sections": bench.sections,
                 "prompts": {r.name: prompt_stats(r.work) for r in runs},
                 "capacity": {}, "runs": []}
    works = {} if a.no_engine_alone else {
        r.name: (r.work, r.rate is not None) for r in runs
        if r.name == "burst" or (r.rate is not None and a.engine_alone_rates)}
    alone: dict[str, dict] = {}
    mix = mix_shape(runs) if a.roofline and runs else None
    if works or mix:
        print(f"engine alone: {', '.join([*works, *(['roofline'] if mix else [])])} ...",
              flush=True)
        alone = run_engine_alone(bench.stack, works, bench.timeout_s, logdir, mix)
        out["engine_alone"] = {name: {k: v for k, v in r.items() if k != "texts"}
                               for name, r in alone.items() if name != "roofline"}
        if mix:
            out["roofline"] = alone.pop("roofline")
    with Stack(bench.stack, logdir) as stack:
        stack.start_front()
        endpoints = Endpoints(stack.api_port, stack.gateway_port, bench.stack.api_key)
        if "capacity" in bench.sections:
            out["capacity"] = run_capacity(bench, stack, endpoints)
            print(report.capacity_lines(out["capacity"]), flush=True)
            stack.flush()  # the probes must never reach a worker
        if runs:
            print(f"starting {a.workers} worker(s) ...", flush=True)
            stack.start_workers()
            out["warm_up"] = warm_up(bench, stack, endpoints, warm)
        for run in runs:
            if run.rate is not None and out.get("slo_missed_at") is not None:
                print(f"{run.name}: skipped (the SLO was missed at a lower rate)", flush=True)
                continue
            print(f"{run.name}: {len(run.work)} jobs ...", flush=True)
            summary, load = run_work(bench, stack, endpoints, run)
            if run.name in alone:
                attach_engine_alone(summary, alone[run.name], load)
            out["runs"].append(summary)
            if a.save_detailed:
                out.setdefault("jobs", {})[run.name] = job_details(load)
            print(report.table([summary]).splitlines()[2], flush=True)
            if a.slo_sweep and run.rate is not None and not meets_slo(summary, bench.slo):
                out["slo_missed_at"] = run.rate
            wait_drained(stack)
    if a.slo_sweep:
        out["slo_sweep"] = slo_sweep(out["runs"], bench.slo)
    return out


def meets_slo(summary: RunSummary, slo: Slo) -> bool:
    """TTFT p99 and TPOT p99 of the whole run (its cold start too) within the SLO, every job
    complete."""
    ttft, tpot = summary.ttft_ms.p99, summary.tpot_ms.p99
    return (summary.completed == summary.jobs
            and (slo.ttft_ms is None or (ttft is not None and ttft <= slo.ttft_ms))
            and (slo.tpot_ms is None or (tpot is not None and tpot <= slo.tpot_ms)))


def slo_sweep(runs: list[RunSummary], slo: Slo) -> dict:
    """The highest rate (of those run, below any that missed) whose run met the SLO."""
    rated = sorted((s for s in runs if s.request_rate is not None),
                   key=lambda s: s.request_rate or 0.0)
    rows, best = [], None
    for s in rated:
        met = meets_slo(s, slo)
        rows.append({"rate": s.request_rate, "ttft_p99_ms": s.ttft_ms.p99,
                     "tpot_p99_ms": s.tpot_ms.p99, "met": met,
                     "cold_ttft_p90_ratio": s.cold_ttft_p90_ratio})
        if not met:
            break
        best = s.request_rate
    return {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "rates": rows,
            "slo_rate_req_s": best}


def mix_shape(runs: list[Run]) -> dict[str, float]:
    """The mean prompt and output lengths over every measured job."""
    prompts = [p.tokens for r in runs for p in r.work.prompts]
    outputs = [n for r in runs for n in r.work.output_lens]
    return {"mean_input": sum(prompts) / len(prompts), "mean_output": sum(outputs) / len(outputs)}


def headline(out: dict) -> dict:
    """``--goodput-out``: the figures issue 43's targets name, from this run."""
    runs: list[RunSummary] = out["runs"]
    burst = next((s for s in runs if s.kind == "burst"), None)
    ratios = [s.cold_ttft_p90_ratio for s in runs if s.cold_ttft_p90_ratio is not None]
    machine = out.get("machine", {})
    on_gpu = str(out.get("config", {}).get("device", "")).startswith("cuda")
    roof = (out.get("roofline") or {}).get("roofline_req_s")
    return {"device": (machine.get("gpu") if on_gpu else None) or machine.get("cpu_model"),
            "date": out.get("date"), "git_commit": out.get("git_commit"),
            "command": out.get("command"),
            "slo": {k: v for k, v in (out.get("slo_sweep") or {}).items() if k != "rates"},
            "slo_rate_req_s": (out.get("slo_sweep") or {}).get("slo_rate_req_s"),
            "burst_req_s": burst.request_throughput if burst else None,
            "roofline_req_s": roof,
            "burst_share_of_roofline": (
                round(burst.request_throughput / roof, 3) if burst and roof else None),
            "cold_wave_ttft_p90_ratio": max(ratios) if ratios else None,
            "roofline": out.get("roofline")}


def run_capacity(bench: Bench, stack: Stack, endpoints: Endpoints) -> dict:
    a = bench.args
    runner = capacity.Runner(endpoints, a.client_procs, a.submit_concurrency, stack.cpu,
                             stack.check_alive)
    follow = ["ws", "sse"] if a.follow == "mixed" else [a.follow]
    return {"submit": capacity.submit_capacity(runner, a.capacity_submits),
            "follow": capacity.follow_capacity(
                runner, stack.redis_port, streams=a.capacity_streams,
                tokens=a.capacity_stream_tokens, tokens_per_event=a.capacity_tokens_per_event,
                follow=follow)}


def wait_drained(stack: Stack, timeout_s: float = 120) -> None:
    """Until no lane has a job waiting or running (the next run starts on an idle stack)."""
    import redis

    from tidegate import keys

    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            backlog = sum(int(g.get("lag") or 0) + int(g["pending"])
                          for stream in client.scan_iter(match=f"{keys.PREFIX}:lane:*")
                          for g in client.xinfo_groups(stream))
            if backlog == 0:
                return
            time.sleep(0.2)
    finally:
        client.close()


def prompt_stats(work: Work) -> dict[str, float]:
    ins = [p.tokens for p in work.prompts]
    return {"jobs": len(work), "input_tokens_min": min(ins), "input_tokens_max": max(ins),
            "input_tokens_mean": round(sum(ins) / len(ins), 2),
            "output_len_mean": round(sum(work.output_lens) / len(work), 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = resolve(args)
    raise_file_limit()  # the gateway and Redis inherit it: one socket per follower
    signal.signal(signal.SIGTERM, _interrupt)
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="tidegate-serve-"))
    logdir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {logdir}", flush=True)
    try:
        out = run(bench, logdir)
    except KeyboardInterrupt:
        print(f"interrupted; logs in {logdir}", file=sys.stderr)
        return 130
    except (StackError, RuntimeError) as exc:
        print(f"serve.py: {exc}\nlogs in {logdir}", file=sys.stderr)
        return 1
    # The measurements are done: a stop now (a session's time limit) would lose every figure
    # in the middle of writing them, so it waits; the summary is printed first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    runs: list[RunSummary] = out["runs"]
    out["exact"] = all(s.exact for s in runs) and out["capacity"].get("follow", {}).get(
        "exact", True)
    print()
    if out["capacity"]:
        print(report.capacity_lines(out["capacity"]))
    if runs:
        print(report.table(runs))
        print("\n".join(report.run_details(s) for s in runs))
    top = headline(out)
    if out.get("roofline") or out.get("slo_sweep"):
        print("headline: " + ", ".join(f"{k} {top[k]}" for k in (
            "slo_rate_req_s", "burst_req_s", "roofline_req_s", "burst_share_of_roofline",
            "cold_wave_ttft_p90_ratio")))
    sys.stdout.flush()
    report.write_json(Path(args.out), out)
    if args.goodput_out:
        report.write_json(Path(args.goodput_out), top)
    if args.plot:
        print(report.plot(runs, Path(args.plot)))
    print(f"results: {args.out}")
    return 0 if out["exact"] else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
