"""Packed GGUF weights on the CPU, side by side in one run: llama.cpp (llama-cpp-python) on the
same GGUF file and threads, tidegate's engine on the packed weights with 8-bit activations (the
default, llama.cpp's numerics) and with float32 activations (exactly the float32 model's
outputs), and tidegate's engine on the same weights dequantized to float32 (what it served
before).

Workloads (greedy; ``ignore_eos`` on tidegate's side, llama.cpp's generator never stops):
  batch1  one chat prompt (the chat template around a question), 128 new tokens: prefill time
          and ms per output token (the median decode step, and the mean); tidegate's 8-bit
          default also with a native call per decoder layer (``layer_by_layer``) instead of one
          for the whole stack, to show what the Python between layers costs, and with its
          blocks in the file's rows layout (``rows_layout``) where this CPU's kernels repack
          them to lanes8.
  mixed   32 requests, prompts uniform in 64-512 tokens, outputs uniform in 64-256
          (``benchmarks/engine/engine_cpu.py``'s workload), all submitted at t=0: output tokens/s.
          tidegate only (llama-cpp-python serves one sequence at a time).

Rounds alternate the runs (the host's speed drifts); each run's median round is reported.
Once per invocation: the greedy tokens of 8 chat prompts x 48 tokens, 8-bit activations against
the float32 engine (first divergence per prompt, ``tests/worker/engine/test_packed_engine.py``'s
set), ``tidegate eval-ppl`` on --ppl-text in both activation modes and llama.cpp's perplexity
over the same token ids (--no-ppl skips them), and
where a decode step's time goes at batch 32 and longer contexts (--no-attention skips it): the
step, and the paged attention kernel alone over the same cache, with float32 and int8 KV.

``--kernel-defines TIDEGATE_NO_AVX512`` builds tidegate's kernels as an AVX2-only CPU would run
them (llama.cpp's side is as llama-cpp-python was built: ``-DGGML_AVX512=OFF`` to match).

Usage:  python -m tidegate.benchmarks.engine.quantized_cpu [--threads 2] [--repeats 3] [--no-mixed] [--no-ppl]
            [--out benchmarks/results/engine/quantized_cpu.json] [--plot benchmarks/results/engine/quantized_cpu.png]
llama.cpp: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON" \\
           pip install --no-deps llama-cpp-python diskcache   (the native build crashed here)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tidegate.benchmarks.engine.engine_cpu import mixed_workload, run_tidegate  # noqa: E402
from tidegate.benchmarks.harness.greedy import PROMPTS, first_divergence, generate
from tidegate.benchmarks.harness.measure import record
from tidegate.kernels import ops
from tidegate.kernels.cpu.native_cpu import use_native_kernels
from tidegate.protocol import SamplingParams  # noqa: E402
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from tidegate.worker.models.loaders.loader import LoadedModel, load_model  # noqa: E402
from tidegate.worker.models.perplexity import score_windows
from tidegate.worker.service.cpu_tuning import keep_large_allocations  # noqa: E402

QUESTION = "What is the capital of France? Answer in one sentence, please."
NEW_TOKENS = 128
PPL_TEXT = "/usr/share/common-licenses/GPL-3"  # benchmarks/engine/quantize_ppl.py scores the same


@dataclass
class Batch1:
    name: str
    prompt_tokens: int
    prefill_ms: float
    decode_ms_median: float
    decode_ms_mean: float
    tokens: list[int]

    @property
    def tok_s(self) -> float:
        return 1000.0 / self.decode_ms_mean


def tidegate_batch1(name: str, loaded: LoadedModel, prompt: list[int]) -> Batch1:
    engine = Engine(loaded.model, loaded.tokenizer,
                    EngineConfig(max_model_len=2048, max_num_seqs=1, kv_cache_gb=0.25))
    engine.add_request(EngineRequest("b1", prompt, SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)))
    steps: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        steps.append(1000 * (time.perf_counter() - start))
        tokens += [o.token_id for o in outs if o.token_id is not None]
    decode = steps[1:]
    return Batch1(name, len(prompt), steps[0], statistics.median(decode),
                  statistics.fmean(decode), tokens)


@contextmanager
def rows_layout() -> Iterator[None]:
    """Models loaded with their GGUF blocks in the file's rows layout, where the loader would
    repack some to lanes8 for this CPU (``ops.cpu_layout``): the same bits."""
    real = ops.cpu_layout
    ops.cpu_layout = lambda weight: weight  # type: ignore[assignment]
    try:
        yield
    finally:
        ops.cpu_layout = real


@contextmanager
def layer_by_layer() -> Iterator[None]:
    """The engine with a native call per decoder layer instead of one for the stack (what it
    ran before ``ops.decoder_layers``): the same bits, the Python around each layer back."""
    real = ops.decoder_layers
    ops.decoder_layers = lambda *_args: None  # type: ignore[assignment]
    try:
        yield
    finally:
        ops.decoder_layers = real


def llama_cpp_batch1(llm, prompt: list[int]) -> Batch1:  # noqa: ANN001
    llm.reset()
    times: list[float] = []
    tokens: list[int] = []
    last = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        now = time.perf_counter()
        times.append(1000 * (now - last))
        last = now
        tokens.append(int(token))
        if len(tokens) == NEW_TOKENS:
            break
    decode = times[1:]  # the first includes the prompt's evaluation
    return Batch1("llama.cpp (llama-cpp-python)", len(prompt), times[0],
                  statistics.median(decode), statistics.fmean(decode), tokens)


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}); the JSON has every figure")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    b1 = [(k.removeprefix("b1 "), v) for k, v in runs.items() if k.startswith("b1 ")]
    mixed = [(k.removeprefix("mixed "), v) for k, v in runs.items() if k.startswith("mixed ")]
    fig, axes = plt.subplots(1, 2 if mixed else 1, figsize=(11 if mixed else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.bar([n for n, _ in b1], [v["decode_ms_mean"] for _, v in b1],
           color=["#888", "#2ca02c", "#98df8a", "#1f77b4"][:len(b1)])
    ax.set_title(f"batch 1: ms per output token ({report['machine']['threads']} threads)")
    for i, (_, v) in enumerate(b1):
        ax.text(i, v["decode_ms_mean"], f"{v['decode_ms_mean']:.1f}", ha="center", va="bottom")
    if mixed:
        ax = axes[0][1]
        ax.bar([n for n, _ in mixed], [v["output_tok_s"] for _, v in mixed],
               color=["#1b7a1b", "#2ca02c", "#98df8a", "#1f77b4"][-len(mixed):])
        ax.set_title("32 mixed requests: output tokens/s")
        for i, (_, v) in enumerate(mixed):
            ax.text(i, v["output_tok_s"], f"{v['output_tok_s']:.0f}", ha="center", va="bottom")
    for ax in axes[0]:
        ax.tick_params(axis="x", labelsize=8)
        # "tidegate packed int8, int8 KV" -> two lines: the names are wider than their bars
        ax.set_xticks(ax.get_xticks(), [t.get_text().replace("tidegate ", "tidegate\n")
                                        for t in ax.get_xticklabels()])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def eval_ppl(text: str, activations: str, threads: int) -> dict[str, object]:
    """``tidegate eval-ppl`` on the default model, as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "tidegate", "eval-ppl", "smollm2", "--text", text, "--json",
         "--cpu-activations", activations], capture_output=True, text=True, check=False,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)})  # torch's thread count
    if done.returncode != 0:
        raise SystemExit(f"eval-ppl failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cpp_ppl(gguf: Path, ids: list[int], context: int, threads: int) -> dict[str, object]:
    """llama.cpp's perplexity over the token ids tidegate's tokenizer gives the text, in the
    windows ``tidegate eval-ppl`` scores (``score_windows``). llama.cpp's own tokenizer cuts some
    runs of whitespace differently (7,639 tokens against 7,658 on the GPL-3 text), so
    ``llama-perplexity`` scores other windows: only the same ids compare the numerics."""
    from llama_cpp import Llama

    llm = Llama(str(gguf), n_ctx=context, n_batch=context, n_ubatch=context, logits_all=True,
                n_threads=threads, n_threads_batch=threads, verbose=False)

    def logits_of(window: torch.Tensor, first: int) -> torch.Tensor:
        llm.reset()
        llm.eval(window.tolist())
        return torch.from_numpy(llm.scores[first:len(window) - 1])

    return asdict(score_windows(ids, logits_of, context=context))


def decode_attention(loaded: LoadedModel, context: int, kv: str, batch: int = 32,
                     steps: int = 8) -> dict[str, float]:
    """Decode steps of ``batch`` sequences with ``context``-token prompts (random tokens):
    the median step, and the paged attention kernel alone over every layer of the same cache
    and tables (the part of the step an 8-bit cache shrinks)."""
    from tidegate.kernels.cpu.native_cpu import native_kernels
    from tidegate.kernels.cpu.paged_attention import PagedAttentionMetadata

    rng = random.Random(context)
    cfg = loaded.config
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=context + steps + 8, max_num_seqs=batch, max_num_batched_tokens=2048,
        num_blocks=batch * (-(-(context + steps + 8) // 16)) + 1, kv_cache_dtype=kv))
    for i in range(batch):
        engine.add_request(EngineRequest(str(i), [rng.randrange(100, cfg.vocab_size - 100)
                                                  for _ in range(context)],
                                         SamplingParams(max_tokens=steps + 4, ignore_eos=True)))
    while engine.num_waiting or any(len(s.output_ids) == 0 for s in engine.scheduler.running):
        engine.step()  # prompts, until every sequence decodes
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
    seqs = engine.scheduler.running
    tables = [engine.blocks.block_table(s.request_id) for s in seqs]  # as the kernel sees them
    lens = [s.num_computed for s in seqs]
    meta = PagedAttentionMetadata.build(tables, lens, [1] * len(seqs), [0] * len(seqs))
    native = native_kernels()
    assert native is not None
    q = torch.randn(len(seqs), cfg.num_heads, cfg.head_dim)
    cache = engine.runner.kv_cache
    attention = []
    for _ in range(3):
        start = time.perf_counter()
        for layer in range(cfg.num_layers):
            native.paged_decode(q, cache[layer, 0], cache[layer, 1], meta.block_tables,
                                meta.seq_lens, cfg.head_dim ** -0.5)
        attention.append(1000 * (time.perf_counter() - start))
    return {"step_ms": round(statistics.median(times), 2),
            "attention_ms": round(statistics.median(attention), 2)}


def prompt_set_agreement(int8: LoadedModel, dequantized: LoadedModel) -> dict[str, int | None]:
    """First output position where the 8-bit engine's greedy tokens part from the float32
    engine's, per prompt (None: the same 48 tokens)."""
    want, got = generate(dequantized), generate(int8)
    return {PROMPTS[int(k)]: first_divergence(want[k], got[k]) for k in want}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-mixed", action="store_true", help="batch1 only")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-ppl", action="store_true", help="skip eval-ppl in both modes")
    ap.add_argument("--no-attention", action="store_true",
                    help="skip the batch-32 decode steps at long contexts")
    ap.add_argument("--ppl-text", default=PPL_TEXT)
    ap.add_argument("--kernel-defines", nargs="+", default=[], metavar="NAME",
                    help="build tidegate's kernels with these -D names (TIDEGATE_NO_AVX512: "
                         "the AVX2 path an AVX2-only CPU runs)")
    ap.add_argument("--out", default="benchmarks/results/engine/quantized_cpu.json")
    ap.add_argument("--plot", default="benchmarks/results/engine/quantized_cpu.png")
    ap.add_argument("--replot", metavar="JSON", help="only redraw --plot from a written JSON")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.plot)
        return

    torch.set_num_threads(args.threads)
    keep_large_allocations()
    if args.kernel_defines:
        forced = use_native_kernels(tuple(args.kernel_defines))
        print(f"tidegate's kernels built with {args.kernel_defines}: 8-bit path {forced.q8_path}")
    packed = load_model("smollm2", packed=True, cpu_activations="int8")
    with rows_layout():
        packed_rows = load_model("smollm2", packed=True, cpu_activations="int8")
    exact = load_model("smollm2", packed=True, cpu_activations="float")
    dequantized = load_model("smollm2", packed=False)
    assert packed.source.path is not None
    prompt = packed.tokenizer.encode_prompt(None, [{"role": "user", "content": QUESTION}])
    llm = None
    if not args.no_llama_cpp:
        from llama_cpp import Llama

        llm = Llama(str(packed.source.path), n_ctx=1024, n_threads=args.threads,
                    n_threads_batch=args.threads, n_batch=512, verbose=False)
    vocab = packed.config.vocab_size
    mixed = mixed_workload(0, vocab)

    rounds: list[dict[str, object]] = []
    for r in range(args.repeats):
        got: dict[str, object] = {}
        if llm is not None:
            got["b1 llama.cpp"] = llama_cpp_batch1(llm, prompt)
        got["b1 tidegate packed int8"] = tidegate_batch1(
            "tidegate, packed Q4_1/Q8_0, 8-bit activations", packed, prompt)
        got["b1 tidegate packed int8, rows layout"] = tidegate_batch1(
            "tidegate, packed Q4_1/Q8_0, 8-bit activations, the file's rows layout (no lanes8)",
            packed_rows, prompt)
        with layer_by_layer():
            got["b1 tidegate packed int8, a call per layer"] = tidegate_batch1(
                "tidegate, packed Q4_1/Q8_0, 8-bit activations, a native call per layer",
                packed, prompt)
        got["b1 tidegate packed float"] = tidegate_batch1(
            "tidegate, packed Q4_1/Q8_0, float32 activations", exact, prompt)
        got["b1 tidegate float32"] = tidegate_batch1("tidegate, dequantized float32",
                                                     dequantized, prompt)
        if not args.no_mixed:
            for key, loaded, kv in (("packed int8, int8 KV", packed, "int8"),
                                    ("packed int8", packed, "auto"),
                                    ("packed float", exact, "auto"),
                                    ("float32", dequantized, "auto")):
                got[f"mixed tidegate {key}"] = run_tidegate(f"mixed tidegate {key}", loaded, mixed,
                                                            kv_cache_dtype=kv)
        rounds.append(got)
        print(f"round {r + 1}: " + ", ".join(
            f"{k} {v.decode_ms_mean:.2f} ms/tok" if isinstance(v, Batch1)
            else f"{k} {v.tokens_per_s:.1f} tok/s" for k, v in got.items()), flush=True)

    def median_of(key: str):  # noqa: ANN202
        runs = [rnd[key] for rnd in rounds]
        score = (lambda v: v.decode_ms_mean) if isinstance(runs[0], Batch1) else (
            lambda v: v.wall_s)
        return sorted(runs, key=score)[len(runs) // 2], [round(score(v), 2) for v in runs]

    report: dict[str, object] = {
        **record.record(),
        "machine": {**record.machine(), "cpu": record.cpu_model(), "threads": args.threads},
        "kernel_defines": args.kernel_defines,
        "model": str(packed.source.path.name), "prompt_tokens": len(prompt),
        "weight_mb": {"packed": round(packed.weight_bytes() / 1e6, 1),
                      "float32": round(dequantized.weight_bytes() / 1e6, 1)},
        "runs": {},
    }
    for key in rounds[0]:
        best, all_rounds = median_of(key)
        entry = asdict(best) if isinstance(best, Batch1) else best.summary()
        entry.pop("tokens", None)
        entry["rounds"] = all_rounds
        if isinstance(best, Batch1):
            entry["tok_s"] = round(best.tok_s, 1)
        report["runs"][key] = entry  # type: ignore[index]
    b1 = {k: median_of(k)[0] for k in rounds[0] if k.startswith("b1")}
    report["greedy_first_divergence"] = {
        "packed float vs float32": first_divergence(b1["b1 tidegate packed float"].tokens,
                                                    b1["b1 tidegate float32"].tokens),
        "packed int8 vs float32": first_divergence(b1["b1 tidegate packed int8"].tokens,
                                                   b1["b1 tidegate float32"].tokens),
        **({"packed int8 vs llama.cpp": first_divergence(b1["b1 tidegate packed int8"].tokens,
                                                         b1["b1 llama.cpp"].tokens),
            "float32 vs llama.cpp": first_divergence(b1["b1 tidegate float32"].tokens,
                                                     b1["b1 llama.cpp"].tokens)}
           if "b1 llama.cpp" in b1 else {}),
    }
    report["prompt_set_int8_vs_float32"] = prompt_set_agreement(packed, dequantized)
    if not args.no_attention:
        report["decode_batch32"] = {f"context {ctx}, {kv} KV": decode_attention(packed, ctx, kv)
                                    for ctx in (512, 1024, 2048) for kv in ("auto", "int8")}
    if not args.no_ppl:
        report["eval_ppl"] = {mode: eval_ppl(args.ppl_text, mode, args.threads)
                              for mode in ("float", "int8")}
        if llm is not None:
            del llm  # its context's memory, before another
            ids = packed.tokenizer.encode(Path(args.ppl_text).read_text(encoding="utf-8"))
            report["eval_ppl"]["llama.cpp, the same tokens"] = llama_cpp_ppl(
                packed.source.path, ids, 512, args.threads)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
