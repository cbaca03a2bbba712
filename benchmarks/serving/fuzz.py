"""Fuzz benchmark: generated input against the real stack (``tidegate up``: API, gateway and a
worker on the tiny random model, auth on with two keys, a redis-server of its own), every HTTP
route from the served OpenAPI document (schemathesis, valid and schema-breaking cases) and the
WebSocket and SSE endpoints (hypothesis). Counts requests, 5xx answers, hangs (no answer or no
end within 30 s), broken sockets (1006, resets) and the tracebacks in the server's log; p99
latency.

    python -m tidegate.benchmarks.serving.fuzz --requests 20000 --json benchmarks/results/serving/fuzz.json

Exit status 1 unless the run is clean (0 5xx, 0 hangs, 0 broken sockets, 0 tracebacks).
``tests/e2e/test_fuzz.py`` runs the same with a budget of about a minute.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from tidegate.benchmarks.harness.measure import record
from tidegate.benchmarks.serving.fuzzing.http_cases import fuzz_http, operations
from tidegate.benchmarks.serving.fuzzing.socket_cases import (
    finished_jobs,
    fuzz_sse,
    fuzz_submit_socket,
    fuzz_watch_socket,
)
from tidegate.benchmarks.serving.fuzzing.stack import FuzzStack, redis_server, tidegate_up
from tidegate.benchmarks.serving.fuzzing.tally import LogProblems, Tally, log_problems

SOCKET_SHARE = 0.25  # of the requests: WebSocket sessions and SSE streams, split in three


@dataclass(frozen=True, slots=True)
class Budget:
    http_examples: int  # per operation and generation mode
    socket_examples: int  # per socket target (submit socket, watch socket, SSE)

    @classmethod
    def for_requests(cls, requests: int, operations: int) -> Budget:
        sockets = int(requests * SOCKET_SHARE) // 3
        # A POST /v1/jobs that is accepted adds its cancel: about one request in 20.
        http = (requests - 3 * sockets) / (2 * operations * 1.05)
        return cls(max(1, round(http)), max(1, sockets))


def run(stack: FuzzStack, budget: Budget, tally: Tally) -> None:
    fuzz_http(stack, tally, examples=budget.http_examples)
    jobs = finished_jobs(stack)
    fuzz_submit_socket(stack, tally, jobs, examples=budget.socket_examples)
    fuzz_watch_socket(stack, tally, jobs, examples=budget.socket_examples)
    fuzz_sse(stack, tally, jobs, examples=budget.socket_examples)


def fuzz(requests: int, log: Path, redis_url: str | None = None) -> tuple[Tally, LogProblems, float]:
    """Start the stack, fuzz it with about ``requests`` requests, stop it; (tally, log, s)."""
    tally = Tally()
    with (redis_server() if redis_url is None else nullcontext(redis_url)) as url, \
            tidegate_up(url, log) as stack:
        budget = Budget.for_requests(requests, len(list(operations(stack))))
        started = time.monotonic()
        run(stack, budget, tally)
        elapsed = time.monotonic() - started
    return tally, log_problems(log), elapsed


def report(tally: Tally, problems: LogProblems, elapsed_s: float) -> dict[str, object]:
    return {**tally.summary(), "tracebacks": problems.tracebacks,
            "log_exceptions": dict(problems.exceptions), "log_error_lines": problems.error_lines,
            "elapsed_s": round(elapsed_s, 1),
            "requests_per_s": round(tally.requests / elapsed_s, 1) if elapsed_s else 0.0,
            "failures": {"server_errors": tally.server_errors, "hangs": tally.hangs,
                         "broken": tally.broken},
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "python": platform.python_version(), "record": record.record()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--redis-url", help="an existing Redis (default: a private redis-server)")
    parser.add_argument("--log", type=Path, help="the stack's log (default: a temporary file)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    log = args.log or Path(tempfile.mkdtemp(prefix="tidegate-fuzz-")) / "stack.log"
    tally, problems, elapsed = fuzz(args.requests, log, args.redis_url)
    figures = report(tally, problems, elapsed)
    print(json.dumps({k: v for k, v in figures.items() if k != "failures"}, indent=1))
    for kind, found in figures["failures"].items():  # type: ignore[union-attr]
        for detail in found:
            print(f"--- {kind}: {detail}")
    print(f"stack log: {log}")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if tally.clean and problems.clean else 1


if __name__ == "__main__":
    sys.exit(main())
