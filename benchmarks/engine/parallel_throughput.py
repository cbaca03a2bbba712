"""Tensor- and pipeline-parallel engines against one process: the engine alone, rank 0 in this
process and the other ranks as the worker starts them (``start_parallel_engine``).

Per layout (``--layouts 1x1 2x1 1x2``, TP x PP): one engine, warmed up, then on fresh prompts
(greedy, ``ignore_eos``):
  offline  ``--requests`` requests of ``--input-len`` / ``--output-len`` tokens submitted at
           once: output tok/s and the steps that overlapped in the pipeline;
  batch1   one request of ``--single-output-len`` tokens alone: decode tok/s, and on CUDA the
           model-bandwidth utilisation (each rank's weight bytes read once per token over the
           time, against ``--copy-gbps`` per device: the measured copy bandwidth).
The targets (issue: the multi-GPU run, on two H200s): Llama-3-8B shape TP=2 batch-1 >= 1.7x
TP=1; PP=2 throughput >= 1.6x one device; Llama-3-70B shape TP=2 batch-1 MBU >= 75%.

    python -m tidegate.benchmarks.engine.parallel_throughput --model random:llama-3-8b --device cuda \\
        --layouts 1x1 2x1 1x2 --copy-gbps 4000 --out $OUT/parallel_8b.json
    # this CPU machine (gloo): the mechanism, not the speed
    python -m tidegate.benchmarks.engine.parallel_throughput --model random:smollm2-135m --layouts 1x1 3x1 1x2 \\
        --requests 16 --input-len 64 --output-len 32 --single-output-len 32 --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from tidegate.protocol import SamplingParams  # noqa: E402
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from tidegate.worker.models.loaders.loader import load_model  # noqa: E402
from tidegate.worker.parallel.layout import ParallelLayout  # noqa: E402
from tidegate.worker.parallel.parallel_engine import start_parallel_engine  # noqa: E402


def build(args: argparse.Namespace, layout: ParallelLayout) -> Engine:
    config = EngineConfig(max_model_len=args.input_len + max(args.output_len,
                                                             args.single_output_len) + 16,
                          max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_gb=args.kv_cache_gb, cuda_graphs=not args.no_cuda_graphs)
    if layout.world == 1:
        loaded = load_model(args.model, device=args.device, packed=False)
        return Engine(loaded.model, loaded.tokenizer, config)
    return start_parallel_engine(args.model, layout, config, device=args.device,
                                 torch_threads=args.torch_threads)


def prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run(engine: Engine, reqs: list[list[int]], output_len: int, tag: str) -> tuple[float, int]:
    """Seconds from submitting ``reqs`` to their last token, and output tokens."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(reqs):
        engine.add_request(EngineRequest(f"{tag}-{i}", ids, params))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(o.token_id is not None for o in engine.step())
    return time.perf_counter() - start, tokens


def weight_bytes(engine: Engine) -> int:
    model = engine.runner.runner.model if engine.runner.ranks > 1 else engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure(args: argparse.Namespace, spec: str) -> dict[str, object]:
    tp, pp = (int(x) for x in spec.split("x"))
    layout = ParallelLayout(tp, pp)
    t0 = time.perf_counter()
    engine = build(args, layout)
    start_s = time.perf_counter() - t0
    vocab = engine.grammars.vocab_size
    rng = random.Random(0)
    try:
        run(engine, prompts(min(4, args.requests), args.input_len, vocab, rng), 8, "warm")
        engine.reset_stats()
        secs, tokens = run(engine, prompts(args.requests, args.input_len, vocab, rng),
                           args.output_len, "offline")
        stats = engine.stats
        offline = {"seconds": secs, "output_tokens": tokens, "tok_s": tokens / secs,
                   "steps": stats.steps, "overlapped_steps": stats.overlapped_steps}
        secs1, tokens1 = run(engine, prompts(1, args.input_len, vocab, rng),
                             args.single_output_len, "one")
        batch1: dict[str, object] = {"seconds": secs1, "tok_s": tokens1 / secs1}
        if args.device.startswith("cuda") and args.copy_gbps:
            # Every rank streams its own weights once per token: bandwidth used per device.
            per_rank = weight_bytes(engine)
            batch1["mbu"] = per_rank * tokens1 / secs1 / (args.copy_gbps * 1e9)
    finally:
        engine.close()
    return {"layout": spec, "tp": tp, "pp": pp, "start_s": start_s, "offline": offline,
            "batch1": batch1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"], metavar="TPxPP")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--single-output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-gb", type=float)
    ap.add_argument("--torch-threads", type=int)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--copy-gbps", type=float, help="measured copy bandwidth of one device")
    ap.add_argument("--out")
    args = ap.parse_args()
    results = []
    for spec in args.layouts:
        r = measure(args, spec)
        print(json.dumps(r), flush=True)
        results.append(r)
    base = results[0]
    for r in results[1:]:
        for key in ("offline", "batch1"):
            r[key]["speedup"] = r[key]["tok_s"] / base[key]["tok_s"]  # type: ignore[index]
    report = {"model": args.model, "device": args.device, "torch": torch.__version__,
              "args": vars(args), "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"{r['layout']:>5}: offline {r['offline']['tok_s']:9.1f} tok/s "  # type: ignore[index]
              f"(x{r['offline'].get('speedup', 1.0):.2f}), batch-1 "  # type: ignore[union-attr]
              f"{r['batch1']['tok_s']:7.1f} tok/s (x{r['batch1'].get('speedup', 1.0):.2f})")  # type: ignore[index,union-attr]


if __name__ == "__main__":
    main()
