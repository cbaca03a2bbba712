"""The engine alone on the benchmark's work: what a stack worker computes, with nothing around it.

serve.py runs this as a subprocess with worker 0's ``TIDEGATE_*`` environment, before any stack
process starts (on CUDA each engine takes ~90% of the GPU's free memory for its KV cache, so
the two must never overlap):

    python -m tidegate.benchmarks.harness.engine_alone SPEC.json OUT.json

The model and the engine come from the worker's own ``build_engine``, warmed up by its own
``calibrate``, loaded once for every run of the spec. A burst adds every prompt's token ids at
once, with the submit's sampling (greedy, ``ignore_eos``, ``max_tokens`` = output length, the
job's ``response_format``), and steps until all finish: output tok/s = generated tokens / wall
time from the first add. A
Poisson run adds each request at its arrival offset (the schedule the stack's load generator
submits on) and steps while anything runs: the same latencies as the stack's, measured from
each arrival, and the tokens/s it keeps up with while its pipeline is full.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidegate.benchmarks.harness.measure.cuda_timing import cuda_time_ms
from tidegate.benchmarks.harness.measure.metrics import Dist
from tidegate.protocol import SamplingParams, now_ms
from tidegate.settings import load_settings
from tidegate.worker.engine.engine import Engine, EngineRequest
from tidegate.worker.service.service import build_engine, pace_steps
from tidegate.worker.shedding.calibration import calibrate, timed_step
from tidegate.worker.shedding.load_shedder import LoadShedder, ShedderConfig


def params_of(n: int, formats: list[dict[str, Any] | None] | None, i: int) -> SamplingParams:
    """A job's sampling as the load generator submits it."""
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                          response_format=formats[i] if formats else None)


def run(engine: Engine, prompts: list[list[int]], output_lens: list[int],
        timeout_s: float, *, cuda: bool,
        shedder: LoadShedder, formats: list[dict[str, Any] | None] | None = None
        ) -> dict[str, object]:
    """All requests added at once, stepped to the end: throughput and per-request latencies.
    Each step is timed into ``shedder``, as the worker times its steps (its step budget
    follows them)."""
    deadline = now_ms() + int(1000 * timeout_s)  # as the stack's jobs carry theirs
    params = [params_of(n, formats, i) for i, n in enumerate(output_lens)]  # formats compile
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"bench-{i}", ids, params[i], deadline_ms=deadline))
    first: dict[str, float] = {}
    finished: dict[str, tuple[float, int, str, str | None]] = {}
    while engine.has_unfinished():
        outputs = timed_step(engine, shedder)
        now = time.perf_counter()
        for out in outputs:
            if out.token_id is not None:
                first.setdefault(out.request_id, now)
            if out.finish_reason is not None:
                finished[out.request_id] = (now, out.num_output_tokens, out.output_text,
                                            out.finish_reason)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ids = [f"bench-{i}" for i in range(len(prompts))]
    tokens = sum(finished[r][1] for r in ids)
    complete = sum(finished[r][1] == n and finished[r][3] == "length"
                   for r, n in zip(ids, output_lens, strict=True))
    grammar = engine.grammars.stats
    tpot = [(finished[r][0] - first[r]) / (finished[r][1] - 1) for r in ids
            if r in first and finished[r][1] > 1]
    return {
        "requests": len(prompts), "complete": complete, "output_tokens": tokens,
        "prompt_tokens": sum(len(p) for p in prompts), "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1),
        "ttft_ms": asdict(Dist.of([1000 * (first[r] - t0) for r in ids if r in first])),
        "tpot_ms": asdict(Dist.of([1000 * x for x in tpot])),
        "finish_reasons": dict(Counter(finished[r][3] for r in ids)),
        "grammar_masks": {"fills": grammar.fills, "rows": grammar.rows,
                          "seconds": round(grammar.seconds, 4)},
        "texts": [finished[r][2] for r in ids],
    }


