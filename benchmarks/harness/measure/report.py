"""The benchmark's output: one table row per run, the JSON of everything, the rate plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tidegate.benchmarks.harness.measure.metrics import Dist, RunSummary

COLUMNS = ("kind", "jobs", "done", "tok/s", "alone", "ratio", "TTFT p50/p99", "TPOT p50/p99",
           "ITL p50/p99", "E2E p50/p99 s", "goodput", "exact")


def _pair(d: Dist, scale: float = 1.0, digits: int = 1) -> str:
    if d.p50 is None or d.p99 is None:
        return "-"
    return f"{d.p50 * scale:.{digits}f}/{d.p99 * scale:.{digits}f}"


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def row(s: RunSummary) -> list[str]:
    return [s.label, str(s.jobs), str(s.completed), _num(s.output_tok_s),
            _num(s.engine_alone_tok_s), _num(s.ratio_to_engine_alone, ".2f"),
            _pair(s.ttft_ms), _pair(s.tpot_ms, digits=2), _pair(s.itl_ms, digits=2),
            _pair(s.e2e_ms, 1e-3, 2), _num(s.goodput_jobs_s, ".2f"), "yes" if s.exact else "NO"]


def table(runs: list[RunSummary]) -> str:
    rows = [list(COLUMNS), *(row(s) for s in runs)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + "\n(latencies in ms except E2E; goodput in jobs/s)"


def worker_time_line(name: str, t: dict[str, float], duration_s: float) -> str:
    """Where a worker's time went over the run."""
    if not t or duration_s <= 0:
        return f"  {name}: no time counters"
    return (f"  {name}: in engine steps {t.get('engine_step_seconds', 0) / duration_s:.0%} of "
            f"the run; engine thread CPU {t.get('engine_host_cpu_seconds', 0):.2f} s, event "
            f"loop CPU {t.get('worker_loop_cpu_seconds', 0):.2f} s (publisher "
            f"{t.get('publisher_cpu_seconds', 0):.2f} s); {t.get('event_writes', 0):.0f} "
            f"writes, {t.get('events_written', 0):.0f} events")


def _pair90(d: Dist) -> str:
    return f"{_num(d.p50, '.0f')}/{_num(d.p90, '.0f')}"


