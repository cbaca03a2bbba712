"""Speculative decoding's costs on a GPU, engine alone: the issue's H200 figures.

Random weights of the Llama-3-8B shape in bf16 (random weights give no real acceptance, so the
mechanism's costs are what is measured), one CUDA device:

- ``verify``: batch 1 past a 512-token prompt, a K-draft verify step against a decode step
  (drafts set by hand), both read back every step; the verify step replays the decode graph of
  K + 1 rows.
- ``ceiling``: batch 1, drafts that always agree: the target drafting for itself
  (``speculative="draft"`` with the target as the draft model). Tok/s against plain decoding,
  as served (the draft's passes cost what the target's do) and with the draft's time taken out
  (a free draft that always agrees: the mechanism's ceiling).
- ``draft1b``: the Llama-3.2-1B shape as the draft model of the 8B target: the draft's time per
  proposed token at batch 1, against the target's decode step.
- ``breakeven``: drafts that agree and cost nothing (an oracle replaying the plain run's
  tokens) at batch sizes 1..256: forced speculation against plain decoding, and the governor's
  own choice (``SpeculationGovernor``), which is to follow the faster of the two.

    python benchmarks/speculative_gpu.py --out $OUT/speculative_gpu.json
    python benchmarks/speculative_gpu.py --device cpu --model random:tiny --draft random:tiny \
        --batches 1 4 --max-tokens 16      # the script itself, checked on a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tidegate.protocol import SamplingParams  # noqa: E402
from worker.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from worker.engine.sequence import Sequence  # noqa: E402
from worker.models.loaders.loader import LoadedModel, load_model  # noqa: E402
from worker.speculative.speculation_governor import SpeculationGovernor  # noqa: E402

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


class Oracle:
    """Drafts what the plain run generated next: agrees while the request's tokens are the
    plain run's (bf16 rounding may part them at a near-tie; then it drafts nothing)."""

    def __init__(self, recorded: dict[str, list[int]], k: int) -> None:
        self.recorded, self.k = recorded, k

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        out = []
        for seq, limit in wanted:
            rec, n = self.recorded.get(seq.request_id, []), len(seq.output_ids)
            same = rec[:n] == seq.output_ids
            out.append(rec[n : n + min(self.k, limit)] if same else [])
        return out

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


def config(batch: int, k: int, speculative: str | None = "ngram") -> EngineConfig:
    """No prefix cache: a run after another of the same prompts computes them again."""
    return EngineConfig(max_model_len=2048, max_num_seqs=batch, async_output=False,
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
    engine = Engine(target.model, target.tokenizer, config(1, k))
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
    engine = Engine(target.model, target.tokenizer, config(1, k, speculative="draft"),
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
    # The governor, measuring: with random weights nothing is kept, so it picks plain steps.
    engine.governor = SpeculationGovernor()
    engine.reset_stats()
    governed_s, _ = generate(engine, prompts(1, 128, 5), max_tokens, "g")
    out["tok_s_governed"] = max_tokens / governed_s
    out["governed_speculative_steps"] = engine.stats.speculative_steps
    out["governed_steps"] = engine.stats.steps
    return out


def breakeven(target: LoadedModel, k: int, batches: list[int], max_tokens: int
              ) -> list[dict[str, float]]:
    engine = Engine(target.model, target.tokenizer, config(max(batches), k))
    generate(engine, prompts(2, 128, 3), 16, "warm")
    rows = []
    for b in batches:
        batch = prompts(b, 128, 100 + b)
        engine.governor = PLAIN
        plain_s, recorded = generate(engine, batch, max_tokens, f"b{b}-")
        row: dict[str, float] = {"batch": b, "plain_tok_s": b * max_tokens / plain_s}
        for mode, governor in (("forced", FORCED), ("governed", SpeculationGovernor())):
            engine.governor = governor
            engine.speculator = Oracle(recorded, k)  # type: ignore[assignment]
            engine.reset_stats()
            secs, _ = generate(engine, batch, max_tokens, f"b{b}-")
            stats = engine.stats
            row[f"{mode}_tok_s"] = b * max_tokens / secs
            row[f"{mode}_acceptance"] = stats.accepted_tokens / max(stats.draft_tokens, 1)
            row[f"{mode}_speculative_steps"] = stats.speculative_steps
            row[f"{mode}_steps"] = stats.steps
        row["forced_speedup"] = row["forced_tok_s"] / row["plain_tok_s"]
        row["governed_speedup"] = row["governed_tok_s"] / row["plain_tok_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


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
    result: dict[str, object] = {"model": args.model, "device": name, "args": vars(args)}

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
