"""Speculative decoding's costs on a GPU, engine alone: the issue's H200 figures.

Random weights of the Llama-3-8B shape in bf16 (random weights give no real acceptance, so the
mechanism's costs are what is measured), one CUDA device:

- ``verify``: batch 1 past a 512-token prompt, a K-draft verify step against a decode step
  (drafts set by hand), both read back every step; the verify step replays the decode graph of
  K + 1 rows. The other sections run as a worker does: plain steps overlapped (async output),
  a speculative step read back before the next.
- ``ceiling``: batch 1, drafts that always agree: the target drafting for itself
  (``speculative="draft"`` with the target as the draft model). Tok/s against plain decoding,
  as served (the draft's passes cost what the target's do) and with the draft's time taken out
  (a free draft that always agrees: the mechanism's ceiling).
- ``draft1b``: the Llama-3.2-1B shape as the draft model of the 8B target: the draft's time per
  proposed token at batch 1, against the target's decode step.
- ``breakeven``: at batch sizes 1..256, a verify step's cost against a decode step's, and so
  the batch size past which speculation stops paying at a given acceptance (a verify step
  gives 1 + a K tokens); then the governor (``SpeculationGovernor``) with drafts that are
  never kept, which it should switch off: its tok/s against plain and forced speculation.

    python -m tidegate.benchmarks.engine.speculative_gpu --out $OUT/speculative_gpu.json
    python -m tidegate.benchmarks.engine.speculative_gpu --device cpu --model random:tiny --draft random:tiny \
        --batches 1 4 --max-tokens 16      # the script itself, checked on a CPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch  # noqa: E402

from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.protocol import SamplingParams  # noqa: E402
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from tidegate.worker.engine.sequence import Sequence  # noqa: E402
from tidegate.worker.models.loaders.loader import LoadedModel, load_model  # noqa: E402
from tidegate.worker.speculative.speculation_governor import SpeculationGovernor  # noqa: E402
from tidegate.worker.speculative.speculative_engine import speculative_engine  # noqa: E402

# Where the run is (set once by main): the device, the weights' dtype, the prompts' largest id.
DEVICE: dict[str, object] = {"name": "cuda", "dtype": torch.bfloat16, "vocab": 30000}
PLAIN = SpeculationGovernor(max_batch=0)  # never speculates
FORCED = SpeculationGovernor(max_batch=1 << 20)  # always speculates


class Fixed:
    """Drafts the same tokens every step (the verify step's cost, acceptance aside)."""

    def __init__(self, draft: list[int]) -> None:
        self.draft = draft

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.draft[:limit] for _, limit in wanted]

    def forget(self, request_id: str) -> None:
        pass


class Timed:
    """A proposer whose time (the host waits for its last pass) and drafts are counted."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.drafts = 0

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        start = time.perf_counter()
        out = self.inner.propose_all(wanted)  # type: ignore[attr-defined]
        self.seconds += time.perf_counter() - start
        self.drafts += sum(map(len, out))
        return out

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)  # type: ignore[attr-defined]


def sync() -> None:
    if DEVICE["name"] != "cpu":
        torch.cuda.synchronize()


def config(batch: int, k: int, speculative: str | None = "ngram",
           async_output: bool | None = None) -> EngineConfig:
    """As a worker runs (plain steps overlapped on a GPU), but no prefix cache: a run after
    another of the same prompts computes them again."""
    return EngineConfig(max_model_len=2048, max_num_seqs=batch, async_output=async_output,
                        max_num_batched_tokens=max(512, batch * (k + 1)),
                        kv_cache_gb=24 if DEVICE["name"] != "cpu" else 0.5,
                        prefix_caching=False, speculative=speculative,
                        num_speculative_tokens=k)


def prompts(n: int, length: int, offset: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(offset)
    top = int(DEVICE["vocab"])  # type: ignore[call-overload]
    return [torch.randint(5, top, (length,), generator=g).tolist() for _ in range(n)]


def generate(engine: Engine, batch: list[list[int]], max_tokens: int, tag: str
             ) -> tuple[float, dict[str, list[int]]]:
    """Seconds to finish the batch (greedy, ignoring EOS) and each request's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync()
    start = time.perf_counter()
    for i, ids in enumerate(batch):
        engine.add_request(EngineRequest(f"{tag}{i}", ids, params))
    tokens: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(batch))}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    return time.perf_counter() - start, tokens


