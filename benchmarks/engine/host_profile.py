"""Whether the host or the device sets the pace of an offline run, and where the host's time goes.

The engine launches each step before it reads the previous step's tokens (``async_scheduling``),
so a step's host work (scheduling, the step's inputs, reading tokens, detokenizing, outputs)
hides behind the device's work until it takes longer. This runs ``gpu_throughput.py``'s offline
workload (1000 prompts of 256 tokens, 256 output tokens each, all submitted at once) twice:

  timed     no profiler: wall time, and the time ``engine.step()`` spent waiting for sampled
            tokens (the one host synchronisation of a step). Wall minus that wait is the host's
            busy time; a wait near zero means the host set the pace.
  phases    no profiler: each step's time split into scheduling (schedule + commit), the
            launch (the step's inputs, the graph replay or eager kernels, the sampler's queue),
            the read (waiting for the device, then the tokens to lists), the outputs (the
            detokenizer and each request's output) and the rest; medians over the decode-only
            steps of 1000 rows.
  profiled  under cProfile: the functions with the most own time (the profiler slows Python
            code several times, small calls most: read shares, not absolute times).

    python -m tidegate.benchmarks.engine.host_profile --device cuda --model random:llama-3-8b --quantize fp8 \\
        --kv-cache-dtype fp8 --out $OUT/host_profile.json
    python -m tidegate.benchmarks.engine.host_profile --device cpu --model random:tiny --num 1000 --output-len 64
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import pstats
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.protocol import SamplingParams  # noqa: E402
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from tidegate.worker.engine.sampler import SamplerLaunch, SamplerOutput  # noqa: E402
from tidegate.worker.engine.scheduler import SchedulerOutput  # noqa: E402
from tidegate.worker.models.loaders.loader import load_model  # noqa: E402


@dataclasses.dataclass(slots=True)
class Waits:
    """Seconds ``engine.step()`` spent in the device synchronisation that reads sampled tokens."""

    seconds: float = 0.0
    reads: int = 0


def timed_reads(engine: Engine, waits: Waits) -> None:
    """Make every launched step's read count its wait in ``waits`` (the engine is unchanged
    otherwise: the launch object is the runner's own, its ``read`` wrapped)."""
    launch = engine.runner.sample  # what every step's SamplerLaunch comes from

    def launch_timed(*args: object, **kwargs: object) -> SamplerLaunch:
        launched = launch(*args, **kwargs)  # type: ignore[arg-type]
        read = launched.read

        def read_timed() -> SamplerOutput:
            start = time.perf_counter()
            out = read()
            waits.seconds += time.perf_counter() - start
            waits.reads += 1
            return out

        return dataclasses.replace(launched, read=read_timed)

    engine.runner.sample = launch_timed  # type: ignore[method-assign]


@dataclasses.dataclass(slots=True)
class Phases:
    """Seconds of one ``engine.step()`` by part; ``decode_only``: the step it launched was."""

    schedule: float = 0.0
    launch: float = 0.0
    read: float = 0.0
    outputs: float = 0.0
    total: float = 0.0
    decode_only: bool = False


def timed_phases(engine: Engine, steps: list[Phases]) -> Callable[[], None]:
    """Time each part of every step into ``steps`` (one entry per ``engine.step()``); returns
    what restores the engine. The wrappers cost ~0.3 us a call (2 per output token)."""
    sched, runner = engine.scheduler, engine.runner
    originals = (sched.schedule, sched.commit, runner.forward, runner.sample, engine._emit,
                 engine.step)
    schedule, commit, forward, launch, emit, step = originals
    now = time.perf_counter

    def wrap_schedule() -> SchedulerOutput:
        start = now()
        out = schedule()
        steps[-1].schedule += now() - start
        steps[-1].decode_only = bool(out.chunks) and all(c.is_decode for c in out.chunks)
        return out

    def wrap_commit(out: SchedulerOutput) -> None:
        start = now()
        commit(out)
        steps[-1].schedule += now() - start

    def wrap_forward(*args: object, **kwargs: object) -> object:
        start = now()
        out = forward(*args, **kwargs)  # type: ignore[arg-type]
        steps[-1].launch += now() - start
        return out

    def wrap_launch(*args: object, **kwargs: object) -> SamplerLaunch:
        start = now()
        launched = launch(*args, **kwargs)  # type: ignore[arg-type]
        steps[-1].launch += now() - start
        read = launched.read

        def read_timed() -> SamplerOutput:
            start = now()
            out = read()
            steps[-1].read += now() - start
            return out

        return dataclasses.replace(launched, read=read_timed)

    def wrap_emit(seq: object, sampled: object) -> object:
        start = now()
        out = emit(seq, sampled)  # type: ignore[arg-type]
        steps[-1].outputs += now() - start
        return out

    def wrap_step() -> list[object]:
        steps.append(Phases())
        start = now()
        out = step()
        steps[-1].total = now() - start
        return out  # type: ignore[return-value]

    sched.schedule, sched.commit = wrap_schedule, wrap_commit  # type: ignore[method-assign]
    runner.forward, runner.sample = wrap_forward, wrap_launch  # type: ignore[method-assign]
    engine._emit, engine.step = wrap_emit, wrap_step  # type: ignore[method-assign, assignment]

    def restore() -> None:
        (sched.schedule, sched.commit, runner.forward, runner.sample, engine._emit,  # type: ignore[method-assign]
         engine.step) = originals  # type: ignore[assignment]

    return restore