def run_arrivals(engine: Engine, prompts: list[list[int]], output_lens: list[int],
                 offsets_s: list[float], timeout_s: float, *, cuda: bool,
                 shedder: LoadShedder, formats: list[dict[str, Any] | None] | None = None
                 ) -> dict[str, object]:
    """Each request added at its arrival offset; steps while any runs (``shedder``: as
    ``run``'s)."""
    order = sorted(range(len(prompts)), key=offsets_s.__getitem__)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    finished: dict[str, tuple[float, int]] = {}
    produced: list[tuple[float, int]] = []  # (time, tokens) per step
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished():
        now = time.perf_counter()
        while nxt < len(order) and t0 + offsets_s[order[nxt]] <= now:
            i = order[nxt]
            rid = f"bench-{i}"
            params = params_of(output_lens[i], formats, i)
            engine.add_request(EngineRequest(rid, prompts[i], params,
                                             deadline_ms=now_ms() + int(1000 * timeout_s)))
            arrival[rid] = t0 + offsets_s[i]
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, t0 + offsets_s[order[nxt]] - time.perf_counter()))
            continue
        outputs = timed_step(engine, shedder)
        now = time.perf_counter()
        made = 0
        for out in outputs:
            if out.token_id is not None:
                first.setdefault(out.request_id, now)
                made += 1
            if out.finish_reason is not None:
                finished[out.request_id] = (now, out.num_output_tokens)
        produced.append((now, made))
    if cuda:
        torch.cuda.synchronize()
    ids = list(arrival)
    tokens = sum(finished[r][1] for r in ids)
    wall = max(f for f, _ in finished.values()) - t0
    e2e = [finished[r][0] - arrival[r] for r in ids]
    # While the pipeline is full: from the first arrival plus the median E2E to the last one.
    lo, hi = t0 + min(offsets_s) + float(np.median(e2e)), t0 + max(offsets_s)
    span = max(offsets_s) - min(offsets_s)
    offered = (len(ids) - 1) / span * float(np.mean(output_lens)) if span > 0 else 0.0
    steady = (round(sum(n for t, n in produced if lo <= t <= hi) / (hi - lo) / offered, 3)
              if hi - lo >= 2.0 and offered > 0 else None)
    tpot = [(finished[r][0] - first[r]) / (finished[r][1] - 1) for r in ids
            if r in first and finished[r][1] > 1]
    return {
        "requests": len(ids), "output_tokens": tokens, "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1), "steady_delivered_share": steady,
        "ttft_ms": asdict(Dist.of([1000 * (first[r] - arrival[r]) for r in ids if r in first])),
        "tpot_ms": asdict(Dist.of([1000 * x for x in tpot])),
        "e2e_ms": asdict(Dist.of([1000 * x for x in e2e])),
    }


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    settings = load_settings()
    t0 = time.perf_counter()
    engine = build_engine(settings)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    shedder = LoadShedder(ShedderConfig(enabled=settings.load_shedding,
                                        safety=settings.shedding_safety))
    calibrate(engine, shedder)
    pace_steps(engine, shedder, settings)  # as the worker does
    formats = [f for work in spec["runs"].values() for f in work.get("formats") or () if f]
    if formats:
        warm_grammars(engine, formats)
    warm_s = time.perf_counter() - t0
    cuda = settings.device.startswith("cuda")
    results = {}
    for name, work in spec["runs"].items():
        engine.grammars.stats = type(engine.grammars.stats)()  # each run's masks alone
        if work.get("offsets_s") is None:
            result = run(engine, work["prompts"], work["output_lens"], spec["timeout_s"],
                         cuda=cuda, formats=work.get("formats"), shedder=shedder)
        else:
            result = run_arrivals(engine, work["prompts"], work["output_lens"],
                                  work["offsets_s"], spec["timeout_s"], cuda=cuda,
                                  formats=work.get("formats"), shedder=shedder)
        print(f"engine alone, {name}: {result['output_tok_s']} output tok/s "
              f"({result['output_tokens']} tokens in {result['wall_s']} s)", flush=True)
        results[name] = result | {"load_s": round(load_s, 2), "warmup_s": round(warm_s, 2),
                                  "device": settings.device,
                                  "kv_cache": engine.kv_spec.describe(),
                                  "engine_config": dict(asdict(engine.config).items())}
    if spec.get("roofline"):
        shape = spec["roofline"]
        try:
            results["roofline"] = roofline(engine, shape["mean_input"], shape["mean_output"],
                                           cuda=cuda)
        except RuntimeError as exc:  # reported, not the end of the runs measured already
            results["roofline"] = {"error": str(exc)}
        print(f"engine alone, roofline: {results['roofline']}", flush=True)
    Path(out_path).write_text(json.dumps(results))


ROOFLINE_DECODE_STEPS = 24


