"""LoRA adapters against the base model: the engine alone, in one process.

The issue's targets, on the H200 with Llama-3-8B's shape and rank-16 adapters on every
projection: 1000 requests of 256 prompt / 256 output tokens with 8 adapters mixed uniformly
keep >= 80% of the base model's output tok/s, and one request alone with an adapter keeps
>= 90% of its decode speed without.

``write-adapters`` writes PEFT adapter directories (``adapter_config.json`` and
``adapter_model.safetensors``, as ``peft`` saves them) of a preset's shape with random
matrices; the worker and ``run`` load them as any PEFT adapter. ``run``: one engine
(``--max-num-seqs`` 256, ``max_loras`` = the adapter count), warmed up, then, each on fresh
prompts (no prefix-cache hits between runs), greedy and ``ignore_eos``:
  base        no request has an adapter;
  mixed       request i runs adapter i mod N (N = ``--adapters`` directories);
  base_again  the base once more: the spread between the two base runs is the noise;
  one_base    one request alone (``--single-output-len`` tokens), the base model;
  one_lora    the same with an adapter.
Per run: output tok/s, its ratio to the base's, the mean step time. On CUDA also the device
time of one batch-1 and one full-batch decode step (its CUDA graph replayed) with and without
adapters.

    python -m tidegate.benchmarks.engine.lora_throughput write-adapters /tmp/adapters --preset llama-3-8b
    python -m tidegate.benchmarks.engine.lora_throughput run --model random:llama-3-8b --adapters /tmp/adapters/* \\
        --out $OUT/lora_offline_h200.json
    # this CPU machine
    python -m tidegate.benchmarks.engine.lora_throughput write-adapters /tmp/adapters --preset tiny --count 3
    python -m tidegate.benchmarks.engine.lora_throughput run --model random:tiny --adapters /tmp/adapters/* \\
        --device cpu --requests 24 --max-num-seqs 8 --input-len 32 --output-len 16
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]

from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.protocol import SamplingParams  # noqa: E402
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(out: Path, preset: str, count: int, rank: int, seed: int) -> list[Path]:
    """``count`` PEFT adapter directories of ``preset``'s shape, every projection targeted."""
    from safetensors.torch import save_file

    from tidegate.worker.models.loaders.random_weights import preset_llama_config

    cfg = preset_llama_config(preset)
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    paths = []
    for n in range(count):
        path = out / f"adapter{n}"
        path.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(seed + n)
        tensors = {}
        for layer in range(cfg.num_layers):
            for proj, (rows, cols) in shapes.items():
                part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                # Scaled so each adapter moves the projection's output by a few percent.
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, cols, generator=g) / cols ** 0.5).to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(rows, rank, generator=g) * 0.02).to(torch.bfloat16)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS), "bias": "none", "task_type": "CAUSAL_LM"}))
        paths.append(path)
        print(f"{path}: rank {rank}, {len(tensors)} matrices", flush=True)
    return paths


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    lo, hi = min(1000, vocab // 4), vocab - 1
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def run_batch(engine: Engine, label: str, prompt_ids: list[list[int]], out_len: int,
              adapters: list[str | None]) -> dict[str, Any]:
    """Every request added at once, stepped to the end."""
    for i, (ids, adapter) in enumerate(zip(prompt_ids, adapters, strict=True)):
        engine.add_request(EngineRequest(f"{label}-{i}", ids, SamplingParams(
            max_tokens=out_len, ignore_eos=True), adapter=adapter))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    produced = steps = 0
    lens: list[int] = []
    # Wall time of the steps that computed prompt tokens and of the decode-only ones (with
    # steps queued ahead, a step's wall is the host's wait for it: its device time, or more).
    split = {"prefill_steps": 0, "prefill_s": 0.0, "decode_steps": 0, "decode_s": 0.0}
    while engine.has_unfinished():
        before, t0 = engine.stats.prompt_tokens_computed, time.perf_counter()
        outs = engine.step()
        kind = "prefill" if engine.stats.prompt_tokens_computed > before else "decode"
        split[f"{kind}_steps"] += 1
        split[f"{kind}_s"] += time.perf_counter() - t0
        steps += 1
        for o in outs:
            produced += o.token_id is not None
            if o.finish_reason is not None:
                lens.append(o.num_output_tokens)
    wall = time.perf_counter() - start
    return {"requests": len(prompt_ids), "adapters": len({a for a in adapters if a}),
            "wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall,
            "steps": steps, "step_ms": 1000 * wall / steps,
            "output_len_mean": statistics.fmean(lens), **split}


def device_times(engine: Engine, batch: int, adapters: list[str]) -> dict[str, float]:
    """One decode step's device time from its CUDA graph, without and with adapters (rows
    cycling through ``adapters``), at ``batch`` rows."""
    from tidegate.benchmarks.harness.measure.cuda_timing import cuda_time_ms

    graphs = engine.runner.graphs
    assert graphs is not None and engine.lora is not None
    size = graphs.padded_size(batch)
    assert size is not None
    slots = engine.lora.slots_for(adapters)
    graphs.adapters[:size] = torch.tensor(
        [slots[adapters[r % len(adapters)]] for r in range(size)], device="cuda")
    out = {}
    for with_lora in (False, True):
        graph = graphs._graphs[(size, with_lora)].graph
        out[f"decode_b{size}_{'lora' if with_lora else 'base'}_ms"] = cuda_time_ms(
            graph.replay, iters=50)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tidegate.worker.models.loaders.loader import load_model

    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    loaded = load_model(args.model, device=device, dtype=dtype)
    names = [Path(p).name for p in args.adapters]
    results: dict[str, Any] = {
        **record.record(), "model": args.model, "device": device,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "adapters": names,
        "shape": {"requests": args.requests, "input_len": args.input_len,
                  "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
                  "max_num_batched_tokens": args.max_num_batched_tokens},
        "runs": {}}
    gc.collect()
    t0 = time.perf_counter()
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_loras=len(names),
        max_lora_rank=args.max_lora_rank))
    results["engine_s"] = time.perf_counter() - t0
    results["kv_cache"] = engine.kv_spec.describe()
    assert engine.lora is not None
    results["lora_slots_mb"] = engine.lora.weights.nbytes / 1e6
    t0 = time.perf_counter()
    for name, path in zip(names, args.adapters, strict=True):
        engine.add_adapter(name, path)
    results["adapters_load_s"] = time.perf_counter() - t0
    vocab = loaded.tokenizer.vocab_size
    warm = max(8, min(96, args.requests // 4))
    run_batch(engine, "warm", prompts(random.Random(99), warm, args.input_len, vocab),
              min(16, args.output_len), [names[i % len(names)] if i % 2 else None
                                         for i in range(warm)])
    save = _saver(args, results)
    n = args.requests
    plans: dict[str, tuple[int, int, list[str | None]]] = {
        "base": (n, args.output_len, [None] * n),
        "mixed": (n, args.output_len, [names[i % len(names)] for i in range(n)]),
        "base_again": (n, args.output_len, [None] * n),
        "one_base": (1, args.single_output_len, [None]),
        "one_lora": (1, args.single_output_len, [names[0]]),
    }
    for k, (kind, (count, out_len, adapters)) in enumerate(plans.items()):
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        res = run_batch(engine, kind, prompts(random.Random(k), count, args.input_len, vocab),
                        out_len, adapters)
        if profile is not None:  # where the host's time goes, for base against mixed
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(18)
        results["runs"][kind] = res
        ref = results["runs"].get("one_base" if kind.startswith("one") else "base")
        if ref is not None:
            res["ratio_to_base"] = res["output_tok_s"] / ref["output_tok_s"]
        print(f"{kind:>10}: {res['output_tok_s']:9.1f} tok/s  step {res['step_ms']:.2f} ms  "
              f"{res['prefill_steps']} prefill steps {res['prefill_s']:.2f} s, "
              f"{res['decode_steps']} decode {res['decode_s']:.2f} s"
              + (f"  x{res['ratio_to_base']:.3f} of base" if ref is not None else ""),
              flush=True)
        save()
    if device.startswith("cuda") and engine.runner.graphs is not None:
        results["device_ms"] = {**device_times(engine, 1, names[:1]),
                                **device_times(engine, args.max_num_seqs, names)}
        print(results["device_ms"], flush=True)
    save()
    return results


def _saver(args: argparse.Namespace, results: dict[str, Any]):  # noqa: ANN202
    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=2))
    return save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-adapters")
    w.add_argument("out", type=Path)
    w.add_argument("--preset", default="llama-3-8b")
    w.add_argument("--count", type=int, default=8)
    w.add_argument("--rank", type=int, default=16)
    w.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("--model", default="random:llama-3-8b")
    r.add_argument("--adapters", nargs="+", required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--requests", type=int, default=1000)
    r.add_argument("--input-len", type=int, default=256)
    r.add_argument("--output-len", type=int, default=256)
    r.add_argument("--single-output-len", type=int, default=256)
    r.add_argument("--max-num-seqs", type=int, default=256)
    r.add_argument("--max-num-batched-tokens", type=int, default=16384)
    r.add_argument("--max-model-len", type=int, default=2048)
    r.add_argument("--max-lora-rank", type=int, default=16)
    r.add_argument("--profile", action="store_true",
                   help="print each run's host profile (cProfile, by own time)")
    r.add_argument("--out")
    args = ap.parse_args()
    if args.cmd == "write-adapters":
        write_adapters(args.out, args.preset, args.count, args.rank, args.seed)
    else:
        run(args)


if __name__ == "__main__":
    main()