def phase_medians(steps: list[Phases]) -> dict[str, float]:
    """Median ms of each part over the decode-only steps, and how many there were."""
    decode = [p for p in steps if p.decode_only]
    if not decode:
        return {}
    out: dict[str, float] = {"decode_steps": len(decode)}
    for part in ("schedule", "launch", "read", "outputs", "total"):
        out[f"{part}_ms"] = 1e3 * statistics.median(getattr(p, part) for p in decode)
    out["rest_ms"] = out["total_ms"] - sum(out[f"{p}_ms"] for p in
                                           ("schedule", "launch", "read", "outputs"))
    out["host_ms"] = out["total_ms"] - out["read_ms"]
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(engine: Engine, reqs: list[tuple[list[int], int]], device: str, prefix: str,
        profiler: cProfile.Profile | None = None) -> dict[str, float]:
    for i, (prompt, out_len) in enumerate(reqs):
        engine.add_request(EngineRequest(f"{prefix}{i}", prompt, SamplingParams(
            max_tokens=out_len, ignore_eos=True)))
    sync(device)
    produced = steps = 0
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(o.token_id is not None for o in engine.step())
        steps += 1
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
    return {"wall_s": wall, "steps": steps, "output_tokens": produced,
            "output_tok_s": produced / wall}


def prompts(seed: int, n: int, input_len: int, output_len: int, vocab: int
            ) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lo, hi = min(1000, vocab // 4), max(vocab - 1000, vocab * 3 // 4)
    return [([rng.randrange(lo, hi) for _ in range(input_len)], output_len) for _ in range(n)]


def top_functions(profiler: cProfile.Profile, n: int) -> list[dict[str, object]]:
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_cc, calls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        short = str(Path(path).relative_to(ROOT)) if path.startswith(str(ROOT)) else Path(path).name
        rows.append({"function": f"{short}:{line}({name})", "calls": calls,
                     "own_s": round(own, 4), "cum_s": round(cum, 4)})
    rows.sort(key=lambda r: r["own_s"], reverse=True)  # type: ignore[arg-type, return-value]
    return rows[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", default="none")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default="host_profile.json")
    args = ap.parse_args()

    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device,
                        quantize=args.quantize)
    gc.collect()
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=4096, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
        # As on a GPU, where they are the default: the CPU then runs the same host code.
        async_output=True, async_scheduling=True))
    waits = Waits()
    timed_reads(engine, waits)
    vocab = loaded.config.vocab_size
    # Warm: enough requests that steps mix decodes and prompt chunks (their kernels compile here).
    run(engine, prompts(12, 96, args.input_len, 16, vocab), args.device, "w")
    reqs = prompts(2, args.num, args.input_len, args.output_len, vocab)
    waits.seconds, waits.reads = 0.0, 0
    timed = run(engine, reqs, args.device, "t")
    timed |= {"wait_s": waits.seconds, "host_busy_s": timed["wall_s"] - waits.seconds,
              "host_busy_ms_per_step": 1e3 * (timed["wall_s"] - waits.seconds) / timed["steps"],
              "wait_ms_per_step": 1e3 * waits.seconds / timed["steps"]}
    print("timed", json.dumps({k: round(v, 3) for k, v in timed.items()}), flush=True)
    steps: list[Phases] = []
    restore = timed_phases(engine, steps)
    # Each run its own prompts: the same ones again would hit the prefix cache.
    phased = run(engine, prompts(3, args.num, args.input_len, args.output_len, vocab),
                 args.device, "s")
    restore()
    phased |= phase_medians(steps)
    print("phases", json.dumps({k: round(v, 3) for k, v in phased.items()}), flush=True)
    profiler = cProfile.Profile()
    profiled = run(engine, prompts(4, args.num, args.input_len, args.output_len, vocab),
                   args.device, "p", profiler)
    top = top_functions(profiler, args.top)
    print("profiled", json.dumps({k: round(v, 3) for k, v in profiled.items()}))
    for row in top[:25]:
        print(f"{row['own_s']:8.3f} {row['cum_s']:8.3f} {row['calls']:8d}  {row['function']}")
    result = {**record.record(), "args": vars(args), "timed": timed,
              "phases": phased, "profiled": profiled, "top_own": top}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