def run_details(s: RunSummary) -> str:
    """The lines under a run's row: what the table has no room for."""
    gen, stack = s.generator, ", ".join(f"{k} {v:.0%}" for k, v in s.stack_cpu_share.items())
    lines = [f"{s.label}: {s.duration_s:.2f} s, {s.request_throughput:.2f} req/s, "
             f"{s.output_tok_s:.0f} out tok/s, {s.total_tok_s:.0f} total tok/s, "
             f"{s.tokens_per_event} tokens/event, failed {s.failed}, rejected {s.rejected}",
             f"  submit p50/p99 {_pair(s.submit_ms)} ms, follower attached p50/p99 "
             f"{_pair(s.attach_ms)} ms after the 202",
             f"  generator: {gen['processes']:.0f} proc(s), {gen['cores']:.2f} cores "
             f"(busiest {gen['busiest_process_share']:.0%}); submit lag p99 "
             f"{_num(s.submit_lag_ms.p99, '.1f')} ms; stack CPU: {stack}"]
    if s.offered_output_tok_s is not None:
        steady = ("-" if s.steady_delivered_share is None
                  else f"{s.steady_delivered_share:.0%}")
        lines.append(f"  offered {s.offered_output_tok_s:.0f} out tok/s, delivered "
                     f"{s.delivered_share:.0%} over the run, {steady} while the pipeline was "
                     f"full (arrivals came to {s.arrival_rate} req/s)")
    if s.engine_alone_tok_s is not None and s.same_text_as_engine_alone is not None:
        lines.append(f"  engine alone {s.engine_alone_tok_s:.0f} out tok/s: the stack delivers "
                     f"{s.ratio_to_engine_alone:.2f}x; same text as the engine alone: "
                     f"{s.same_text_as_engine_alone:.0%} of jobs")
    if s.engine_alone:
        e = s.engine_alone
        steady = e.get("steady_delivered_share")
        lines.append(f"  engine alone on the same arrivals: {s.engine_alone_tok_s:.0f} out "
                     f"tok/s ({s.ratio_to_engine_alone:.2f}x), TTFT p50/p99 "
                     f"{_pair(Dist(**e['ttft_ms']))} ms, TPOT p50/p99 "
                     f"{_pair(Dist(**e['tpot_ms']))} ms, "
                     f"delivered {'-' if steady is None else f'{steady:.0%}'} while full")
    if s.slo_goodput_jobs_s is not None:
        lines.append(f"  SLO goodput {s.slo_goodput_jobs_s:.2f} jobs/s")
    if s.cold:
        cold, steady = s.cold, s.steady
        lines.append(f"  first {cold['jobs']} jobs: TTFT p50/p90 {_pair90(cold['ttft_ms'])} ms, "
                     f"queue p90 {_num(cold['queue_ms'].p90, '.0f')} ms; the rest: TTFT "
                     f"p50/p90 {_pair90(steady['ttft_ms'])} ms, queue p90 "
                     f"{_num(steady['queue_ms'].p90, '.0f')} ms; cold/steady TTFT p90 "
                     f"{_num(s.cold_ttft_p90_ratio, '.2f')}")
    lines += [worker_time_line(name, t, s.duration_s) for name, t in s.worker_time.items()]
    if s.json_outputs:
        lines.append(f"  {s.json_outputs['line']}")
    lines += [f"  not exact: {e}" for e in s.failure_examples]
    lines += [f"  note: {n}" for n in s.notes]
    return "\n".join(lines)


def capacity_lines(capacity: dict) -> str:
    lines = []
    if sub := capacity.get("submit"):
        lines.append(f"capacity: {sub['submits_per_s']:.0f} submits/s ({sub['accepted']}/"
                     f"{sub['jobs']} accepted; generator {sub['generator']['cores']:.2f} cores, "
                     f"API {sub['stack_cpu_share'].get('api', 0):.0%})")
    if fol := capacity.get("follow"):
        lines.append(f"capacity: follow {fol['events_per_s']:.0f} events/s, "
                     f"{fol['tokens_per_s']:.0f} tokens/s over {fol['streams']} streams "
                     f"({'/'.join(fol['follow'])}; generator {fol['generator']['cores']:.2f} "
                     f"cores, gateway {fol['stack_cpu_share'].get('gateway', 0):.0%}; "
                     f"exact {'yes' if fol['exact'] else 'NO'})")
    return "\n".join(lines)


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=_plain))


def _plain(obj: object) -> object:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)  # type: ignore[call-overload]
    raise TypeError(f"{type(obj).__name__} is not JSON")


def plot(runs: list[RunSummary], path: Path) -> str:
    """TTFT and TPOT p50/p99 against the request rate (log y), and achieved vs offered output
    tok/s; returns what was done, for the log."""
    rated = sorted((s for s in runs if s.request_rate is not None),
                   key=lambda s: s.request_rate or 0)
    if not rated:
        return "plot: no Poisson runs (--rates), nothing to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: matplotlib is not installed (pip install '.[bench]'); skipped"
    rates = [s.request_rate for s in rated]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, name, attr in ((axes[0], "TTFT", "ttft_ms"), (axes[1], "TPOT", "tpot_ms")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(rates, [getattr(getattr(s, attr), q) for s in rated], style, label=q)
        ax.set_yscale("log")
        ax.set_title(f"{name} (ms)")
    axes[2].plot(rates, [s.offered_output_tok_s for s in rated], "k:", label="offered")
    axes[2].plot(rates, [s.output_tok_s for s in rated], "o-", label="achieved")
    axes[2].set_title("output tokens/s")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle("tidegate serving benchmark")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return f"plot: {path}"
