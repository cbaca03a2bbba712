"""JSON-schema-constrained decoding against free decoding: the engine alone, in one process.

The issue's target: at batch 256 on the H200, constrained decoding keeps >= 90% of free
decoding's output tok/s, with the grammar masks' time reported against the step time.

Grammar masks cost in proportion to the tokenizer's vocabulary, so the random presets' 260-token
byte tokenizer would make them look free. ``write-model`` therefore writes a Hugging Face
directory of a preset's shape (random weights, safetensors shards, config.json) holding a real
tokenizer (e.g. SmolLM2's 49,152 tokens beside Llama-3-8B's 128,256 logits); ``run`` and the
whole stack (``benchmarks/serving/serve.py --model DIR``) both load it as any model directory.

``run``: one engine (``--max-num-seqs`` 256), warmed up, then the same shape of work several
times over, each on fresh prompts (no prefix-cache hits between runs): 1000 requests of 256
prompt / 256 output tokens, greedy, free ones ``ignore_eos``:
  free         no request constrained;
  constrained  every request constrained by ``--schema`` (default ``DEFAULT_SCHEMA``: strings
               without maxLength, so a random model writes string characters until max_tokens
               and both sides produce the same number of tokens);
  half         every other request constrained;
  free_again   free once more: the spread between the two free runs is the noise;
  mixed        (with ``--schema-set``) requests cycling through a set of realistic schemas.
Per run: output tok/s and its ratio to the free run's, the mean step time (wall / steps), the
grammar masks' host time per step that computed masks and per masked row
(``engine.grammars.stats``), output lengths and finish reasons, and every constrained output
checked against its schema (``tidegate.benchmarks.harness.measure.json_check``). On CUDA also: the device time of
one full decode step (its CUDA graph replayed) and of the mask kernel over 256 rows.

    python -m tidegate.benchmarks.engine.structured_throughput write-model /tmp/llama8b-smollm2 \\
        --preset llama-3-8b --tokenizer .tokenizers/smollm2
    python -m tidegate.benchmarks.engine.structured_throughput run --model /tmp/llama8b-smollm2 \\
        --out $OUT/structured_offline.json
    # this CPU machine: a tiny shape with the real tokenizer and logits width
    python -m tidegate.benchmarks.engine.structured_throughput write-model /tmp/tiny-smollm2 --preset tiny \\
        --vocab-size 128256 --tokenizer smollm2
    python -m tidegate.benchmarks.engine.structured_throughput run --model /tmp/tiny-smollm2 --requests 32 \\
        --max-num-seqs 16 --input-len 32 --output-len 32
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import re
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]

from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.benchmarks.harness.measure.json_check import check_outputs, formats_from_file  # noqa: E402
from tidegate.model_files.model_source import resolve_model  # noqa: E402
from tidegate.model_files.tokenizer import load_tokenizer  # noqa: E402
from tidegate.protocol import SamplingParams  # noqa: E402
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402

# Four strings without maxLength (a random model keeps writing the first one), an integer and
# an array, all required: the grammar's states are those of real extraction schemas.
DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["name", "city", "age", "tags", "summary"],
    "additionalProperties": False,
}
SCHEMA_SET = ROOT / "tests/fixtures/json_schemas.json"
MARKER = "written_by.json"  # a finished write-model directory holds it last


# ---------------------------------------------------------------- write-model


def tokenizer_files(spec: str, out: Path) -> int:
    """Write the tokenizer of ``spec`` into the model directory ``out``; returns its vocabulary.
    ``spec``: a model spec (``smollm2``, a model directory) or a directory of tokenizer files
    alone (what ``Tokenizer.save`` writes: tokenizer.json, tokenizer_config.json, ...)."""
    from tokenizers import Tokenizer as Backend

    from tidegate.worker.quantization.checkpoint_writer import TOKENIZER_FILES

    path = Path(spec)
    if path.is_dir() and not (path / "config.json").is_file():
        if not (path / "tokenizer.json").is_file():
            raise SystemExit(f"{path} has no tokenizer.json")
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                shutil.copyfile(path / name, out / name)
        return Backend.from_file(str(path / "tokenizer.json")).get_vocab_size(True)
    tokenizer = load_tokenizer(resolve_model(spec))
    tokenizer.save(out)
    return tokenizer.vocab_size


def write_model(out: Path, preset: str, tokenizer_spec: str, *, vocab_size: int | None,
                device: str, seed: int) -> Path:
    """A Hugging Face directory: config.json of the preset's shape, its random weights
    (``init_random_weights``, one safetensors shard per layer) and the tokenizer's files.
    Kept as it is when a finished one with the same arguments is there already."""
    from safetensors.torch import save_file

    from tidegate.worker.models.decoder import hf_tensor_sources
    from tidegate.worker.models.loaders.loader import empty_model
    from tidegate.worker.models.loaders.random_weights import (
        init_random_weights,
        preset_llama_config,
    )
    from tidegate.worker.quantization.checkpoint_writer import hf_config_json

    asked = {"preset": preset, "tokenizer": tokenizer_spec, "vocab_size": vocab_size,
             "seed": seed}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("asked") == asked:
        print(f"{out}: written before, kept", flush=True)
        return out
    started = time.perf_counter()
    config = preset_llama_config(preset)
    if vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=vocab_size)
    if config.num_experts or config.family != "llama" or config.qkv_bias:
        raise SystemExit(f"write-model writes dense Llama shapes; {preset} is {config.family}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    vocab = tokenizer_files(tokenizer_spec, out)
    if vocab > config.vocab_size:
        raise SystemExit(f"the tokenizer has {vocab} tokens, more than the model's "
                         f"{config.vocab_size} logits (--vocab-size)")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = empty_model(config, device, dtype)
    init_random_weights(model, seed)
    # Fused parameters split back into the checkpoint's tensors (q, k, v; gate, up).
    rows = {"q_proj": config.num_heads * config.head_dim,
            "k_proj": config.num_kv_heads * config.head_dim,
            "v_proj": config.num_kv_heads * config.head_dim,
            "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for src in hf_tensor_sources(config):
        param = model.get_parameter(src.param).detach()
        parts = ([param] if len(src.names) == 1
                 else param.split([rows[n.split(".")[-2]] for n in src.names]))
        layer = re.match(r"model\.layers\.(\d+)\.", src.names[0])
        shard = shards.setdefault(int(layer.group(1)) + 1 if layer else 0, {})
        for name, part in zip(src.names, parts, strict=True):
            shard[name] = part
    total = len(shards)
    for k, tensors in sorted(shards.items()):
        # One shard at a time through host memory: an 8B model is never copied whole.
        save_file({n: t.contiguous().cpu() for n, t in tensors.items()},
                  str(out / f"model-{k + 1:05d}-of-{total:05d}.safetensors"),
                  metadata={"format": "pt"})
    del model, shards
    (out / "config.json").write_text(json.dumps(hf_config_json(config, dtype), indent=2) + "\n")
    check = load_tokenizer(resolve_model(str(out)))  # read back as every process will
    assert check.vocab_size == vocab, (check.vocab_size, vocab)
    took = time.perf_counter() - started
    marker.write_text(json.dumps({"asked": asked, "seconds": round(took, 1)}) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**30
    print(f"{out}: {preset} shape, vocabulary {config.vocab_size} logits / "
          f"{vocab} tokens, {size:.1f} GiB in {took:.0f}s", flush=True)
    return out


# ---------------------------------------------------------------- run


def json_schema_format(schema: dict[str, Any], name: str = "bench") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def plan_formats(kind: str, n: int, schema_fmt: dict[str, Any],
                 schema_set: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    if kind.startswith("free"):
        return [None] * n
    if kind == "constrained":
        return [schema_fmt] * n
    if kind == "half":
        return [schema_fmt if i % 2 == 0 else None for i in range(n)]
    assert kind == "mixed" and schema_set
    return [schema_set[i % len(schema_set)] for i in range(n)]


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    # Ids of the tokenizer's own (not past it into the logits' padding), away from its specials.
    lo, hi = min(1000, vocab // 4), vocab - 1
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def run_batch(engine: Engine, label: str, prompt_ids: list[list[int]], out_len: int,
              formats: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Every request added at once, stepped to the end (as ``gpu_throughput.run_requests``)."""
    params = [SamplingParams(max_tokens=out_len, ignore_eos=True, response_format=f)
              for f in formats]  # each format compiles here once, outside the timing
    before = dataclasses.replace(engine.grammars.stats)
    added = time.perf_counter()
    for i, (ids, p) in enumerate(zip(prompt_ids, params, strict=True)):
        engine.add_request(EngineRequest(f"{label}-{i}", ids, p))
    add_s = time.perf_counter() - added
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, tuple[int, str, str | None]] = {}
    produced = steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            if o.token_id is not None:
                produced += 1
                first.setdefault(o.request_id, now - start)
            if o.finish_reason is not None:
                done[o.request_id] = (o.num_output_tokens, o.output_text, o.finish_reason)
    wall = time.perf_counter() - start
    after = engine.grammars.stats
    fills, rows = after.fills - before.fills, after.rows - before.rows
    mask_s = after.seconds - before.seconds
    ids = [f"{label}-{i}" for i in range(len(prompt_ids))]
    lens = [done[r][0] for r in ids]
    constrained = sum(f is not None for f in formats)
    step_ms = 1000 * wall / steps
    ttft = sorted(first.values())
    result: dict[str, Any] = {
        "requests": len(ids), "constrained_requests": constrained, "wall_s": wall,
        "output_tokens": produced, "output_tok_s": produced / wall, "steps": steps,
        "step_ms": step_ms, "add_s": add_s, "ttft_p50_s": ttft[len(ttft) // 2],
        "output_len": {"min": min(lens), "mean": statistics.fmean(lens), "max": max(lens)},
        "finish_reasons": dict(Counter(done[r][2] for r in ids)),
        "mask_fills": fills, "mask_rows": rows, "mask_s": mask_s,
    }
    if fills:
        result |= {"mask_ms_per_fill": 1000 * mask_s / fills,
                   "mask_us_per_row": 1e6 * mask_s / rows,
                   "mask_rows_per_fill": rows / fills,
                   "mask_share_of_step": 1000 * mask_s / fills / step_ms}
    if constrained:
        check = check_outputs(((r, done[r][1], done[r][2]) for r in ids), formats)
        result["json_check"] = dataclasses.asdict(check)
        result["json_check_line"] = check.line()
        # Each text with its format's index among the run's distinct formats, for checking
        # apart (``--texts``).
        distinct: dict[str, int] = {}
        keys = [json.dumps(f, sort_keys=True) for f in formats]
        for key, f in zip(keys, formats, strict=True):
            if f is not None:
                distinct.setdefault(key, len(distinct))
        result["texts"] = {
            "formats": [json.loads(key) for key in distinct],
            "outputs": [{"id": r, "format": distinct[keys[i]], "finish_reason": done[r][2],
                         "tokens": done[r][0], "text": done[r][1]}
                        for i, r in enumerate(ids) if formats[i] is not None]}
    return result


def device_times(engine: Engine, model: Any, vocab: int, rows: int) -> dict[str, float]:
    """CUDA only: one full decode step's device time (its captured graph replayed, as
    ``gpu_throughput.decode_device_ms``) and the mask kernel's over ``rows`` masked rows."""
    from tidegate.benchmarks.engine.gpu_throughput import decode_device_ms
    from tidegate.benchmarks.harness.measure.cuda_timing import cuda_time_ms
    from tidegate.kernels import ops

    out: dict[str, float] = {}
    loaded = type("Loaded", (), {"model": model})()
    out |= decode_device_ms(engine, loaded)
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda", generator=g)
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, device="cuda",
                         generator=g)
    host = bits.cpu().pin_memory()
    index = torch.arange(rows, device="cuda")
    out["mask_apply_ms"] = cuda_time_ms(lambda: ops.apply_token_bitmask(logits, bits, index),
                                        iters=50)
    out["mask_upload_ms"] = cuda_time_ms(lambda: host.to("cuda", non_blocking=True), iters=50)
    out["mask_rows_timed"] = rows
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tidegate.worker.models.loaders.loader import load_model

    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    loaded = load_model(args.model, device=device, dtype=dtype)
    tokenizer = loaded.tokenizer
    schema = json.loads(Path(args.schema).read_text()) if args.schema else DEFAULT_SCHEMA
    schema_fmt = json_schema_format(schema)
    schema_set = formats_from_file(Path(args.schema_set)) if args.schema_set else []
    kinds = [k for k in args.runs if k != "mixed" or schema_set]
    results: dict[str, Any] = {
        **record.record(), "model": args.model, "device": device,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "logits_width": loaded.config.vocab_size,
        "tokenizer_vocab": tokenizer.vocab_size, "load_s": loaded.load_s,
        "schema": schema, "schema_set": args.schema_set, "schema_set_size": len(schema_set),
        "shape": {"requests": args.requests, "input_len": args.input_len,
                  "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
                  "max_num_batched_tokens": args.max_num_batched_tokens},
        "runs": {}}
    try:
        import llguidance

        results["llguidance"] = llguidance.__version__
    except ImportError:
        pass
    gc.collect()
    engine = Engine(loaded.model, tokenizer, EngineConfig(
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens))
    results["kv_cache"] = engine.kv_spec.describe()
    vocab = tokenizer.vocab_size
    # Warm: the kernels of mixed and decode steps, the grammar engine's token tables, each
    # schema's grammar, and the mask kernel, on prompts no run repeats.
    warm = max(8, min(96, args.requests // 4))
    warm_formats = [schema_fmt if i % 2 == 0 else (schema_set[i % len(schema_set)]
                                                   if schema_set else None)
                    for i in range(warm)]
    t0 = time.perf_counter()
    run_batch(engine, "warm", prompts(random.Random(99), warm, args.input_len, vocab),
              min(16, args.output_len), warm_formats)
    results["warm_s"] = time.perf_counter() - t0
    save = _saver(args, results)
    for k, kind in enumerate(kinds):
        formats = plan_formats(kind, args.requests, schema_fmt, schema_set)
        res = run_batch(engine, kind, prompts(random.Random(k), args.requests, args.input_len,
                                              vocab), args.output_len, formats)
        results["runs"][kind] = res
        free = results["runs"].get("free")
        if free is not None:
            res["ratio_to_free"] = res["output_tok_s"] / free["output_tok_s"]
        print(summary_line(kind, res), flush=True)
        save()
    if device.startswith("cuda"):
        results["device_ms"] = device_times(engine, loaded.model, loaded.config.vocab_size,
                                            args.max_num_seqs)
    save()
    return results


def summary_line(kind: str, r: dict[str, Any]) -> str:
    line = (f"{kind:<12} {r['output_tok_s']:9.1f} tok/s  ratio {r.get('ratio_to_free', 1.0):.3f}"
            f"  steps {r['steps']:5d}  step {r['step_ms']:6.2f} ms  "
            f"len {r['output_len']['mean']:.1f}  {r['finish_reasons']}")
    if r.get("mask_fills"):
        line += (f"\n{'':12} masks: {r['mask_ms_per_fill']:.3f} ms per step that masked "
                 f"({r['mask_rows_per_fill']:.0f} rows, {r['mask_us_per_row']:.1f} us a row, "
                 f"{100 * r['mask_share_of_step']:.1f}% of the mean step)")
    if "json_check_line" in r:
        line += f"\n{'':12} {r['json_check_line']}"
    return line


def _saver(args: argparse.Namespace, results: dict[str, Any]):
    """Results to ``--out`` (outputs' texts to ``--texts`` apart: they are large)."""
    def save() -> None:
        texts = {k: r.get("texts") for k, r in results["runs"].items() if r.get("texts")}
        slim = {**results, "runs": {k: {n: v for n, v in r.items() if n != "texts"}
                                    for k, r in results["runs"].items()}}
        Path(args.out).write_text(json.dumps(slim, indent=1, default=float))
        if args.texts:
            Path(args.texts).write_text(json.dumps(texts))
    return save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-model", help="write a random-weight model directory")
    w.add_argument("out", type=Path)
    w.add_argument("--preset", default="llama-3-8b")
    w.add_argument("--tokenizer", default="smollm2",
                   help="a model spec or a directory of tokenizer files (default %(default)s)")
    w.add_argument("--vocab-size", type=int, help="logits width (default: the preset's)")
    w.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    w.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="free against constrained decoding")
    r.add_argument("--model", required=True, help="e.g. a write-model directory")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--requests", type=int, default=1000)
    r.add_argument("--input-len", type=int, default=256)
    r.add_argument("--output-len", type=int, default=256)
    r.add_argument("--max-num-seqs", type=int, default=256)
    r.add_argument("--max-num-batched-tokens", type=int, default=16384)
    r.add_argument("--max-model-len", type=int, default=4096)
    r.add_argument("--schema", help="a JSON schema file (default: DEFAULT_SCHEMA)")
    r.add_argument("--schema-set", default=str(SCHEMA_SET) if SCHEMA_SET.is_file() else None,
                   help="a file of schemas or response formats for the mixed run "
                        "(default: tests/fixtures/json_schemas.json where it exists)")
    r.add_argument("--runs", nargs="+", default=["free", "constrained", "half", "free_again",
                                                 "mixed"],
                   choices=["free", "constrained", "half", "free_again", "mixed"])
    r.add_argument("--out", default="structured_offline.json")
    r.add_argument("--texts", help="the constrained outputs' texts (JSON), for checking apart")
    args = ap.parse_args()
    if args.command == "write-model":
        write_model(args.out, args.preset, args.tokenizer, vocab_size=args.vocab_size,
                    device=args.device, seed=args.seed)
        return
    results = run(args)
    print(f"\n{results['device_name']}; {results['model']}: {results['logits_width']} logits, "
          f"{results['tokenizer_vocab']} tokenizer tokens; {results['kv_cache']}")
    for kind, res in results["runs"].items():
        print(summary_line(kind, res))
    if "device_ms" in results:
        print("device:", {k: round(v, 3) for k, v in results["device_ms"].items()})


if __name__ == "__main__":
    main()
