"""Each job's first-token time in arrival order, at the start of a rate's run, from serve.py
result files saved with ``--save-detailed``: where a cold wave shows as one stall that the
jobs behind it wait out.

    python -m tidegate.benchmarks.serving.plot_cold_wave benchmarks/results/serving/cold_wave.png \
        --run "rate 10/s" --jobs 60 "e1a6f64:mixed_base.json.gz" "f1fc910:mixed_new.json.gz"

Each series is ``label:path`` (``.json`` or ``.json.gz``); the run is named as in the result's
``jobs`` (``burst``, ``rate 10/s``). Drawn: the server's TTFT and its queue wait (enqueue to
the worker's start) of the run's first ``--jobs`` jobs.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def first_jobs(path: str, run: str, count: int) -> list[dict]:
    raw = Path(path).read_bytes()
    data = json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)
    jobs = data.get("jobs", {}).get(run)
    if not jobs:
        raise SystemExit(f"{path}: no per-job details for run {run!r} (saved with "
                         f"--save-detailed? runs there: {sorted(data.get('jobs', {}))})")
    return sorted(jobs, key=lambda j: j["index"])[:count]


def main(out: str, run: str, count: int, series: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_ax, queue_ax) = plt.subplots(1, 2, figsize=(12, 4), sharex=True)
    for item in series:
        label, _, path = item.partition(":")
        jobs = first_jobs(path, run, count)
        order = [j["index"] for j in jobs]
        ttft_ax.plot(order, [j["server_timings"]["ttft_ms"] for j in jobs], marker=".",
                     label=label)
        queue_ax.plot(order, [j["server_timings"]["queue_ms"] for j in jobs], marker=".",
                      label=label)
    for ax, title in ((ttft_ax, "TTFT (ms, server)"), (queue_ax, "queue wait (ms)")):
        ax.set_title(title)
        ax.set_xlabel(f"job, in arrival order ({run})")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the PNG to write")
    p.add_argument("series", nargs="+", help="label:path of a serve.py result")
    p.add_argument("--run", default="rate 10/s", help="which run's jobs (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=60, help="its first this many jobs")
    args = p.parse_args()
    main(args.out, args.run, args.jobs, args.series)
