"""tidegate's engine against HF transformers `generate` on the CPU, same prompts, same run.

Workloads (fixed seed, random prompt tokens, ``ignore_eos`` so lengths are exact):
  mixed   32 requests, prompt lengths uniform in 64-512, output lengths uniform in 64-256.
          tidegate: all submitted at t=0 to the continuous-batching engine.
          HF: one static, left-padded batch; generates to the longest output (every row runs
          that long), only the tokens each request asked for count.
  batch1  one request, 128 prompt tokens, 128 output tokens: ms per output token.
  prefix  32 requests sharing a 384-token system prompt + 32 own tokens, 64 output tokens each;
          tidegate with prefix caching on and off: prompt tokens computed, wall time, TTFT.

Usage:  python -m tidegate.benchmarks.engine.engine_cpu [--repeats 3] [--dtype float32] [--extra-dtype bfloat16]
                                        [--out benchmarks/results/engine/engine_cpu.json] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from tidegate.benchmarks.harness.measure import record
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.loaders.loader import LoadedModel, load_model
from tidegate.worker.service.cpu_tuning import keep_large_allocations


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class RunResult:
    name: str
    wall_s: float
    output_tokens: int
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    prompt_tokens_computed: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def summary(self) -> dict[str, float | int | str | None]:
        def pct(xs: list[float], q: float) -> float | None:
            return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (
                xs[0] if xs else None)

        return {"name": self.name, "wall_s": round(self.wall_s, 2),
                "output_tokens": self.output_tokens,
                "output_tok_s": round(self.tokens_per_s, 1),
                "ttft_p50_ms": pct(self.ttft_ms, 50), "ttft_p99_ms": pct(self.ttft_ms, 99),
                "tpot_p50_ms": pct(self.tpot_ms, 50), "tpot_p99_ms": pct(self.tpot_ms, 99),
                "prompt_tokens_computed": self.prompt_tokens_computed}


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]  # clear of special tokens


def mixed_workload(seed: int, vocab: int, n: int = 32) -> list[Request]:
    rng = random.Random(seed)
    return [Request(random_tokens(rng, rng.randint(64, 512), vocab), rng.randint(64, 256))
            for _ in range(n)]


def prefix_workload(seed: int, vocab: int, n: int = 32) -> list[Request]:
    rng = random.Random(seed + 1)
    system = random_tokens(rng, 384, vocab)
    return [Request(system + random_tokens(rng, 32, vocab), 64) for _ in range(n)]


def run_tidegate(name: str, loaded: LoadedModel, reqs: list[Request], **engine_kw: object
                 ) -> RunResult:
    cfg = {"max_model_len": 2048, "max_num_seqs": 32, "max_num_batched_tokens": 512,
           "kv_cache_gb": 2.0, **engine_kw}
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(**cfg))  # type: ignore[arg-type]
    for i, r in enumerate(reqs):
        engine.add_request(EngineRequest(f"r{i}", r.prompt, SamplingParams(
            max_tokens=r.output_len, ignore_eos=True)))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            count[o.request_id] = o.num_output_tokens
    wall = time.perf_counter() - start
    res = RunResult(name, wall, sum(count.values()),
                    prompt_tokens_computed=engine.stats.prompt_tokens_computed)
    for rid, t in first.items():
        res.ttft_ms.append(1000 * (t - start))
        if count[rid] > 1:
            res.tpot_ms.append(1000 * (last[rid] - t) / (count[rid] - 1))
    return res


def run_hf_static(name: str, hf: torch.nn.Module, reqs: list[Request], pad_id: int) -> RunResult:
    """One left-padded batch; every row generates to the longest requested output."""
    width = max(len(r.prompt) for r in reqs)
    ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in reqs])
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in reqs])
    longest = max(r.output_len for r in reqs)
    kw = {"attention_mask": mask, "do_sample": False, "pad_token_id": pad_id}
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=longest, min_new_tokens=longest, **kw)
        wall = time.perf_counter() - t0
    tpot = 1000 * (wall - ttft) / max(longest - 1, 1)
    return RunResult(name, wall, sum(r.output_len for r in reqs),
                     ttft_ms=[1000 * ttft] * len(reqs), tpot_ms=[tpot] * len(reqs))


def median_run(same: tuple[RunResult, ...]) -> RunResult:
    """The round whose wall time is the median (its latencies come along with it)."""
    ordered = sorted(same, key=lambda r: r.wall_s)
    chosen = ordered[len(ordered) // 2]
    chosen.name += f" [median of {len(same)}; walls {', '.join(f'{r.wall_s:.1f}' for r in same)}]"
    return chosen


def load_hf() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from tidegate.model_files.model_source import resolve_model

    path = resolve_model("smollm2").path
    assert path is not None
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


def plot(results: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["runs"] if r["name"].startswith("mixed")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [r["name"].removeprefix("mixed ").split(" [")[0] for r in rows]
    axes[0].bar(names, [r["output_tok_s"] for r in rows], color=["#888", "#1f77b4", "#2ca02c"])
    axes[0].set_title("32 mixed requests: output tokens/s")
    axes[1].bar(names, [r["ttft_p50_ms"] / 1000 for r in rows], label="p50")
    axes[1].scatter(names, [r["ttft_p99_ms"] / 1000 for r in rows], color="k", label="p99")
    axes[1].set_title("time to first token (s)")
    axes[1].legend()
    axes[2].bar(names, [r["tpot_p50_ms"] for r in rows], label="p50")
    axes[2].scatter(names, [r["tpot_p99_ms"] for r in rows], color="k", label="p99")
    axes[2].set_title("time per output token (ms)")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--extra-dtype", default="", help="also run tidegate in this dtype")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians kept")
    ap.add_argument("--mixed-only", action="store_true",
                    help="only the mixed workload (quick check; prints, writes nothing)")
    ap.add_argument("--out", default="benchmarks/results/engine/engine_cpu.json")
    ap.add_argument("--plot", default="benchmarks/results/engine/engine_cpu.png")
    args = ap.parse_args()

    keep_large_allocations()
    torch.manual_seed(args.seed)
    loaded = load_model("smollm2", dtype=getattr(torch, args.dtype), packed=False)
    vocab = loaded.config.vocab_size
    mixed, shared = mixed_workload(args.seed, vocab), prefix_workload(args.seed, vocab)
    one = [Request(random_tokens(random.Random(args.seed + 2), 128, vocab), 128)]
    hf = load_hf()
    pad = int(hf.generation_config.pad_token_id or 0)
    extra = load_model("smollm2", dtype=getattr(torch, args.extra_dtype)) if args.extra_dtype else None
    rounds: list[list[RunResult]] = []
    # The host's speed drifts from minute to minute: alternate HF and tidegate in every round
    # and report each run's median over the rounds.
    for _ in range(args.repeats):
        runs = [
            run_hf_static(f"mixed HF generate static ({args.dtype})", hf, mixed, pad),
            run_tidegate(f"mixed tidegate ({args.dtype})", loaded, mixed),
        ]
        if args.mixed_only:
            rounds.append(runs)
            continue
        runs += [
            run_hf_static(f"batch1 HF generate ({args.dtype})", hf, one, pad),
            run_tidegate(f"batch1 tidegate ({args.dtype})", loaded, one),
            run_tidegate("prefix tidegate, prefix caching off", loaded, shared,
                         prefix_caching=False),
            run_tidegate("prefix tidegate, prefix caching on", loaded, shared,
                         prefix_caching=True),
        ]
        if extra is not None:
            runs.append(run_tidegate(f"mixed tidegate ({args.extra_dtype})", extra, mixed))
        rounds.append(runs)
    runs = [median_run(same) for same in zip(*rounds, strict=True)]
    if args.mixed_only:
        hf_mixed, tg_mixed = runs
        print(f"mixed: tidegate {tg_mixed.tokens_per_s:.1f} vs HF {hf_mixed.tokens_per_s:.1f} "
              f"out tok/s = {tg_mixed.tokens_per_s / hf_mixed.tokens_per_s:.2f}x "
              f"({tg_mixed.name}; {hf_mixed.name})")
        return
    results = {
        **record.record(),
        "machine": {**record.machine(), "cpu": record.cpu_model(),
                    "threads": torch.get_num_threads()},
        "workloads": {"mixed_prompt_tokens": sum(len(r.prompt) for r in mixed),
                      "mixed_output_tokens": sum(r.output_len for r in mixed),
                      "hf_static_generated_rows_x_steps": len(mixed) * max(r.output_len for r in mixed)},
        "runs": [r.summary() for r in runs],
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    for r in results["runs"]:
        print(json.dumps(r))
    hf_mixed, tg_mixed, hf_b1, tg_b1 = runs[:4]
    print(f"\nmixed: tidegate {tg_mixed.tokens_per_s:.0f} vs HF {hf_mixed.tokens_per_s:.0f} out tok/s"
          f" = {tg_mixed.tokens_per_s / hf_mixed.tokens_per_s:.2f}x")
    print(f"batch-1 decode: tidegate {tg_b1.tpot_ms[0]:.1f} vs HF {hf_b1.tpot_ms[0]:.1f} ms/token")
    off, on = runs[4], runs[5]
    print(f"prefix: prompt tokens computed {off.prompt_tokens_computed} -> "
          f"{on.prompt_tokens_computed}, wall {off.wall_s:.1f} -> {on.wall_s:.1f} s")


if __name__ == "__main__":
    main()