def verify_cost(target: LoadedModel, k: int) -> dict[str, float]:
    engine = speculative_engine(target.model, target.tokenizer, config(1, k, async_output=False))
    engine.governor = FORCED
    engine.add_request(EngineRequest("v", prompts(1, 512, 1)[0], SamplingParams(
        max_tokens=1500, temperature=0.0, ignore_eos=True)))
    engine.step()  # the prefill

    def steps(n: int, draft: bool) -> float:
        engine.speculator = Fixed([7] * k if draft else [])  # type: ignore[assignment]
        sync()
        start = time.perf_counter()
        for _ in range(n):
            engine.step()
        return (time.perf_counter() - start) / n

    steps(5, False)
    steps(5, True)
    plain, verify = steps(50, False), steps(50, True)
    return {"k": k, "decode_step_ms": plain * 1e3, "verify_step_ms": verify * 1e3,
            "ratio": verify / plain}


def with_draft(target: LoadedModel, draft: LoadedModel, k: int, batch: list[list[int]],
               max_tokens: int, tag: str) -> tuple[Engine, float, Timed]:
    """Batch 1 drafting with ``draft`` in every step, after a warm-up: the engine, the
    seconds the batch took and the draft's share of them."""
    engine = speculative_engine(target.model, target.tokenizer, config(1, k, speculative="draft"),
                                draft=draft.model)
    engine.governor = FORCED
    generate(engine, prompts(1, 128, 3), 16, "warm")
    engine.reset_stats()
    timed = engine.speculator = Timed(engine.speculator)  # type: ignore[assignment]
    secs, _ = generate(engine, batch, max_tokens, tag)
    return engine, secs, timed


def ceiling(target: LoadedModel, k: int, max_tokens: int) -> dict[str, float]:
    batch = prompts(1, 128, 2)
    plain_engine = Engine(target.model, target.tokenizer, config(1, k, speculative=None))
    generate(plain_engine, prompts(1, 128, 3), 16, "warm")
    plain_s, _ = generate(plain_engine, batch, max_tokens, "p")
    del plain_engine
    engine, spec_s, timed = with_draft(target, target, k, batch, max_tokens, "s")
    stats = engine.stats
    return {"k": k, "plain_tok_s": max_tokens / plain_s, "self_draft_tok_s": max_tokens / spec_s,
            "ceiling_tok_s": max_tokens / (spec_s - timed.seconds),
            "ceiling_speedup": plain_s / (spec_s - timed.seconds),
            "self_draft_speedup": plain_s / spec_s,
            "acceptance": stats.accepted_tokens / max(stats.draft_tokens, 1),
            "tokens_per_verify": (stats.accepted_tokens + stats.verify_chunks)
            / max(stats.verify_chunks, 1), "draft_seconds": timed.seconds}


def draft_cost(target: LoadedModel, spec: str, k: int, max_tokens: int) -> dict[str, float]:
    draft = load_model(spec, device=DEVICE["name"], dtype=DEVICE["dtype"])
    engine, spec_s, timed = with_draft(target, draft, k, prompts(1, 128, 4), max_tokens, "d")
    stats = engine.stats
    verify_s = spec_s - timed.seconds
    out = {"k": k, "draft_ms_per_token": timed.seconds / max(timed.drafts, 1) * 1e3,
           "draft_ms_per_step": timed.seconds / max(stats.speculative_steps, 1) * 1e3,
           "target_ms_per_step": verify_s / max(stats.speculative_steps, 1) * 1e3,
           "acceptance": stats.accepted_tokens / max(stats.draft_tokens, 1),
           "tok_s_forced": max_tokens / spec_s}
    # The governor, measuring: with random weights nothing is kept, so it picks plain steps
    # (measured after a run that warmed it, as a worker's has been).
    engine.governor = SpeculationGovernor()
    generate(engine, prompts(1, 128, 6), max_tokens, "gw")
    engine.reset_stats()
    governed_s, _ = generate(engine, prompts(1, 128, 5), max_tokens, "g")
    out["tok_s_governed"] = max_tokens / governed_s
    out["governed_speculative_steps"] = engine.stats.speculative_steps
    out["governed_steps"] = engine.stats.steps
    return out


