"""Plot a fleet benchmark's result (``benchmarks/cluster/fleet.py``): per mode, the token events/s
delivered against the offered job rate (where each saturates), the probe's p99 delivery latency
against the load as a share of that mode's capacity, and the busiest Redis shard's CPU.

    python -m tidegate.benchmarks.cluster.plot_fleet benchmarks/results/cluster/fleet.json [-o fleet.png]

matplotlib is optional for the benchmark itself: ``.venv/bin/pip install matplotlib``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLORS = {"server": "tab:blue", "cluster": "tab:orange"}


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("matplotlib is not installed: .venv/bin/pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    target_ms = result.get("targets", {}).get("p99_ms_at_80pct", 50)
    for mode, m in result["modes"].items():
        color = COLORS.get(mode, None)
        label = f"{mode} ({m['shards']} shard{'s' if m['shards'] > 1 else ''})"
        ramp = sorted(m["steps"], key=lambda s: s["offered_jobs_per_s"])
        a.plot([s["offered_jobs_per_s"] for s in ramp],
               [s["delivered_token_events_per_s"] for s in ramp], "o-", color=color, label=label)
        cap = m["capacity"]["delivered_token_events_per_s"]
        a.axhline(cap, color=color, ls=":", lw=1)
        # Load: the offered job rate as a share of the job rate sustained at capacity (the 80%
        # step is offered 80% of that); past 100% the fleet is overloaded.
        cap_jobs = (m["capacity"].get("sustained_jobs_per_s")
                    or m["capacity"]["completed_jobs_per_s"])
        every = ramp + ([m["at_80pct"]] if m.get("at_80pct") else [])
        every.sort(key=lambda s: s["offered_jobs_per_s"])
        loads = [100 * s["offered_jobs_per_s"] / cap_jobs if cap_jobs else 0 for s in every]
        b.plot(loads, [s["latency_ms"]["p99"] for s in every], "o-", color=color,
               label=f"{mode} p99")
        b.plot(loads, [s["latency_ms"]["p50"] for s in every], "s--", color=color, alpha=0.6,
               label=f"{mode} p50")
        if m.get("at_80pct"):
            s80 = m["at_80pct"]
            b.plot([100 * s80["offered_jobs_per_s"] / cap_jobs], [s80["latency_ms"]["p99"]],
                   "*", ms=14, color=color)
        c.plot([s["offered_jobs_per_s"] for s in ramp],
               [s["cpu_pct"].get("redis", {}).get("max_pct", 0) for s in ramp], "o-",
               color=color, label=f"{mode}: busiest Redis shard")
        c.plot([s["offered_jobs_per_s"] for s in ramp],
               [s["cpu_pct"].get("gateway", {}).get("max_pct", 0) for s in ramp], "^--",
               color=color, alpha=0.6, label=f"{mode}: busiest gateway")
        c.plot([s["offered_jobs_per_s"] for s in ramp],
               [s["cpu_pct"].get("worker", {}).get("max_pct", 0) for s in ramp], "v:",
               color=color, alpha=0.6, label=f"{mode}: busiest worker")
    a.set_xscale("log", base=2)
    a.set_xlabel("offered jobs/s")
    a.set_ylabel("token events/s delivered to watchers")
    a.set_title("throughput (dotted: capacity)")
    a.legend()
    b.axhline(target_ms, color="grey", ls="--", lw=1, label=f"target p99 {target_ms:g} ms")
    b.axvline(80, color="grey", ls=":", lw=1)
    b.set_xlabel("offered jobs/s, % of the job rate sustained at capacity")
    b.set_ylabel("publish -> receive latency (ms)")
    b.set_yscale("log")
    b.set_title("delivery latency (star: the 80% step)")
    b.legend(fontsize=8)
    c.set_xscale("log", base=2)
    c.set_xlabel("offered jobs/s")
    c.set_ylabel("CPU % of one core")
    c.set_ylim(0, 110)
    c.set_title("what saturates")
    c.legend(fontsize=7)
    machine = result.get("machine", {})
    ratio = result.get("ratio", {}).get("cluster_over_server")
    fig.suptitle(f"tidegate fleet: {machine.get('nproc')} cores ({machine.get('cpu_model', '')})"
                 + (f"; cluster/server capacity {ratio}x" if ratio is not None else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, nargs="?",
                    default=Path(__file__).resolve().parents[1] / "results" / "cluster" / "fleet.json")
    ap.add_argument("-o", "--out", type=Path, default=None,
                    help="default: the result's name with .png")
    args = ap.parse_args()
    out = args.out or args.result.with_suffix(".png")
    plot(json.loads(args.result.read_text()), out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
