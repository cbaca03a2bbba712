"""tidegate on one GPU: ceilings, per-kernel bandwidth, engine throughput, and HF beside it.

One script, one device call: everything it measures goes to ``--out`` (JSON) and a short table
is printed last. Model: random weights of Llama-3-8B's shape (``random:llama-3-8b``), bf16,
``ignore_eos`` so every request produces exactly its length.

Sections (``--only`` picks some; default all but ``hf``):
  ceilings  device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3 matmul.
  kernels   each Triton kernel's achieved bandwidth (bytes it must move / time) vs the copy.
  batch1    one request, 128 prompt tokens, 256 output tokens: tok/s and model bandwidth
            utilisation (weights + KV bytes read per step / step time / copy bandwidth).
  profile1  where a batch-1 decode step's time goes: torch.profiler over 32 steps, device
            kernels summed by name, and the device's busy time against the wall.
  offline   1000 prompts 256 in / 256 out, all submitted at once: output tok/s.
  mixed     256 prompts, input and output lengths uniform in 100-1024: output tok/s.
  hfset     tidegate on the prompt set of ``hf`` (256 prompts, 256 in / 256 out).
  kv_fp8_batch1: batch1 with the FP8 (e4m3) KV cache; both report the cache's tokens.
  int4_batch1, int4_offline, int8_batch1: batch1 / offline with the projections quantized in
            memory to weight-only INT4 (groups of 128) or INT8 (per channel), round to nearest.
  int4_profile1: profile1 on the INT4 model.
  fp8_batch1, fp8_offline, fp8_offline_kv8: the projections in FP8 (e4m3, a scale per output
            channel; W8A8 with per-token activation scales beyond two rows), the last one with
            the FP8 KV cache too.
  hf        HF transformers ``generate_batch`` (its continuous batching) on 256 prompts of
            256 in / 256 out, same weights shape, same GPU.

    python -m tidegate.benchmarks.engine.gpu_throughput --out $OUT/gpu.json
    python -m tidegate.benchmarks.engine.gpu_throughput --only ceilings kernels batch1
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.benchmarks.harness.measure.cuda_timing import cuda_time_ms  # noqa: E402
from tidegate.kernels import ops  # noqa: E402
from tidegate.kernels.gpu.paged_attention_triton import default_num_splits  # noqa: E402
from tidegate.protocol import SamplingParams  # noqa: E402
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from tidegate.worker.models.loaders.loader import load_model  # noqa: E402

# Quantized sections: the same random model, its projections quantized in memory (round to
# nearest; INT4 in groups of 128, INT8 per channel, FP8 per channel), after the bf16 sections:
# name -> (bits or "fp8", group, section, KV cache dtype).
INT_SECTIONS = {"int4_batch1": (4, 128, "batch1", "auto"),
                "int4_profile1": (4, 128, "profile1", "auto"),
                "int4_offline": (4, 128, "offline", "auto"),
                "int8_batch1": (8, None, "batch1", "auto"),
                "fp8_batch1": ("fp8", None, "batch1", "auto"),
                "fp8_offline": ("fp8", None, "offline", "auto"),
                "fp8_offline_kv8": ("fp8", None, "offline", "fp8")}
SECTIONS = ("ceilings", "kernels", "batch1", "kv_fp8_batch1", "profile1", "offline", "mixed",
            "hfset", "hf", *INT_SECTIONS)
MODEL = "random:llama-3-8b"


# ---------------------------------------------------------------- ceilings and kernels


def ceilings() -> dict[str, float]:
    n = 1 << 30  # 2 GiB of bf16 each way, far past the 60 MB L2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    copy_tbs = 2 * src.numel() * src.element_size() / ms / 1e9
    src = dst = torch.empty(0, device="cuda")  # free the 4 GiB before the matmul
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = cuda_time_ms(lambda: a @ b, iters=10)
    return {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": 2 * 8192**3 / ms / 1e9}


def kernel_bandwidth(copy_tbs: float) -> list[dict[str, object]]:
    """Bytes each kernel must move (inputs read once, outputs written once) over its time."""
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict[str, object]] = []

    def record(name: str, nbytes: int, fn: Callable[[], object]) -> None:
        ms = cuda_time_ms(fn, iters=50)
        tbs = nbytes / ms / 1e9
        rows.append({"kernel": name, "ms": ms, "TBps": tbs, "of_copy": tbs / copy_tbs})

    t, h, inter = 8192, 4096, 14336
    x = torch.randn(t, h, device=dev, dtype=bf, generator=g)
    res = torch.randn(t, h, device=dev, dtype=bf, generator=g)
    w = torch.randn(h, device=dev, dtype=bf, generator=g)
    record(f"rms_norm+residual T={t} H={h}", 4 * t * h * 2, lambda: ops.rms_norm(x, w, 1e-5, res))
    gu = torch.randn(t, 2 * inter, device=dev, dtype=bf, generator=g)
    record(f"silu_and_mul T={t} I={inter}", 3 * t * inter * 2, lambda: ops.silu_and_mul(gu))
    hq, hk, d = 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=bf, generator=g)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    pos = torch.randint(0, 8192, (t,), device=dev, generator=g)
    cache = torch.randn(8192, d, device=dev, dtype=torch.float32, generator=g)
    record(f"rotary q+k T={t}", 2 * t * (hq + hk) * d * 2 + t * d * 4,
           lambda: ops.rotary(q, k, pos, cache))
    blocks, bs = 8192, 16
    kc = torch.zeros(blocks, bs, hk, d, device=dev, dtype=bf)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(blocks * bs, device=dev, generator=g)[:t]
    record(f"store_kv T={t}", 2 * 2 * t * hk * d * 2, lambda: ops.store_kv(k, v, kc, vc, slots))
    for batch, ctx in ((1, 4096), (64, 1024), (256, 1024), (256, 2048)):
        width = -(-ctx // bs)
        tables = torch.randint(0, blocks, (batch, width), device=dev, generator=g,
                               dtype=torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        qd = torch.randn(batch, hq, d, device=dev, dtype=bf, generator=g)
        splits = default_num_splits(ctx, batch, hk)
        record(f"paged_decode B={batch} ctx={ctx} splits={splits}",
               2 * batch * ctx * hk * d * 2 + 2 * batch * hq * d * 2,
               lambda qd=qd, tables=tables, lens=lens, splits=splits: ops.paged_decode(
                   qd, kc, vc, tables, lens, d**-0.5, splits))
    return rows


# ---------------------------------------------------------------- engine


def make_engine(loaded, max_num_seqs: int, batched_tokens: int, max_model_len: int,
                kv_cache_dtype: str = "auto") -> Engine:
    # The previous engine's KV cache and graph pools go back first: the new one sizes its cache
    # from the memory free now.
    gc.collect()
    torch.cuda.empty_cache()
    return Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched_tokens, kv_cache_dtype=kv_cache_dtype))


def run_requests(engine: Engine, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    for i, (prompt, out_len) in enumerate(reqs):
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(
            max_tokens=out_len, ignore_eos=True)))
    torch.cuda.synchronize()
    start = time.perf_counter()
    first: dict[str, float] = {}
    produced = 0
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.token_id is not None:
                produced += 1
    wall = time.perf_counter() - start
    ttft = sorted(t - start for t in first.values())
    return {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall,
            "steps": steps, "ttft_p50_s": ttft[len(ttft) // 2], "requests": len(reqs)}


def random_prompts(rng: random.Random, n: int, lo: int, hi: int, out_lo: int, out_hi: int,
                   vocab: int) -> list[tuple[list[int], int]]:
    return [([rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(lo, hi))],
             rng.randint(out_lo, out_hi)) for _ in range(n)]


def batch1(loaded, copy_tbs: float, kv_cache_dtype: str = "auto") -> dict[str, float]:
    engine = make_engine(loaded, 8, 2048, 4096, kv_cache_dtype)
    rng = random.Random(1)
    vocab = loaded.config.vocab_size
    run_requests(engine, random_prompts(rng, 1, 128, 128, 16, 16, vocab))  # warm
    res = run_requests(engine, random_prompts(rng, 1, 128, 128, 256, 256, vocab))
    # Decode-only time per token: the wall minus the prefill step, over the decode steps.
    tok_s = (res["output_tokens"] - 1) / (res["wall_s"] - res["ttft_p50_s"])
    cfg = loaded.config
    weight_bytes = loaded.weight_bytes()  # integer matrices as stored
    # The embedding table is read one row per token, not streamed.
    weight_bytes -= loaded.model.embed_tokens.weight.numel() * 2
    # Experts: one token reads only its own (batch 1, bf16).
    weight_bytes -= (cfg.num_params() - cfg.active_params()) * 2
    kv_per_token = (cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
                    * (1 if kv_cache_dtype == "fp8" else 2))
    avg_ctx = 128 + 128
    step_bytes = weight_bytes + kv_per_token * avg_ctx
    mbu = step_bytes * tok_s / (copy_tbs * 1e12)
    return {**res, "decode_tok_s": tok_s, "bytes_per_step": step_bytes, "mbu": mbu,
            "kv_cache_tokens": engine.kv_spec.num_tokens, "kv_cache_gib": engine.kv_spec.gib}


def profile1(loaded) -> dict[str, object]:
    from torch.profiler import ProfilerActivity, profile

    engine = make_engine(loaded, 8, 2048, 4096)
    rng = random.Random(5)
    for prompt, _ in random_prompts(rng, 1, 128, 128, 1, 1, loaded.config.vocab_size):
        engine.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=200,
                                                                     ignore_eos=True)))
    for _ in range(40):
        engine.step()
    torch.cuda.synchronize()
    steps = 32
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or 0
        if device_us > 0:
            kernels[event.key[:80]] = device_us / steps
    busy = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {"wall_us_per_step": 1e6 * wall / steps, "device_busy_us_per_step": busy,
            "top_kernels_us_per_step": top}


def offline(loaded, kv_cache_dtype: str = "auto") -> dict[str, float]:
    engine = make_engine(loaded, 1024, 16384, 4096, kv_cache_dtype)
    rng = random.Random(2)
    reqs = random_prompts(rng, 1000, 256, 256, 256, 256, loaded.config.vocab_size)
    # Warm with other prompts (no prefix-cache hits later), enough of them that steps mix
    # decodes with prompt chunks: the eager mixed step's kernels compile here, not in the run.
    warm = random_prompts(random.Random(12), 96, 256, 256, 16, 16, loaded.config.vocab_size)
    run_requests(engine, warm)
    return {**run_requests(engine, reqs), **decode_device_ms(engine, loaded)}


def decode_device_ms(engine: Engine, loaded) -> dict[str, float]:
    """The device's own time for a full decode step (the largest captured graph, replayed on
    the run's last inputs, plus the LM head over its rows), against which a run's wall time per
    step says whether the host or the device set the pace."""
    graphs = engine.runner.graphs
    if graphs is None:
        return {}
    captured = graphs._graphs[(max(graphs.sizes), False)]  # without adapters
    ms = cuda_time_ms(captured.graph.replay, iters=10)
    head_ms = cuda_time_ms(lambda: loaded.model.compute_logits(captured.hidden), iters=10)
    return {"decode_graph_ms": ms, "decode_lm_head_ms": head_ms,
            "decode_batch": max(graphs.sizes)}


def mixed(loaded) -> dict[str, float]:
    engine = make_engine(loaded, 256, 16384, 4096)
    rng = random.Random(3)
    reqs = random_prompts(rng, 256, 100, 1024, 100, 1024, loaded.config.vocab_size)
    return run_requests(engine, reqs)


def hf_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(256)] for _ in range(256)]


def hfset(loaded) -> dict[str, float]:
    engine = make_engine(loaded, 256, 16384, 4096)
    run_requests(engine, [(p, 16) for p in hf_prompts(loaded.config.vocab_size)[:32]])  # warm
    return run_requests(engine, [(p, 256) for p in hf_prompts(loaded.config.vocab_size)])


def hf_generate_batch() -> dict[str, float]:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from tidegate.model_files.model_source import preset_config

    p = preset_config("llama-3-8b")
    cfg = LlamaConfig(
        vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"], num_hidden_layers=p["num_layers"],
        num_attention_heads=p["num_heads"], num_key_value_heads=p["num_kv_heads"],
        head_dim=p["head_dim"], rms_norm_eps=p["rms_norm_eps"], rope_theta=p["rope_theta"],
        max_position_embeddings=p["max_position_embeddings"], tie_word_embeddings=False,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16,
                                              attn_implementation="paged|sdpa")
    model.eval()
    inputs = hf_prompts(p["vocab_size"])
    gen = GenerationConfig(max_new_tokens=256, min_new_tokens=256, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate_batch(inputs=inputs, generation_config=gen)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in out.values())
    return {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=SECTIONS,
                    default=[s for s in SECTIONS if s != "hf"])
    ap.add_argument("--out", default="gpu.json")
    ap.add_argument("--model", default=MODEL,
                    help="a random preset of any family, e.g. random:qwen2.5-7b, "
                         "random:mixtral-8x7b (default %(default)s)")
    args = ap.parse_args()
    results: dict[str, object] = {
        **record.record(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "model": args.model}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=1, default=float))

    ceil = ceilings()
    results["ceilings"] = ceil
    save()
    copy_tbs = ceil["copy_TBps"]
    if "kernels" in args.only:
        results["kernels"] = kernel_bandwidth(copy_tbs)
        save()
    loaded = None
    if {"batch1", "kv_fp8_batch1", "profile1", "offline", "mixed", "hfset"} & set(args.only):
        torch.manual_seed(0)
        loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    for name, fn in (("batch1", lambda: batch1(loaded, copy_tbs)),
                     ("kv_fp8_batch1", lambda: batch1(loaded, copy_tbs, "fp8")),
                     ("profile1", lambda: profile1(loaded)),
                     ("offline", lambda: offline(loaded)), ("mixed", lambda: mixed(loaded)),
                     ("hfset", lambda: hfset(loaded))):
        if name in args.only:
            results[name] = fn()
            save()
            print(name, json.dumps(results[name], default=float), flush=True)
    quantized_as = None
    for name, (bits, group, section, kv) in INT_SECTIONS.items():
        if name not in args.only:
            continue
        from tidegate.worker.models.online_quantization import quantize_loaded

        if quantized_as is not None and quantized_as != (bits, group):
            loaded = None  # the bf16 weights are gone: load them again
        if loaded is None or quantized_as != (bits, group):
            if loaded is None:
                gc.collect()
                torch.cuda.empty_cache()
                torch.manual_seed(0)
                loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16)
            quantize_loaded(loaded.model, bits, group)
            gc.collect()
            torch.cuda.empty_cache()
            quantized_as = (bits, group)
        if section == "batch1":
            res = batch1(loaded, copy_tbs, kv)
        elif section == "profile1":
            res = profile1(loaded)
        else:
            res = offline(loaded, kv)
        results[name] = {**res, "weight_bytes": loaded.weight_bytes(),
                         "types": loaded.packed_types()}
        save()
        print(name, json.dumps(results[name], default=float), flush=True)
    if "hf" in args.only:
        del loaded
        torch.cuda.empty_cache()
        try:
            results["hf_generate_batch"] = hf_generate_batch()
        except Exception as exc:  # noqa: BLE001 - report, keep the rest of the results
            results["hf_generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        save()
    print(f"device {results['device']}; copy {ceil['copy_TBps']:.2f} TB/s; "
          f"bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    for row in results.get("kernels", []):  # type: ignore[union-attr]
        print(f"  {row['kernel']:<44} {row['ms']:8.3f} ms {row['TBps']:5.2f} TB/s "
              f"({100 * row['of_copy']:.0f}% of copy)")
    for name in ("batch1", "kv_fp8_batch1", "profile1", "offline", "mixed", "hfset",
                 "hf_generate_batch",
                 *INT_SECTIONS):
        if name in results:
            print(name, {k: (round(v, 3) if isinstance(v, float) else v)
                         for k, v in results[name].items()})  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
