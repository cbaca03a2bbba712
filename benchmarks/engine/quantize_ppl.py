"""Perplexity of the default model under each ``tidegate quantize`` method, side by side.

Each method quantizes the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF: the only
weights shipped, so every method re-quantizes already 4-bit weights) into a compressed-tensors
directory with the real command, then ``tidegate eval-ppl`` scores one text on the packed GGUF
and on each checkpoint, same windows, same threads. GPTQ and AWQ calibrate on a different text.

    python -m tidegate.benchmarks.engine.quantize_ppl --out benchmarks/results/engine/quantize_ppl.json

``--only fp8`` (repeatable) runs those methods (and the source again) and merges their rows
into ``--out``, replacing rows of the same label.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tidegate.benchmarks.harness.measure import record

EVAL_TEXT = "/usr/share/common-licenses/GPL-3"
CALIBRATION_TEXT = "/usr/share/common-licenses/GPL-2"
METHODS = [
    ("rtn-int8", []), ("rtn-int4", []), ("rtn-int4", ["--asymmetric"]),
    ("gptq-int4", ["--calibration", CALIBRATION_TEXT]),
    ("gptq-int4", ["--calibration", CALIBRATION_TEXT, "--asymmetric"]),
    ("awq-int4", ["--calibration", CALIBRATION_TEXT]),
    ("awq-int4", ["--calibration", CALIBRATION_TEXT, "--asymmetric"]),
    ("fp8", []),
]


def tidegate(*args: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "tidegate", *args, "--json"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tidegate {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default=EVAL_TEXT)
    ap.add_argument("--context", default="512")
    ap.add_argument("--out", default="quantize_ppl.json")
    ap.add_argument("--only", action="append", choices=sorted({m for m, _ in METHODS}),
                    help="run only this method (repeatable), merging its rows into --out")
    args = ap.parse_args()
    methods = [(m, extra) for m, extra in METHODS if not args.only or m in args.only]
    rows: list[dict[str, object]] = []
    base = tidegate("eval-ppl", args.model, "--text", args.text, "--context", args.context)
    rows.append({"method": "source (packed GGUF)", **base})
    print(rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (method, extra) in enumerate(methods):
            out = Path(tmp) / f"q{i}"
            start = time.perf_counter()
            written = tidegate("quantize", args.model, str(out), "--method", method, *extra)
            quantize_s = time.perf_counter() - start
            ppl = tidegate("eval-ppl", str(out), "--text", args.text, "--context",
                           args.context)
            label = method + (" asymmetric" if "--asymmetric" in extra else "")
            rows.append({"method": label, "quantize": written, "quantize_s": quantize_s, **ppl,
                         "ppl_delta": ppl["ppl"] - base["ppl"]})  # type: ignore[operator]
            print(rows[-1], flush=True)
    result = {**record.record(), "text": args.text,
              "calibration": CALIBRATION_TEXT, "rows": rows}
    if args.only and Path(args.out).exists():  # earlier rows stay, in their order
        result = json.loads(Path(args.out).read_text())
        fresh = {row["method"]: row for row in rows}
        result["rows"] = [fresh.pop(row["method"], row) for row in result["rows"]]
        result["rows"] += list(fresh.values())
        result.setdefault("merged_runs", []).append(record.command())
    Path(args.out).write_text(json.dumps(result, indent=1))
    for row in rows:
        print(f"{row['method']:<28} ppl {row['ppl']:8.3f}  {row['weights']}, "
              f"{row['weight_mb']} MB")


if __name__ == "__main__":
    main()
