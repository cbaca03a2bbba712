"""What a fuzz run saw: requests and their outcomes, every 5xx, hang or broken socket with the
input that caused it, latencies, and the server log's tracebacks."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

KEEP = 20  # failures kept in full per kind (the counts go on)
_ERROR_LINE = re.compile(r"\bERROR\b|\bCRITICAL\b")


@dataclass
class Tally:
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)  # "http 400", "ws 4400", ...
    by_target: Counter[str] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # a 5xx answer (or 1011 close)
    server_error_count: int = 0
    hangs: list[str] = field(default_factory=list)  # no answer within the bound
    hang_count: int = 0
    broken: list[str] = field(default_factory=list)  # 1006, a reset, a protocol error
    broken_count: int = 0
    deadline_answers: int = 0  # 504: the request's own timeout_s/deadline_ms passed first
    latencies_s: list[float] = field(default_factory=list)

    def record(self, target: str, outcome: str, latency_s: float) -> None:
        self.requests += 1
        self.by_target[target] += 1
        self.outcomes[outcome] += 1
        self.latencies_s.append(latency_s)

    def server_error(self, detail: str) -> None:
        self.server_error_count += 1
        if len(self.server_errors) < KEEP:
            self.server_errors.append(detail[:2000])

    def hang(self, detail: str) -> None:
        self.hang_count += 1
        if len(self.hangs) < KEEP:
            self.hangs.append(detail[:2000])

    def broke(self, detail: str) -> None:
        self.broken_count += 1
        if len(self.broken) < KEEP:
            self.broken.append(detail[:2000])

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return 0.0
        ordered = sorted(self.latencies_s)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def clean(self) -> bool:
        return not (self.server_error_count or self.hang_count or self.broken_count)

    def summary(self) -> dict[str, object]:
        return {"requests": self.requests, "server_errors": self.server_error_count,
                "hangs": self.hang_count, "broken_sockets": self.broken_count,
                "deadline_answers_504": self.deadline_answers,
                "p50_ms": round(self.percentile_ms(0.50), 1),
                "p99_ms": round(self.percentile_ms(0.99), 1),
                "max_ms": round(1000 * max(self.latencies_s, default=0.0), 1),
                "by_target": dict(sorted(self.by_target.items())),
                "outcomes": dict(sorted(self.outcomes.items()))}


@dataclass(frozen=True, slots=True)
class LogProblems:
    tracebacks: int
    exceptions: Counter[str]  # each traceback's last line ("ValueError: ..."), counted
    error_lines: list[str]  # ERROR / CRITICAL records

    @property
    def clean(self) -> bool:
        return not (self.tracebacks or self.error_lines)


def log_problems(path: Path) -> LogProblems:
    """What a server log holds that a clean run's never does."""
    lines = path.read_text(errors="replace").splitlines()
    exceptions: Counter[str] = Counter()
    tracebacks = 0
    last: str | None = None  # the exception ending the current chain of tracebacks
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        chained = i >= 2 and lines[i - 2].startswith(("During handling", "The above"))
        if chained and last is not None:
            exceptions[last] -= 1  # one chain, counted once, by the exception that ended it
        else:
            tracebacks += 1
        last = _exception_line(lines, i)
        exceptions[last] += 1
    exceptions = +exceptions  # drop the zero counts
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return LogProblems(tracebacks, exceptions, errors[:KEEP])


def _exception_line(lines: list[str], start: int) -> str:
    """The ``Type: message`` line that ends the traceback starting at ``start``."""
    for line in lines[start + 1:]:
        if line and not line.startswith((" ", "Traceback", "During handling", "The above")):
            return line[:200]
    return "?"