def roofline(engine: Engine, mean_input: float, mean_output: float, *, cuda: bool
             ) -> dict[str, float]:
    """What bounds a mix on this device, measured here: a large matrix product's rate (bf16
    8192^3 on CUDA, float32 1024^3 on the CPU), the model's FLOPs per prompt token (2 x the
    layers' matrix weights, attention over half the mean prompt, the LM head once a prompt),
    and the decode rate (tokens/s) at the batch the mix fills the KV cache with, each context
    the mean prompt plus half the mean output. ``roofline_req_s``: requests/s if prompts ran
    at that matrix rate and outputs at that decode rate, nothing else counted."""
    flop_s = _matmul_flop_s(cuda=cuda)
    model = engine.runner.model  # type: ignore[attr-defined]
    cfg = model.cfg
    # The layers' matrices run for every prompt token, the LM head for a prompt's last alone.
    layers = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)
    head = (model.lm_head or model.embed_tokens).weight.numel()
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * mean_input / 2
    flops_per_token = 2 * layers + attention + 2 * head / mean_input
    context = int(mean_input + mean_output / 2)
    decode = _decode_rate(engine, context, cuda=cuda)
    per_request_s = (mean_input * flops_per_token / flop_s
                     + mean_output / decode["decode_tok_s"])
    # What the engine's prompt steps reach of that matrix rate (the prefill that filled the
    # cache for the decode timing, its first decodes included): the share of the gap to the
    # roofline that prompt work explains.
    prefill_flop_s = decode["prefill_tok_s"] * flops_per_token
    return {"matmul_tflop_s": round(flop_s / 1e12, 2),
            "flops_per_prompt_token": round(flops_per_token), **decode,
            "prefill_tflop_s": round(prefill_flop_s / 1e12, 1),
            "prefill_share_of_matmul": round(prefill_flop_s / flop_s, 3),
            "decode_context": context,
            "mean_input": round(mean_input, 1), "mean_output": round(mean_output, 1),
            "roofline_req_s": round(1 / per_request_s, 2),
            **({"kernels": _kernels_or_error(engine, context)} if cuda else {})}


def _kernels_or_error(engine: Engine, context: int) -> dict[str, Any]:
    """The profile, or why there is none: the roofline measured already is kept either way."""
    try:
        return _step_kernels(engine, context)
    except Exception as exc:  # noqa: BLE001 - a profiler's failure is reported, not raised
        return {"error": f"{type(exc).__name__}: {exc}"}


def _matmul_flop_s(*, cuda: bool) -> float:
    """A bf16 8192^3 matrix product's rate on CUDA (the median of CUDA-event timings, as
    ``benchmarks/engine/gpu_throughput.py``'s ceilings), a float32 1024^3 one's on the CPU."""
    if cuda:
        a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in "ab")
        return 2 * 8192**3 / (cuda_time_ms(lambda: a @ b, iters=10) / 1000)
    a, b = (torch.randn(1024, 1024) for _ in "ab")
    a @ b  # warm-up
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    return 2 * 1024**3 * 10 / (time.perf_counter() - t0)


