"""Speculative decoding (n-gram / prompt-lookup drafts) against plain decoding, engine alone.

The workload quotes its input: each request gives a text and asks to repeat it, fix its
typos, or rewrite it keeping its wording, the shapes where prompt lookup finds its drafts
(summaries and edits of a given text). Greedy, fresh prompts per run. Per batch size (requests
submitted at once): plain and speculative output tok/s, their ratio, the acceptance rate and
tokens per verify chunk. The issue's targets on this CPU, default model: batch 1 >= 1.8x
plain; batch 32 never slower than plain. Speculation runs as a worker runs it: where the
engine measures it faster (``SpeculationGovernor``). The GPU's figures: speculative_gpu.py.

    python -m tidegate.benchmarks.engine.speculative --batches 1 32 --out benchmarks/results/engine/speculative_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tidegate.protocol import SamplingParams  # noqa: E402
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from tidegate.worker.models.loaders.loader import load_model  # noqa: E402
from tidegate.worker.speculative.speculative_engine import speculative_engine  # noqa: E402

TEXTS = [
    "The committee approved the new budget for the harbour bridge, which will be repainted in "
    "the spring and reopened to traffic in June. Residents asked for a second footpath on the "
    "eastern side, and the council promised to study it before the summer recess.",
    "Our quarterly report shows that revenue grew by twelve percent, mostly from the new "
    "subscription plans, while costs stayed flat. The support team answered most tickets "
    "within four hours, and customer satisfaction reached its highest level in two years.",
    "To install the tool, download the archive, unpack it into your home directory and add "
    "the bin folder to your PATH. Then run the setup command once; it creates a configuration "
    "file that you can edit later to change the default server and the log level.",
    "The museum will open a new wing dedicated to maritime history next month. It holds ship "
    "models, navigation instruments and letters written by sailors in the nineteenth century, "
    "and guided tours will run every afternoon except on Mondays.",
]
ASKS = ["Repeat the following text exactly, word for word:",
        "Correct any spelling mistakes in this text and return it in full:",
        "Rewrite this text in the same words, as a single paragraph:"]


def prompts(loaded, n: int, offset: int) -> list[list[int]]:  # noqa: ANN001
    out = []
    for i in range(n):
        k = i + offset
        text = TEXTS[k % len(TEXTS)]
        ask = ASKS[(k // len(TEXTS)) % len(ASKS)]
        # A distinct first line per request: no prefix-cache help between runs.
        out.append(loaded.tokenizer.encode_prompt(None, [
            {"role": "user", "content": f"Request {k}. {ask}\n\n{text}"}]))
    return out


def run(engine: Engine, batch: list[list[int]], max_tokens: int, tag: str) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    for i, ids in enumerate(batch):
        engine.add_request(EngineRequest(f"{tag}-{i}", ids, params))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(o.token_id is not None for o in engine.step())
    secs = time.perf_counter() - start
    return {"seconds": secs, "tokens": tokens, "tok_s": tokens / secs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch", type=int,
                    help="speculative_max_batch: speculate at batch sizes up to it, without "
                         "measuring (default: the governor measures, as a worker does)")
    ap.add_argument("--out")
    args = ap.parse_args()
    loaded = load_model(args.model)
    results = []
    for n, batch in enumerate(args.batches):
        row: dict[str, object] = {"batch": batch}
        for mode in ("plain", "ngram"):  # the same prompts for both
            engine = speculative_engine(loaded.model, loaded.tokenizer, EngineConfig(
                max_model_len=2048, max_num_seqs=max(batch, 1), num_blocks=2048,
                max_num_batched_tokens=max(512, batch * (args.k + 1)),
                speculative=None if mode == "plain" else "ngram",
                num_speculative_tokens=args.k, speculative_max_batch=args.max_batch))
            run(engine, prompts(loaded, min(batch, 2), 10_000), 8, "warm")
            # Every repeat its own prompts (no prefix-cache hits), the same for both modes;
            # the figures are the sums over the repeats.
            engine.reset_stats()
            secs = tokens = 0.0
            for r in range(args.repeats):
                offset = 1000 * n + 100 * r
                got = run(engine, prompts(loaded, batch, offset), args.max_tokens, f"{mode}{r}")
                secs += got["seconds"]
                tokens += got["tokens"]
            stats = engine.stats
            row[mode] = {"seconds": secs, "tokens": tokens, "tok_s": tokens / secs,
                         "steps": stats.steps, "draft": stats.draft_tokens,
                         "accepted": stats.accepted_tokens, "verify": stats.verify_chunks}
        plain, spec = row["plain"], row["ngram"]
        row["speedup"] = spec["tok_s"] / plain["tok_s"]  # type: ignore[index]
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "args": vars(args),
                                              "results": results}, indent=1))
    for row in results:
        s = row["ngram"]
        acc = s["accepted"] / s["draft"] if s["draft"] else 0.0  # type: ignore[index,operator]
        print(f"batch {row['batch']:>3}: plain {row['plain']['tok_s']:7.1f} tok/s, ngram "  # type: ignore[index]
              f"{s['tok_s']:7.1f} tok/s (x{row['speedup']:.2f}), acceptance {acc:.2f}")  # type: ignore[index]


if __name__ == "__main__":
    main()