def step_costs(engine: Engine, b: int, k: int) -> dict[str, float]:
    """``b`` requests past 128-token prompts: the mean step time decoding, and verifying k
    drafts each (drafts set by hand: the cost, whatever is kept)."""
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts(b, 128, 7000 + b)):
        engine.add_request(EngineRequest(f"c{b}-{i}", ids, params))
    engine.governor = PLAIN
    while engine.num_running < b or engine.pending_prefill_tokens:
        engine.step()

    def steps(n: int, draft: bool) -> float:
        engine.speculator = Fixed([7] * k if draft else [])  # type: ignore[assignment]
        engine.governor = FORCED if draft else PLAIN
        engine.step()
        sync()
        start = time.perf_counter()
        for _ in range(n):
            engine.step()
        return (time.perf_counter() - start) / n

    decode, verify = steps(20, False), steps(20, True)
    for i in range(b):
        engine.abort(f"c{b}-{i}")
    while engine.has_unfinished():
        engine.step()
    return {"batch": b, "decode_step_ms": decode * 1e3, "verify_step_ms": verify * 1e3,
            "ratio": verify / decode}


def breakeven(target: LoadedModel, k: int, batches: list[int], max_tokens: int
              ) -> dict[str, object]:
    """Where speculation stops paying: per batch size the verify step's cost against the
    decode step's; a verify step gives 1 + a k tokens at acceptance a, so with a free draft
    it pays while the ratio is below that. Then the governor at each batch size with drafts
    that are never kept (it should switch them off: tok/s near plain's), against plain
    decoding and speculating in every step."""
    engine = speculative_engine(target.model, target.tokenizer, config(max(batches), k))
    generate(engine, prompts(2, 128, 3), 16, "warm")
    costs = []
    for b in batches:
        costs.append(step_costs(engine, b, k))
        print(json.dumps(costs[-1]), flush=True)
    pays: dict[str, int | None] = {}
    for a in (1.0, 0.8, 0.6):
        past = [c["batch"] for c in costs if c["ratio"] > 1 + a * k]
        pays[f"acceptance_{a}"] = min(past) if past else None  # first batch where it loses
    governed = []
    # One governor for the whole run, as a worker keeps its own; each size's measured burst
    # comes after one that warmed it (a fresh governor first measures both ways).
    learning = SpeculationGovernor()
    for b in batches:
        batch = prompts(b, 128, 100 + b)
        row: dict[str, float] = {"batch": b}
        for mode, governor in (("plain", PLAIN), ("forced", FORCED), ("governed", learning)):
            engine.governor = governor
            engine.speculator = Fixed([7] * k)  # type: ignore[assignment]
            if governor is learning:
                generate(engine, prompts(b, 128, 200 + b), max_tokens, f"w{b}-")
            engine.reset_stats()
            secs, _ = generate(engine, batch, max_tokens, f"g{b}-{mode}-")
            row[f"{mode}_tok_s"] = b * max_tokens / secs
            row[f"{mode}_speculative_steps"] = engine.stats.speculative_steps
            row[f"{mode}_steps"] = engine.stats.steps
        row["governed_vs_plain"] = row["governed_tok_s"] / row["plain_tok_s"]
        row["forced_vs_plain"] = row["forced_tok_s"] / row["plain_tok_s"]
        print(json.dumps(row), flush=True)
        governed.append(row)
    return {"step_costs": costs, "first_batch_not_paying": pays, "governor": governed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--draft", default="random:llama-3.2-1b", help="draft1b's draft model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    ap.add_argument("--only", nargs="+", default=["verify", "ceiling", "draft1b", "breakeven"])
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.device == "cpu":
        DEVICE.update(name="cpu", dtype=torch.float32)
    target = load_model(args.model, device=DEVICE["name"], dtype=DEVICE["dtype"])
    DEVICE["vocab"] = min(30000, target.config.vocab_size)
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    result: dict[str, object] = {**record.record(), "model": args.model, "device": name,
                                 "args": vars(args)}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    sections = {"verify": lambda: verify_cost(target, args.k),
                "ceiling": lambda: ceiling(target, args.k, args.max_tokens),
                "draft1b": lambda: draft_cost(target, args.draft, args.k, args.max_tokens),
                "breakeven": lambda: breakeven(target, args.k, args.batches, args.max_tokens)}
    for name in args.only:
        start = time.perf_counter()
        result[name] = sections[name]()
        print(name, f"{time.perf_counter() - start:.0f}s", json.dumps(result[name]), flush=True)
        save()
        if args.device != "cpu":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