def _decode_rate(engine: Engine, context: int, *, cuda: bool) -> dict[str, float]:
    """Decode alone at the batch that fills the KV cache (every seat when it fits), each
    request ``context`` tokens in: ``ROOFLINE_DECODE_STEPS`` steps timed together, their
    tokens counted (a step that had nothing to compute, or one that ran prompt tokens, would
    mislead a per-step timing). Prompts are computed first, unmeasured; the requests are given
    tokens enough to outlast the timing (the first decode while the last are prefilled), and
    aborted after."""
    cfg = engine.config
    steps = ROOFLINE_DECODE_STEPS + 2
    batch = cfg.max_num_seqs
    for _ in range(2):  # the prefill's length depends on the batch, the batch on the reserve
        max_tokens = steps + 8 + -(-batch * context // cfg.max_num_batched_tokens)
        batch = max(1, min(cfg.max_num_seqs,
                           engine.kv_spec.num_tokens // (context + max_tokens + 16)))
    ids = _add_distinct(engine, "roofline", batch, context, max_tokens, salt=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = replace(engine.stats)
    t0 = time.perf_counter()
    while engine.pending_prefill_tokens:
        engine.step()
    sync()
    prefill_s = time.perf_counter() - t0
    prefilled = engine.stats.prompt_tokens_computed - start.prompt_tokens_computed
    for _ in range(2):
        engine.step()
    before = replace(engine.stats)
    state = (f"{engine.num_running} running, {engine.num_waiting} waiting, "
             f"{engine.pending_prefill_tokens} prompt tokens left")
    sync()
    t0 = time.perf_counter()
    decoded = 0  # the tokens the steps gave back, as a worker counts them
    for _ in range(ROOFLINE_DECODE_STEPS):
        decoded += sum(out.token_id is not None for out in engine.step())
    sync()
    wall = time.perf_counter() - t0
    stats = engine.stats
    ran = stats.steps - before.steps
    _abort_all(engine, ids)
    if not decoded:
        raise RuntimeError(f"roofline: {ROOFLINE_DECODE_STEPS} steps gave no token (batch "
                           f"{batch} of {context} tokens; before them {state}; the engine "
                           f"counted {ran} steps, {stats.decode_tokens - before.decode_tokens} "
                           f"decodes)")
    return {"decode_batch": round(decoded / max(ran, 1), 1), "decode_steps": ran,
            "decode_step_ms": round(1000 * wall / max(ran, 1), 3),
            "decode_tok_s": round(decoded / wall, 1),
            "decode_prompt_tokens": stats.prompt_tokens_computed - before.prompt_tokens_computed,
            "prefill_tok_s": round(prefilled / prefill_s, 1)}


PROFILED_STEPS = 3


def _step_kernels(engine: Engine, context: int) -> dict[str, Any]:
    """Where a CUDA decode step's device time goes (torch.profiler): ``PROFILED_STEPS`` steps
    at the roofline's batch of ``context``-token requests, their device time per step by
    kernel (the 12 largest) and by kind (matrix products, attention, the rest). One profiler
    session per process: a second one recorded no kernel here (torch 2.11)."""
    cfg = engine.config
    batch = max(1, min(cfg.max_num_seqs, engine.kv_spec.num_tokens // (context + 128)))
    # Enough tokens that the first requests still decode once the last are prefilled.
    max_tokens = PROFILED_STEPS + 8 + -(-batch * context // cfg.max_num_batched_tokens)
    ids = _add_distinct(engine, "profile", batch, context, max_tokens, salt=3)
    while engine.pending_prefill_tokens:
        engine.step()
    engine.step()
    before = engine.stats.decode_tokens
    profiled = _profiled(engine, PROFILED_STEPS)
    decoded = engine.stats.decode_tokens - before
    _abort_all(engine, ids)
    return {"decode": profiled | {"batch": round(decoded / PROFILED_STEPS, 1)}}


def _add_distinct(engine: Engine, tag: str, n: int, context: int, max_tokens: int, *,
                  salt: int) -> list[str]:
    """``n`` greedy requests of ``context``-token prompts that share no prefix with each other
    or with another ``salt``'s (no prefix-cache hit), generating ``max_tokens`` each."""
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        engine.add_request(EngineRequest(
            rid, [(7919 * salt * (i * context + j) + i + salt) % (vocab - 1) + 1
                  for j in range(context)], params))
    return ids


def _abort_all(engine: Engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def _profiled(engine: Engine, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels: Counter[str] = Counter()
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0) or 0
        if us > 0:
            kernels[event.key[:90]] += us / steps
    kinds: Counter[str] = Counter()
    for name, us in kernels.items():
        kinds[_kernel_kind(name)] += us
    return {"wall_ms_per_step": round(1000 * wall / steps, 2),
            "device_ms_per_step": round(sum(kernels.values()) / 1000, 2),
            "by_kind_ms": {k: round(us / 1000, 2) for k, us in kinds.most_common()},
            "top_kernels_ms": [[k, round(us / 1000, 3)] for k, us in kernels.most_common(12)]}


def _kernel_kind(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "matmul", "_linear")):
        return "matmul"
    if any(k in low for k in ("prefill_kernel", "decode_split", "decode_combine", "attention")):
        return "attention"
    return "other"


def warm_grammars(engine: Engine, formats: list[dict[str, Any]]) -> None:
    """A few short constrained requests before anything is measured, as the stack's warm-up
    jobs do for its worker: the grammar engine's token tables, each format's grammar (a few
    at most) and the mask kernel are built here, not in the first measured step."""
    distinct = list({json.dumps(f, sort_keys=True): f for f in formats}.values())[:8]
    vocab = engine.tokenizer.vocab_size
    for i, fmt in enumerate(distinct):
        params = SamplingParams(max_tokens=4, ignore_eos=True, response_format=fmt)
        engine.add_request(EngineRequest(f"warm-grammar-{i}",
                                         [(31 * i + j) % (vocab - 1) + 1 for j in range(16)],
                                         params))
    while engine.has_unfinished():
        engine.step()


if __name__ == "__main__":
    main(*sys.argv[1:3])
